"""Two builds of csrc/kvq_kernels.c side by side: the quantized matmul
(`kvq_matmul`) of each .so on the default model's shapes, the same weights and
activations, calls alternating between the builds so the machine's load drifts
over both alike. Reports GOP/s (2*M*N*K per call; min over the rounds of each
build's median) and the new/old speed ratio, and checks the two builds' outputs
are bit-identical.

    .venv/bin/python benchmarks/kvq_ab.py --old /tmp/old_kvq.so [--new src/kvserve/model/_kvq.so]
        [--qtype q4_1] [--threads 1 2] [--batches 1 4 16 256]

Prints a table and writes benchmarks/results/kvq_ab.json (--out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvserve.model import quantized
from kvserve.model.quantized import QUANT_TYPES, QuantizedWeight

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}
F32 = 0


def load(path: str) -> ctypes.CDLL:
    """A build of the kernels under its own name, so two load side by side."""
    lib = ctypes.CDLL(os.path.abspath(path))
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.kvq_matmul.argtypes = [i32, ptr, i64, i64, ptr, i32, i64, i32, ptr, f32,
                               i64, ptr, i32, i64, ptr, i32, i64, i32]
    lib.kvq_matmul.restype = i32
    return lib


def call(lib: ctypes.CDLL, weight: QuantizedWeight, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    m, k = x.shape
    status = lib.kvq_matmul(QUANT_TYPES[weight.qtype][0], weight.packed.data_ptr(), weight.out_features, k,
                            x.data_ptr(), F32, k, 0, None, 0.0, m, y.data_ptr(), F32, weight.out_features,
                            None, 0, 0, threads)
    assert status == 0


def seconds_per_call(fn, min_time_s: float) -> float:
    """Median time of one call, over at least min_time_s and 3 calls."""
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the baseline build (copy the .so before rebuilding)")
    parser.add_argument("--new", default=str(quantized.LIBRARY_PATH))
    parser.add_argument("--qtype", default="q4_1", choices=sorted(QUANT_TYPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 256])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of old and new per case")
    parser.add_argument("--min-time", type=float, default=0.15, help="seconds per build per round")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kvq_ab.json"))
    args = parser.parse_args()
    builds = {"old": load(args.old), "new": load(args.new)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for threads in args.threads:
        for shape, (n, k) in SHAPES.items():
            weight = QuantizedWeight.from_float(args.qtype, torch.randn(n, k, generator=gen) * 0.05)
            for m in args.batches:
                x = torch.randn(m, k, generator=gen)
                outs = {name: torch.empty(m, n) for name in builds}
                best = {name: float("inf") for name in builds}
                for _ in range(args.rounds):
                    for name, lib in builds.items():
                        best[name] = min(best[name], seconds_per_call(
                            lambda: call(lib, weight, x, outs[name], threads), args.min_time))
                gop = {name: 2 * m * n * k / s / 1e9 for name, s in best.items()}
                rows.append({"threads": threads, "shape": shape, "M": m, "old_gop_s": gop["old"],
                             "new_gop_s": gop["new"], "speedup": gop["new"] / gop["old"],
                             "bit_identical": bool(torch.equal(outs["old"], outs["new"]))})
                r = rows[-1]
                print(f"| {threads} | {shape} | {m} | {r['old_gop_s']:.1f} | {r['new_gop_s']:.1f} | "
                      f"{r['speedup']:.2f}x | {r['bit_identical']} |", flush=True)
    load_avg = os.getloadavg()
    print(f"\n{args.qtype}; load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "qtype": args.qtype,
                                          "old": args.old, "new": args.new, "load_average": load_avg,
                                          "results": rows}, indent=1))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
