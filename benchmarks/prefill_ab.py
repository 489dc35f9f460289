"""Time to first token of two source trees side by side: each tree's EngineCore
(default model, `--quantization auto`: the shipped Q4_1 computed quantized)
runs in its own worker process, and the driver alternates one prefill at a
time between them, so the machine's load drifts over both alike. A prefill is
add_request of a fresh prompt (its own first token, so the prefix cache never
hits) and engine steps until the request has its first output token. With
--decode-steps, each tree also times that many batch-1 decode steps after a
128-token prompt (median step: the TPOT), to check decode did not regress.
With --cached-prefix N, every prompt starts with the same N tokens, computed
once before the timing: each timed prefill is a prefix-cache hit of N tokens
and computes only its own --prompts tokens after them (a multi-turn chat's
next turn, a shared system prompt).

    .venv/bin/python benchmarks/prefill_ab.py --old /tmp/old_tree [--new .] [--prompts 256 2000]
        [--rounds 5] [--threads 2] [--decode-steps 32]
    .venv/bin/python benchmarks/prefill_ab.py --old . --old-engine '{"prefill_weights": "none"}'
    .venv/bin/python benchmarks/prefill_ab.py --old /tmp/old_tree --cached-prefix 1024 --prompts 1 8 16 32

--old-engine / --new-engine: EngineConfig fields (JSON) for that side's
engine, so one tree can be compared with itself under two settings.

A tree is a checkout with src/kvserve and its built _kvq.so; both run on this
tree's .venv. Prints min and median TTFT per tree and prompt length, and the
ratio; writes benchmarks/results/prefill_ab.json (--out).
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


def worker(threads: int, engine_fields: dict, cached_prefix: int) -> int:
    """Reads prompt lengths on stdin, answers each with its TTFT in seconds; a
    negative length -n: the median of n decode steps after a 128-token prompt.
    Prompts start with the same `cached_prefix` tokens, cached before "ready"."""
    from kvserve.contract import SamplingParams

    core = default_model_core(threads, **engine_fields)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = [(7 + 13 * j) % 40_000 + 100 for j in range(cached_prefix)]
    if prefix:
        core.add_request(core.new_request(prefix, params))
        while core.has_unfinished():
            core.step()
    print("ready", flush=True)
    for serial, line in enumerate(sys.stdin):
        length = int(line)
        if length < 0:
            prompt = [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100 for j in range(127)]
            request = core.new_request(prompt, SamplingParams(max_tokens=1 - length, temperature=0.0,
                                                              ignore_eos=True))
            print(json.dumps(statistics.median(timed_decode_steps(core, [request]))), flush=True)
            continue
        prompt = prefix + [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100 for j in range(length - 1)]
        t0 = time.perf_counter()
        request = core.new_request(prompt, params)
        core.add_request(request)
        while request.num_output_tokens == 0:
            core.step()
        ttft = time.perf_counter() - t0
        if request.num_cached_tokens < len(prefix) // core.config.block_size * core.config.block_size:
            raise RuntimeError(f"the prompt hit {request.num_cached_tokens} cached tokens of its {len(prefix)}")
        while core.has_unfinished():
            core.step()
        print(json.dumps(ttft), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old", help="the baseline tree")
    parser.add_argument("--new", default=str(ROOT))
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 2000], help="prompt lengths (tokens)")
    parser.add_argument("--rounds", type=int, default=5, help="prefills per tree and prompt length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=0, help="also time batch-1 decode steps")
    parser.add_argument("--cached-prefix", type=int, default=0,
                        help="tokens every prompt starts with, cached before the timing (prefix-cache hits)")
    parser.add_argument("--old-engine", default="{}", help="EngineConfig fields of the old side (JSON)")
    parser.add_argument("--new-engine", default="{}", help="EngineConfig fields of the new side (JSON)")
    parser.add_argument("--engine", default="{}", help=argparse.SUPPRESS)  # a worker's own
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_ab.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.threads, json.loads(args.engine), args.cached_prefix)
    if not args.old:
        parser.error("--old is required")
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    engines = {"old": args.old_engine, "new": args.new_engine}
    workers = {name: start_worker(__file__, tree, "--threads", str(args.threads), "--engine", engines[name],
                                  "--cached-prefix", str(args.cached_prefix))
               for name, tree in trees.items()}
    lengths = list(args.prompts) + ([-args.decode_steps] if args.decode_steps else [])
    ttft = {(name, length): [] for name in trees for length in lengths}  # seconds; < 0: decode steps
    try:
        for length in lengths:
            for _ in range(args.rounds + 1):  # the first of each is a warm-up, dropped
                for name, proc in workers.items():
                    proc.stdin.write(f"{length}\n")
                    proc.stdin.flush()
                    ttft[name, length].append(float(proc.stdout.readline()))
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    rows = []
    if args.cached_prefix:
        print(f"each prompt after a cached prefix of {args.cached_prefix} tokens\n")
    print("| prompt | old min ms | new min ms | old p50 ms | new p50 ms | old/new (min) |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        old, new = ttft["old", length][1:], ttft["new", length][1:]
        row = {"prompt_tokens" if length > 0 else "decode_step_tpot_of_steps": abs(length), "old_min_ms": min(old) * 1e3, "new_min_ms": min(new) * 1e3,
               "old_p50_ms": statistics.median(old) * 1e3, "new_p50_ms": statistics.median(new) * 1e3,
               "old_ms": [t * 1e3 for t in old], "new_ms": [t * 1e3 for t in new]}
        row["speedup_min"] = row["old_min_ms"] / row["new_min_ms"]
        rows.append(row)
        print(f"| {length if length > 0 else 'decode step (TPOT)'} | {row['old_min_ms']:.1f} | {row['new_min_ms']:.1f} | {row['old_p50_ms']:.1f} | "
              f"{row['new_p50_ms']:.1f} | {row['speedup_min']:.2f}x |")
    load_avg = os.getloadavg()
    print(f"\n{args.threads} threads; load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                                          "cached_prefix_tokens": args.cached_prefix,
                                          "old": str(trees["old"]), "new": str(trees["new"]),
                                          "old_engine": json.loads(args.old_engine),
                                          "new_engine": json.loads(args.new_engine),
                                          "load_average": load_avg, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
