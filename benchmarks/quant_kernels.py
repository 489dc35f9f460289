"""The candidate CPU kernels for a quantized linear, side by side on the default
model's shapes: torch float32 (`x @ W.T` with W stored [in, out], the float
path), torch bf16 `F.linear`, torch's int8 weight-only op
`aten._weight_int8pack_mm` (per-channel scales, bf16 and float32 activations),
torch's int4 op `aten._weight_int4pack_mm_for_cpu` (groups of 32, bf16
activations; torchao's CPU int4 layout calls this same op), and kvserve's
kernels (csrc/kvq_kernels.c) on Q8_0 and Q4_1 blocks. Same random weights for
all; one linear at a time in a loop (so a small weight is cache-warm; the LM
head, 28-113 MB, is not). Median of repeated calls.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2]

Prints a table (ms per call) and writes benchmarks/results/quant_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.model.quantized import QuantizedWeight

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"LM head 49152x576": (49152, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
BATCHES = (1, 32, 256)


def median_ms(fn, min_time_s: float = 0.3) -> float:
    for _ in range(2):
        fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def candidates(weight: torch.Tensor) -> dict:
    """name -> (callable on x [M, K] float32, bytes of weight it reads)."""
    n, k = weight.shape
    w_t = weight.t().contiguous()
    w_bf16 = weight.bfloat16()
    scale = weight.abs().amax(1) / 127
    w_int8 = torch.round(weight / scale[:, None]).to(torch.int8)
    int4 = torch.clamp(torch.round(weight.view(n, k // 32, 32) / (weight.view(n, k // 32, 32).abs().amax(-1,
                       keepdim=True) / 7) + 8), 0, 15).to(torch.int32).view(n, k)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4, 1)
    scales_zeros = torch.stack([torch.rand(k // 32, n), torch.zeros(k // 32, n)], -1).bfloat16()
    q8, q41 = QuantizedWeight.from_float("q8_0", weight), QuantizedWeight.from_float("q4_1", weight)
    return {
        "torch f32 x@W": (lambda x: torch.mm(x, w_t), n * k * 4),
        "torch bf16 linear": (lambda x: F.linear(x.bfloat16(), w_bf16), n * k * 2),
        "int8pack_mm bf16 act": (lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w_int8,
                                                                              scale.bfloat16()), n * k),
        "int8pack_mm f32 act": (lambda x: torch.ops.aten._weight_int8pack_mm(x, w_int8, scale), n * k),
        "int4pack_mm bf16 act": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), packed4, 32, scales_zeros), n * k // 2),
        "kvq Q8_0": (q8.matmul, q8.nbytes),
        "kvq Q4_1": (q41.matmul, q41.nbytes),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_kernels.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    for shape_name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=gen) * 0.05
        for name, (fn, num_bytes) in candidates(weight).items():
            for m in BATCHES:
                if m == 256 and n > 10_000:
                    continue  # the LM head runs on the sampled rows only
                x = torch.randn(m, k, generator=gen)
                ms = median_ms(lambda: fn(x))
                results.append({"shape": shape_name, "kernel": name, "batch": m, "ms": ms,
                                "weight_gb_per_s": num_bytes / ms / 1e6, "gflop_per_s": 2 * m * n * k / ms / 1e6})
    kernels = list(dict.fromkeys(r["kernel"] for r in results))
    columns = [(s, m) for s in SHAPES for m in BATCHES if not (m == 256 and SHAPES[s][0] > 10_000)]
    print(f"ms per call, {args.threads} threads\n")
    print("| kernel | " + " | ".join(f"{s} M={m}" for s, m in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for kernel in kernels:
        cells = [next(r["ms"] for r in results if r["kernel"] == kernel and (r["shape"], r["batch"]) == c)
                 for c in columns]
        print(f"| {kernel} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    Path(args.out).write_text(json.dumps({"threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
                                          "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
