"""Where a decode step's milliseconds go: the torch profiler over decode steps of
the default model at batch 1 and 32 (context ~128 tokens), plus the step time
at 128 and 2,048 tokens of context, for `--quantization none` (the float path)
and `auto` (the shipped Q4_1 computed quantized).

The native kernels are ctypes calls, invisible to the profiler: each is
wrapped in `record_function` here (only here), so the table names them
(kvq_matmul, kvq_decode_attention, kvq_rope_write_kv, kvq_dequantize_rows, and
kvq_decode_layers: a decode-only step's layers in one call).

    .venv/bin/python benchmarks/step_profile.py [--threads 2] [--quantization none,auto]

Prints the tables; writes benchmarks/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvserve.contract import SamplingParams
from kvserve.engine.core import EngineConfig, EngineCore
from kvserve.model import quantized
from kvserve.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("kvq_matmul", "kvq_decode_attention", "kvq_rope_write_kv", "kvq_dequantize_rows", "kvq_decode_layers")


def label_kernels() -> None:
    lib = quantized.require_kernels()
    for name in KERNELS:
        fn = getattr(lib, name)

        def wrapped(*args, _fn=fn, _name=name):
            with record_function(_name):
                return _fn(*args)
        setattr(lib, name, wrapped)


def decoding_engine(quantization: str, batch: int, context_tokens: int) -> EngineCore:
    """An engine with `batch` requests past their prefill, about to decode at
    `context_tokens` of context."""
    loaded = load_model(None, quantization=quantization)
    core = EngineCore(loaded.config, loaded.weights, loaded.tokenizer,
                      EngineConfig(quantization=quantization, device="cpu", kv_cache_memory_bytes=2**30,
                                   max_num_batched_tokens=2048))
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    requests = []
    for i in range(batch):
        prompt = [(100 + 37 * i + 11 * j) % 40_000 + 100 for j in range(context_tokens)]
        requests.append(core.new_request(prompt, params))
        core.add_request(requests[-1])
    while any(r.num_output_tokens == 0 for r in requests):  # every prefill done
        core.step()
    for _ in range(3):  # and a few decodes (one-time costs)
        core.step()
    return core


def step_ms(core: EngineCore, num_steps: int) -> dict:
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "min_ms": times[0] * 1e3}


def profile_table(core: EngineCore, num_steps: int) -> tuple[str, list[dict]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            core.step()
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=15)
    rows = sorted(({"name": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / num_steps,
                    "calls_per_step": e.count / num_steps} for e in events),
                  key=lambda r: -r["self_ms_per_step"])[:15]
    return table, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch / OpenMP threads")
    parser.add_argument("--quantization", default="none,auto")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per measurement")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_profile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    label_kernels()
    report = {"threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    for quantization in args.quantization.split(","):
        for batch, context in ((1, 128), (32, 128), (1, 2048)):
            core = decoding_engine(quantization, batch, context)
            run = {"quantization": quantization, "batch": batch, "context_tokens": context,
                   **step_ms(core, args.steps)}
            if context == 128:
                table, run["profile"] = profile_table(core, args.steps)
                print(f"\n### --quantization {quantization}, batch {batch}, context {context}: "
                      f"step p50 {run['p50_ms']:.1f} ms\n\n{table}")
            else:
                print(f"\n### --quantization {quantization}, batch {batch}, context {context}: "
                      f"step p50 {run['p50_ms']:.1f} ms")
            report["runs"].append(run)
            del core
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
