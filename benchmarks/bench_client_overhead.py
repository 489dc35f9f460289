"""Does `kvserve bench` keep its schedule at 200 concurrent streams?

Starts the scripted fake server (tests/fake_openai_server.py) in its own
process, streaming every response at a known pace (--tokens tokens, one per
--gap-s), and drives it open-loop with Poisson arrivals at a rate that keeps
about --streams requests in flight (rate = streams / (tokens x gap)).
Reports the client's send lag (sent - scheduled), its CPU use, and how far
its measured TPOT / TTFT are from the scripted pace. Target: p99 lag < 5 ms.
For scale, a probe process keeps the same schedule at the same time with an
idle event loop (no HTTP): the lag floor the machine itself sets right then
(on a shared machine, other people's work shows up there too).

    .venv/bin/python benchmarks/bench_client_overhead.py [--streams 200] [--duration 10]

Writes benchmarks/results/bench_client_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from kvserve.bench.arrivals import ArrivalSpec, arrival_offsets
from kvserve.bench.client import ClientConfig, run_load, run_sync
from kvserve.bench.prompts import PromptBuilder
from kvserve.bench.report import build_report
from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests

ROOT = Path(__file__).resolve().parents[1]
LAG_TARGET_S = 0.005


def start_fake_server(tokens: int, gap_s: float) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fake_openai_server.py"), "--port", "0",
         "--tokens", str(tokens), "--gap-s", str(gap_s)],
        stdout=subprocess.PIPE, text=True)
    url = process.stdout.readline().strip()
    if not url.startswith("http"):
        process.kill()
        raise RuntimeError("fake server did not start")
    return process, url


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_pressure_some_avg60() -> float | None:
    """Linux PSI: % of the last minute some runnable task waited for a CPU."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])


def cpu_available_share(seconds: float = 1.0) -> float:
    """Share of one core a busy loop gets now: 1.0 on a quiet machine; lower
    when other work competes for the CPU (then lag numbers are pessimistic)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        pass
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


async def idle_loop_lags_s(offsets_s: list[float]) -> list[float]:
    """The same send schedule kept by an event loop with nothing else to do:
    the floor this machine sets right now (OS scheduling, timer slack)."""
    t0 = time.perf_counter()
    lags = []
    for offset in offsets_s:
        delay = offset - (time.perf_counter() - t0)
        if delay > 0.002:
            await asyncio.sleep(delay - 0.0015)
        while time.perf_counter() - t0 < offset:
            await asyncio.sleep(0)
        lags.append(time.perf_counter() - t0 - offset)
    return lags


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200, help="target concurrent streams")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per response")
    parser.add_argument("--gap-s", type=float, default=0.04, help="seconds between tokens")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                             "bench_client_overhead.json"))
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    rate = args.streams / (args.tokens * args.gap_s)
    workload = WorkloadSpec((LengthClass("fixed", 1.0, LengthDist("fixed", (("value", 32),)),
                                         LengthDist("fixed", (("value", args.tokens),))),))
    offsets = arrival_offsets(ArrivalSpec("poisson", rate), duration_s=args.duration, seed=1)
    if args.probe:  # the idle-loop probe, run as a separate process
        print(json.dumps(run_sync(idle_loop_lags_s(offsets))))
        return 0
    specs = generate_requests(workload, len(offsets), seed=1)
    cpu_share_before = cpu_available_share()
    load_before = os.getloadavg()[0]
    pressure_before = cpu_pressure_some_avg60()
    server, url = start_fake_server(args.tokens, args.gap_s)
    probe = subprocess.Popen([sys.executable, __file__, "--probe", "--streams", str(args.streams),
                              "--tokens", str(args.tokens), "--gap-s", str(args.gap_s),
                              "--duration", str(args.duration)], stdout=subprocess.PIPE, text=True)
    try:
        config = ClientConfig(url, model="fake", timeout_s=60, metrics_interval_s=1.0)
        cpu0, wall0 = cpu_s(), time.perf_counter()
        result = run_sync(run_load(config, specs, PromptBuilder().build, offsets))
        cpu_used, wall = cpu_s() - cpu0, time.perf_counter() - wall0
        idle_lags = json.loads(probe.communicate(timeout=120)[0])
    finally:
        probe.kill()
        server.terminate()
        server.wait()
    report = build_report(result.records, client_stats=result.client_stats)
    s = report["summary"]
    lag = result.client_stats["schedule_lag_s"]
    chunks = sum(len(r.token_events) for r in result.records)
    row = {
        "target_streams": args.streams, "rate_per_s": rate, "requests": len(specs),
        "max_in_flight": result.client_stats["max_in_flight"],
        "success": s["outcomes"]["success"], "chunks_per_s": chunks / wall,
        "lag_p50_ms": lag["p50"] * 1e3, "lag_p90_ms": lag["p90"] * 1e3,
        "lag_p99_ms": lag["p99"] * 1e3, "lag_max_ms": max(
            r.sent_s - r.scheduled_s for r in result.records) * 1e3,
        "client_cpu_share": cpu_used / wall,
        # Machine-independent overhead: client CPU per streamed chunk (all
        # client work, request setup included, divided by chunks).
        "client_cpu_us_per_chunk": cpu_used / max(chunks, 1) * 1e6,
        "scripted_tpot_ms": args.gap_s * 1e3, "measured_tpot_p50_ms": s["tpot"]["p50"] * 1e3,
        "measured_tpot_p99_ms": s["tpot"]["p99"] * 1e3,
        "scripted_ttft_ms": args.gap_s * 1e3, "measured_ttft_p50_ms": s["ttft"]["p50"] * 1e3,
        "measured_ttft_p99_ms": s["ttft"]["p99"] * 1e3,
        "idle_probe_lag_p99_ms": p99(idle_lags) * 1e3,
        "idle_probe_lag_max_ms": max(idle_lags) * 1e3,
        "loadavg_1m_before": load_before,
        "cpu_pressure_some_avg60_pct_before": pressure_before, "busy_loop_cpu_share_before": cpu_share_before,
        "cpu_count": os.cpu_count(), "event_loop": "uvloop" if _has_uvloop() else "asyncio",
        "passed": lag["p99"] < LAG_TARGET_S,
    }
    print_table(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "python": platform.python_version(),
                               "machine": platform.machine(), "result": row}, indent=1))
    print(f"wrote {out}")
    if not row["passed"]:
        # Reported, not fatal: on a CPU-starved machine the idle probe shows
        # the lag is the machine's (see docs/performance.md); `make bench`
        # runs every benchmark.
        print(f"TARGET NOT MET: p99 send lag {row['lag_p99_ms']:.1f} ms >= "
              f"{LAG_TARGET_S * 1e3:.0f} ms (idle probe p99 {row['idle_probe_lag_p99_ms']:.1f} ms)")
    return 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def print_table(row: dict) -> None:
    width = max(len(k) for k in row)
    for key, value in row.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


if __name__ == "__main__":
    sys.exit(main())
