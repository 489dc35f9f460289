"""Decode step time of two source trees side by side: each tree's EngineCore
(default model, `--quantization auto`: the shipped Q4_1 computed quantized)
runs in its own worker process, and the driver alternates one measurement at
a time between them, so the machine's load drifts over both alike. A
measurement is `batch` fresh requests (prompts of --prompt-tokens tokens,
greedy, ignore_eos) prefilled, then --steps decode steps timed one by one
(wall time of EngineCore.step: scheduler, model, sampler, outputs).

    .venv/bin/python benchmarks/decode_ab.py --old /tmp/old_tree [--new .] [--batches 1 8]
        [--rounds 5] [--threads 2] [--steps 64] [--prompt-tokens 256]
    .venv/bin/python benchmarks/decode_ab.py --old . --new-engine '{"kv_cache_dtype": "bfloat16"}'

--old-engine / --new-engine: EngineConfig fields (JSON) for that side's
EngineCore, so one tree A/Bs a setting against itself.

A tree is a checkout with src/kvserve and its built _kvq.so; both run on this
tree's .venv. Prints the median and min step per tree and batch, and the
ratio of the medians; writes benchmarks/results/decode_ab.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tree_ab import default_model_core, start_worker, timed_decode_steps

ROOT = Path(__file__).resolve().parents[1]


def worker(threads: int, prompt_tokens: int, engine_fields: dict) -> int:
    """Reads "batch steps" lines on stdin, answers each with the step times (s)."""
    from kvserve.contract import SamplingParams

    core = default_model_core(threads, **engine_fields)
    print("ready", flush=True)
    for serial, line in enumerate(sys.stdin):
        batch, num_steps = map(int, line.split())
        params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
        requests = []
        for i in range(batch):  # a first token of its own per request: the prefix cache never hits
            prompt = [1000 + serial * 64 + i] + [(100 + 37 * i + 11 * j) % 40_000 + 100
                                                 for j in range(prompt_tokens - 1)]
            requests.append(core.new_request(prompt, params))
        print(json.dumps(timed_decode_steps(core, requests)), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old", help="the baseline tree")
    parser.add_argument("--new", default=str(ROOT))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5, help="measurements per tree and batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--old-engine", default="{}", help="EngineConfig fields of the old side (JSON)")
    parser.add_argument("--new-engine", default="{}", help="EngineConfig fields of the new side (JSON)")
    parser.add_argument("--engine", default="{}", help=argparse.SUPPRESS)  # a worker's own
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_ab.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.threads, args.prompt_tokens, json.loads(args.engine))
    if not args.old:
        parser.error("--old is required")
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    engines = {"old": args.old_engine, "new": args.new_engine}
    workers = {name: start_worker(__file__, tree, "--threads", str(args.threads), "--prompt-tokens",
                                  str(args.prompt_tokens), "--engine", engines[name]) for name, tree in trees.items()}
    steps: dict[tuple[str, int], list[float]] = {(name, b): [] for name in trees for b in args.batches}
    load_before = os.getloadavg()
    try:
        for batch in args.batches:
            for round_index in range(args.rounds + 1):  # the first round is a warm-up, dropped
                order = list(workers.items()) if round_index % 2 == 0 else list(workers.items())[::-1]
                for name, proc in order:
                    proc.stdin.write(f"{batch} {args.steps}\n")
                    proc.stdin.flush()
                    times = json.loads(proc.stdout.readline())
                    if round_index:
                        steps[name, batch].extend(times)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    load_after = os.getloadavg()
    rows = []
    print("| batch | old p50 ms | new p50 ms | old min ms | new min ms | old/new (p50) |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        old, new = steps["old", batch], steps["new", batch]
        row = {"batch": batch, "old_p50_ms": statistics.median(old) * 1e3, "new_p50_ms": statistics.median(new) * 1e3,
               "old_min_ms": min(old) * 1e3, "new_min_ms": min(new) * 1e3, "steps_per_tree": len(old)}
        row["speedup_p50"] = row["old_p50_ms"] / row["new_p50_ms"]
        rows.append(row)
        print(f"| {batch} | {row['old_p50_ms']:.2f} | {row['new_p50_ms']:.2f} | {row['old_min_ms']:.2f} | "
              f"{row['new_min_ms']:.2f} | {row['speedup_p50']:.2f}x |")
    print(f"\n{args.threads} threads; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                                          "old": str(trees["old"]), "new": str(trees["new"]),
                                          "old_engine": json.loads(args.old_engine),
                                          "new_engine": json.loads(args.new_engine),
                                          "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                                          "load_average_before": load_before, "load_average_after": load_after,
                                          "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
