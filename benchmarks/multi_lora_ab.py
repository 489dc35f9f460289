"""Two source trees' multi-LoRA throughput side by side: `multi_lora.py`
from each tree (its own Python package and its own build of the kernels,
src/kvserve/model/_kvq.so) in alternating runs of one repeat each, so the
machine's load drifts over both alike. Each run measures the base and the
4-adapter batch interleaved in one process, as multi_lora.py does.

Reports, per tree, the median over its runs of the 4-adapter and base
tokens/s and of the run's 4-adapters / base ratio; and new over old for the
4-adapter throughput (each new run over the old run just before it).

    .venv/bin/python benchmarks/multi_lora_ab.py --old /tmp/main-tree [--new .] [--rounds 5]
        [--batch 16] [--tokens 16]

The old tree needs its kernels built (`make -s src/kvserve/model/_kvq.so`
there); both run on this tree's .venv, the tree's src/ first on PYTHONPATH.
Writes benchmarks/results/multi_lora_ab.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "multi_lora_ab.json"


def run_tree(tree: Path, batch: int, tokens: int) -> dict:
    """One multi_lora.py run (one repeat: base and 4_adapters) of `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        subprocess.run([sys.executable, str(tree / "benchmarks" / "multi_lora.py"), "--batch", str(batch),
                        "--tokens", str(tokens), "--repeats", "1", "--arms", "4_adapters", "--out", out.name],
                       check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
        result = json.loads(Path(out.name).read_text())
    return {"base_tokens_per_s": result["median"]["base"]["tokens_per_s"],
            "adapters_tokens_per_s": result["median"]["4_adapters"]["tokens_per_s"],
            "ratio_to_base": result["throughput_ratio"], "load_average_1m": result["load_average_1m"]["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("--rounds", type=int, default=5, help="runs per tree, alternating")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "src" / "kvserve" / "model" / "_kvq.so").is_file():
            parser.error(f"--{name} {tree}: its kernels are not built (make -s src/kvserve/model/_kvq.so there)")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args.batch, args.tokens))
    median = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    paired = [n["adapters_tokens_per_s"] / o["adapters_tokens_per_s"] for o, n in zip(runs["old"], runs["new"])]
    print(f"{'tree':>4} {'base tok/s':>10} {'4 adapters':>10} {'x base':>7}  (medians of {args.rounds} runs)")
    for name, m in median.items():
        print(f"{name:>4} {m['base_tokens_per_s']:>10.1f} {m['adapters_tokens_per_s']:>10.1f} {m['ratio_to_base']:>7.3f}")
    loads = [r["load_average_1m"] for rs in runs.values() for r in rs]
    print(f"4-adapter throughput new / old: median {statistics.median(paired):.3f}x "
          f"(runs {', '.join(f'{p:.2f}' for p in paired)}); load average {min(loads):.1f}-{max(loads):.1f} "
          f"on {os.cpu_count()} CPUs")
    result = {"benchmark": "multi_lora.ab", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "trees": {name: str(tree) for name, tree in trees.items()}, "batch": args.batch,
              "tokens_per_request": args.tokens, "rounds": args.rounds, "median": median,
              "new_over_old_adapters_tokens_per_s": {"median": round(statistics.median(paired), 4),
                                                     "runs": [round(p, 4) for p in paired]},
              "runs": runs, "cpus": os.cpu_count()}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
