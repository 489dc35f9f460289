"""The rate-inf workload on the engine alone: `--requests` prompts of
`--prompt` random tokens (`--output` tokens each, greedy, ignore_eos) added
at once to the default model's EngineCore (the shipped Q4_1 computed
quantized, the server's default batching), stepped until every one is done.
Prints the output rate and where the time went by step kind: steps carrying
prompt rows (with the decode rows beside them) and decode-only steps by
batch size. No HTTP, no admission: what vs_peers.py's rate-inf point asks
of the engine when everything is in flight.

    .venv/bin/python benchmarks/engine_saturation.py [--requests 100] [--prompt 256] [--output 64]
        [--threads 2] [--engine '{"max_num_seqs": 128}']

Writes benchmarks/results/engine_saturation.json (--out).

With --parts, each kernel is timed from Python (prefill_parts.PartTimer) on
the layer-by-layer decode path (the one-call step runs the same kernels in
the same order), and the table adds where the seconds went, by part, for
the steps with prompt rows and the decode-only steps.

With --old TREE (a baseline source tree with its _kvq.so built, e.g. `git
archive REV`), the same workload runs alternately on that tree's sources
and on --new's (this checkout by default), each run a fresh process, for
--rounds rounds; the table gives every run's time and the old/new ratios
(the machine's speed drifts between runs, so read the median ratio).
Writes benchmarks/results/engine_saturation_ab.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_ab import default_model_core  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=64, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", default="{}", help="EngineConfig fields (JSON), e.g. the batching")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", action="store_true", help="also time each kernel (layer-by-layer decode)")
    parser.add_argument("--old", help="a baseline tree: run alternately on its sources and --new's")
    parser.add_argument("--new", default=str(ROOT), help="the tree compared with --old (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree with --old")
    parser.add_argument("--out", help="default: benchmarks/results/engine_saturation.json "
                                      "(engine_saturation_ab.json with --old)")
    args = parser.parse_args()
    if args.old:
        return compare_trees(args)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "engine_saturation.json")
    from kvserve.contract import SamplingParams

    core = default_model_core(args.threads, **json.loads(args.engine))
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(args.prompt)]

    warm = [core.new_request(prompt(), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for _ in range(4)]
    for request in warm:
        core.add_request(request)
    while core.has_unfinished():
        core.step()
    timer = part_timer(core) if args.parts else None
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    requests = [core.new_request(prompt(), params) for _ in range(args.requests)]
    load_before = os.getloadavg()
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    steps = []  # (seconds, prompt tokens, decode rows)
    parts: dict[str, dict[str, float]] = {"with prompt rows": {}, "decode only": {}}
    while core.has_unfinished():
        before = [(r.num_computed_tokens, r.num_output_tokens) for r in requests]
        if timer is not None:
            timer.step.clear()
        t0 = time.perf_counter()
        core.step()
        seconds = time.perf_counter() - t0
        prompt_tokens = decode_rows = 0
        for r, (computed, outputs) in zip(requests, before):
            if outputs and r.num_output_tokens > outputs:
                decode_rows += 1
            elif r.num_computed_tokens > computed:
                prompt_tokens += r.num_computed_tokens - computed
        steps.append((seconds, prompt_tokens, decode_rows))
        if timer is not None:
            kind = parts["with prompt rows" if prompt_tokens else "decode only"]
            for part, part_s in timer.step.items():
                kind[part] = kind.get(part, 0.0) + part_s
    total_s = time.perf_counter() - start
    output_tokens = sum(r.num_output_tokens for r in requests)
    with_prompt = [s for s in steps if s[1]]
    decode_only = [s for s in steps if not s[1]]
    by_size: dict[int, list[float]] = {}
    for seconds, _, rows in decode_only:
        by_size.setdefault(rows // 16 * 16, []).append(seconds)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load_before, "args": vars(args),
        "total_s": total_s, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / total_s,
        "steps": len(steps),
        "prompt_steps": {"count": len(with_prompt), "seconds": sum(s[0] for s in with_prompt),
                         "prompt_tokens": sum(s[1] for s in with_prompt),
                         "decode_rows_beside": sum(s[2] for s in with_prompt)},
        "decode_only_steps": {"count": len(decode_only), "seconds": sum(s[0] for s in decode_only),
                              "rows": sum(s[2] for s in decode_only),
                              "by_rows": {f"{k}-{k + 15}": {"count": len(v), "median_ms": 1000 * statistics.median(v)}
                                          for k, v in sorted(by_size.items())}},
        "per_step": steps,
    }
    if timer is not None:
        result["parts_s"] = parts
    p, d = result["prompt_steps"], result["decode_only_steps"]
    print(f"{args.requests} requests x ({args.prompt} in, {args.output} out) at once, {args.threads} threads: "
          f"{total_s:.2f} s, {output_tokens / total_s:.1f} output tok/s, {len(steps)} steps")
    print("| steps | count | seconds | work |\n|---|---:|---:|---|")
    print(f"| with prompt rows | {p['count']} | {p['seconds']:.2f} | {p['prompt_tokens']} prompt tokens "
          f"({1000 * p['seconds'] / max(1, p['prompt_tokens']):.3f} ms each, decode rows beside included), "
          f"{p['decode_rows_beside']} decode rows beside |")
    print(f"| decode only | {d['count']} | {d['seconds']:.2f} | {d['rows']} decode rows "
          f"({1000 * d['seconds'] / max(1, d['rows']):.2f} ms each) |")
    for rows, entry in d["by_rows"].items():
        print(f"|   {rows} rows | {entry['count']} | | median step {entry['median_ms']:.1f} ms |")
    for kind, by_part in parts.items():
        if by_part:
            print(f"\n{kind}, by part (s): " + ", ".join(f"{part} {part_s:.2f}" for part, part_s in
                                                     sorted(by_part.items(), key=lambda item: -item[1])))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


def part_timer(core):
    """A PartTimer over the default model's kernels, the decode steps on the
    layer-by-layer path so that each kernel is a call of its own."""
    from prefill_parts import PartTimer, linear_shapes, wrap_step_parts

    core.runner.model.native_decode = None
    timer = PartTimer()
    wrap_step_parts(timer, core, linear_shapes(core.runner.model.config))
    return timer


def compare_trees(args: argparse.Namespace) -> int:
    """This workload on two trees' sources, alternating fresh processes."""
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    workload = ["--requests", str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output),
                "--threads", str(args.threads), "--engine", args.engine, "--seed", str(args.seed)]
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, tree in trees.items():
                out = Path(scratch) / f"{name}-{round_index}.json"
                subprocess.run([sys.executable, __file__, *workload, "--out", str(out)], check=True,
                               env=dict(os.environ, PYTHONPATH=str(tree / "src")), cwd=str(tree),
                               stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
                print(f"round {round_index + 1}, {name}: {runs[name][-1]['total_s']:.2f} s", file=sys.stderr,
                      flush=True)
    ratios = [o["total_s"] / n["total_s"] for o, n in zip(runs["old"], runs["new"])]
    print(f"{args.requests} requests x ({args.prompt} in, {args.output} out) at once, {args.threads} threads\n")
    print("| round | old s | new s | old/new |\n|---|---:|---:|---:|")
    for i, (o, n) in enumerate(zip(runs["old"], runs["new"])):
        print(f"| {i + 1} | {o['total_s']:.2f} | {n['total_s']:.2f} | {ratios[i]:.2f}x |")
    print(f"| median | {statistics.median(r['total_s'] for r in runs['old']):.2f} | "
          f"{statistics.median(r['total_s'] for r in runs['new']):.2f} | {statistics.median(ratios):.2f}x |")
    out = args.out or str(ROOT / "benchmarks" / "results" / "engine_saturation_ab.json")
    Path(out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "old": str(trees["old"]), "new": str(trees["new"]),
        "workload": workload, "load_average": os.getloadavg(), "ratios_old_over_new": ratios,
        "runs": {name: [{k: r[k] for k in ("total_s", "output_tok_per_s", "prompt_steps", "decode_only_steps",
                                           "load_before")} for r in rs] for name, rs in runs.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
