"""Decode step of the default model (shipped Q4_1, computed quantized) per CPU
thread setting: torch / kernel threads x OpenMP wait policy x batch, with the
machine as it is and with extra busy processes (another engineer's compile on
the other core), optionally for several source trees side by side (a before /
after of a change).

Every point runs in a fresh process (libgomp reads its wait policy once, when
it loads), points alternate round by round so the machine's drift hits all
alike, and each reports the median decode step at batch 1 and 8 (--batches; context ~130
tokens) plus the load average around it.

    .venv/bin/python benchmarks/cpu_threads.py [--threads 1,2] [--policies default,passive,spin300k]
        [--busy 0,1] [--rounds 2] [--batches 1,8] [--sources branch=src,main=/tmp/main/src]

Prints a table; writes benchmarks/results/cpu_threads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> environment the child starts with. "default" sets nothing: kvserve's
# own policy (kvserve/cpu_threads.py) fills it in; the others override it.
POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin300k": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own default when nothing is set
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
BATCHES = "1,8"  # default --batches


def child(args: argparse.Namespace) -> int:
    import kvserve  # noqa: F401  (before torch: the wait policy is set here)
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from step_profile import decoding_engine

    torch.set_num_threads(args.threads)
    result: dict = {"step_ms": {}, "cpu_ms": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        core = decoding_engine("auto", batch, 128)
        steps, cpu = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            core.step()
            steps.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        result["step_ms"][str(batch)] = statistics.median(steps) * 1e3
        result["cpu_ms"][str(batch)] = statistics.median(cpu) * 1e3
        del core
    print(json.dumps(result))
    return 0


class BusyProcesses:
    """`count` processes spinning on the CPU while the block runs."""

    def __init__(self, count: int) -> None:
        self.count, self.procs = count, []

    def __enter__(self) -> "BusyProcesses":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        time.sleep(0.5 if self.count else 0)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_point(source: str, threads: int, policy: str, busy: int, steps: int, batches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy])
    env["PYTHONPATH"] = source
    load_before = os.getloadavg()[0]
    with BusyProcesses(busy):
        out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads), "--steps", str(steps),
                              "--batches", batches],
                             env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    child_result = json.loads(out.stdout.strip().splitlines()[-1])
    return {kind: {int(b): ms for b, ms in child_result[kind].items()} for kind in ("step_ms", "cpu_ms")} | {
            "load_avg_1m": [load_before, os.getloadavg()[0]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--policies", default="default,passive,spin300k")
    parser.add_argument("--busy", default="0,1", help="extra busy processes per point (comma list)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="decode steps per batch size")
    parser.add_argument("--batches", default=BATCHES, help="decode batch sizes (comma list)")
    parser.add_argument("--sources", default=f"branch={ROOT / 'src'}",
                        help="name=path-to-src list: source trees compared side by side")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_threads.json"))
    args = parser.parse_args()
    if args.child:
        args.threads = int(args.threads)
        return child(args)
    sources = dict(item.split("=", 1) for item in args.sources.split(","))
    points = [(s, int(t), p, int(b)) for b in args.busy.split(",") for t in args.threads.split(",")
              for p in args.policies.split(",") for s in sources]
    runs = []
    for round_index in range(args.rounds):
        for source, threads, policy, busy in points:
            run = {"round": round_index, "source": source, "threads": threads, "policy": policy, "busy": busy,
                   **run_point(sources[source], threads, policy, busy, args.steps, args.batches)}
            runs.append(run)
            print(f"  {source} threads={threads} {policy} busy={busy}: "
                  + ", ".join(f"batch {b} {ms:.1f} ms ({run['cpu_ms'][b]:.1f} CPU)" for b, ms in run["step_ms"].items())
                  + f" (load {run['load_avg_1m'][0]:.1f})", file=sys.stderr, flush=True)
    print_table(runs, points, [int(b) for b in args.batches.split(",")])
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "cpus": os.cpu_count(), "policies": POLICIES, "runs": runs}, indent=1))
    return 0


def print_table(runs: list[dict], points: list[tuple], batches: list[int]) -> None:
    print("\nmedian decode step (ms), best of the rounds; ms per token in brackets; then the process's CPU ms per\n"
          "step (every thread; on a loaded machine the wall time also holds the waits for a core)\n")
    print("| source | extra busy processes | threads | wait policy | "
          + " | ".join(f"batch {b}" for b in batches) + " | load avg |")
    print("|---|---:|---:|---|" + "---:|" * len(batches) + "---:|")
    for source, threads, policy, busy in points:
        mine = [r for r in runs if (r["source"], r["threads"], r["policy"], r["busy"]) == (source, threads, policy,
                                                                                           busy)]
        best = {b: min(r["step_ms"][b] for r in mine) for b in batches}
        cpu = {b: min(r["cpu_ms"][b] for r in mine) for b in batches}
        cells = [f"{ms:.1f}" + (f" ({ms / b:.1f})" if b > 1 else "") + f", {cpu[b]:.1f} CPU" for b, ms in best.items()]
        load = statistics.mean(r["load_avg_1m"][0] for r in mine)
        print(f"| {source} | {busy} | {threads} | {policy} | " + " | ".join(cells) + f" | {load:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
