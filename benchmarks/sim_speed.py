"""Simulator speed: simulated traffic per second of wall time.

The issue's target: one hour of traffic at 50 requests/s on 8 H100 replicas
(Llama-3.1-8B roofline, chat workload, least-queue router, admission on) in
under 60 s of wall time. The simulator runs the real scheduler, so its Python
cost per step and per running sequence is most of the wall time; this script
measures it and extrapolates when asked for a shorter run.

    python benchmarks/sim_speed.py                 # the full hour
    python benchmarks/sim_speed.py --seconds 120   # 2 simulated minutes, extrapolated
    python benchmarks/sim_speed.py --compare-cores # pure Python vs the compiled core
                                                   # (make compile), alternating

It runs on whichever core kvserve loads (`python -m kvserve.compiled status`);
KVSERVE_PURE_PYTHON=1 forces the sources.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvserve import compiled  # noqa: E402
from kvserve.bench.arrivals import arrival_offsets, parse_arrival  # noqa: E402
from kvserve.bench.report import SLO_PRESETS, build_report  # noqa: E402
from kvserve.bench.workload import NAMED_MIXES, WorkloadSpec, generate_requests  # noqa: E402
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig  # noqa: E402
from kvserve.model_facts.memory import num_kv_blocks, weight_bytes  # noqa: E402
from kvserve.plan import kv_math  # noqa: E402
from kvserve.plan.hardware import hardware_preset  # noqa: E402
from kvserve.plan.presets import preset  # noqa: E402
from kvserve.plan.roofline import RooflineCostModel  # noqa: E402
from kvserve.sim.cli import report_rows_every  # noqa: E402
from kvserve.sim.simulator import SimConfig, Simulator  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="simulated seconds of traffic")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="print the top functions by time")
    parser.add_argument("--no-fast-forward", action="store_true",
                        help="single steps only (no multi-step decode runs), for comparison")
    parser.add_argument("--compare-cores", action="store_true",
                        help="run pure Python and the compiled core in turn (each a fresh process), "
                             "--repeat times each, and write the table to --json")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each core with --compare-cores")
    parser.add_argument("--json", default=None,
                        help="write the measurements here (default with --compare-cores: "
                             "benchmarks/results/sim_speed.json)")
    args = parser.parse_args()
    if args.compare_cores:
        return compare_cores(args)

    spec = preset("llama-3.1-8b")
    h100 = hardware_preset("h100")
    budget = kv_math.memory_budget(h100.memory_bytes, weight_bytes(spec.config, 2), 0.1)
    num_blocks = num_kv_blocks(budget.kv_bytes, spec.config, 16, 2)
    config = SimConfig(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192),
                       CacheConfig(num_blocks=num_blocks), AdmissionConfig(),
                       num_replicas=args.replicas, router="least-queue", exact_token_events=False,
                       fast_forward=not args.no_fast_forward)
    cost = RooflineCostModel(spec.config, h100)
    t0 = time.perf_counter()
    offsets = arrival_offsets(parse_arrival("poisson", args.rate), None, args.seconds, seed=0)
    specs = generate_requests(WorkloadSpec(NAMED_MIXES["chat"]), len(offsets), seed=0)
    t1 = time.perf_counter()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    result = Simulator(config, cost).run(specs, offsets)
    if profiler:
        profiler.disable()
    t2 = time.perf_counter()
    # As `kvserve simulate` builds it (a long run keeps a sample of request rows).
    summary = build_report(result.records, SLO_PRESETS["mlperf-server"],
                           rows_every=report_rows_every(len(result.records)))["summary"]
    t3 = time.perf_counter()
    sim_wall = t2 - t1
    total = t3 - t0
    print(f"{len(specs)} requests over {args.seconds:.0f} s simulated at {args.rate} req/s on "
          f"{args.replicas} x H100 ({num_blocks} KV blocks each)")
    print(f"  steps {result.num_steps}, simulated until {result.duration_s:.0f} s; outcomes "
          f"{ {k: v for k, v in summary['outcomes'].items() if v} }")
    print(f"  TTFT p50/p99 {summary['ttft']['p50'] * 1e3:.1f}/{summary['ttft']['p99'] * 1e3:.1f} ms, "
          f"TPOT p50/p99 {summary['tpot']['p50'] * 1e3:.1f}/{summary['tpot']['p99'] * 1e3:.1f} ms")
    print(f"  wall: workload {t1 - t0:.1f} s, simulation {sim_wall:.1f} s, report {t3 - t2:.1f} s, "
          f"total {total:.1f} s; {result.num_steps / sim_wall:,.0f} steps/s, "
          f"{sim_wall / result.num_steps * 1e6:.0f} us/step")
    scale = 3600.0 / args.seconds
    core = compiled.status()["core"]
    print(f"  one hour at this rate: ~{total * scale:.0f} s wall (target 60 s: "
          f"{'met' if total * scale <= 60 else f'{total * scale / 60:.1f}x over'}); core: {core}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    if args.json:
        measured = {"core": core, "compiled": compiled.status()["compiled"], "seconds": args.seconds,
                    "rate": args.rate, "replicas": args.replicas, "requests": len(specs),
                    "steps": result.num_steps, "workload_s": t1 - t0, "simulation_s": sim_wall,
                    "report_s": t3 - t2, "total_s": total, "hour_estimate_s": total * scale,
                    "outcomes": summary["outcomes"], "ttft_p99_s": summary["ttft"]["p99"],
                    # Both cores must give the very same report.
                    "summary_sha256": hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()}
        Path(args.json).write_text(json.dumps(measured, indent=1) + "\n")
    return 0


def compare_cores(args: argparse.Namespace) -> int:
    """Both cores on the same simulation, alternating (pure, compiled, pure,
    ...) so that the machine's drift falls on both."""
    reason = compiled.why_not_compiled()
    if reason is not None:
        print(f"the compiled core is not usable: {reason}", file=sys.stderr)
        return 2
    runs = []
    out = Path(tempfile.mkdtemp(prefix="sim_speed_")) / "run.json"
    for repeat in range(args.repeat):
        for pure in (True, False):
            env = {**os.environ}
            env.pop(compiled.PURE_PYTHON_ENV, None)
            if pure:
                env[compiled.PURE_PYTHON_ENV] = "1"
            command = [sys.executable, __file__, "--seconds", str(args.seconds), "--rate", str(args.rate),
                       "--replicas", str(args.replicas), "--json", str(out)]
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            runs.append({"repeat": repeat, **json.loads(out.read_text())})
    out.unlink()
    out.parent.rmdir()
    print(f"\n{args.seconds:.0f} simulated s at {args.rate} req/s on {args.replicas} x H100, alternating:")
    print(f"| run | core | simulation s | total s | hour estimate s |\n|---|---|---|---|---|")
    for run in runs:
        print(f"| {run['repeat'] + 1} | {'compiled' if run['compiled'] else 'pure Python'} | "
              f"{run['simulation_s']:.1f} | {run['total_s']:.1f} | {run['hour_estimate_s']:.0f} |")
    pure = [r["total_s"] for r in runs if not r["compiled"]]
    fast = [r["total_s"] for r in runs if r["compiled"]]
    ratio = sum(pure) / sum(fast)
    identical = len({r["summary_sha256"] for r in runs}) == 1
    print(f"pure / compiled total wall: {ratio:.2f}x; report summaries identical: {identical}")
    path = Path(args.json or Path(__file__).parent / "results" / "sim_speed.json")
    path.write_text(json.dumps({"runs": runs, "pure_over_compiled": ratio, "identical": identical}, indent=1)
                    + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
