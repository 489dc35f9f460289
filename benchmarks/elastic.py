"""Elastic capacity: a step in load against kvserve on Ray Serve, side by
side with `kvserve simulate` of the same fleets.

    python benchmarks/elastic.py                    # 4-replica fleets, ~12 min
    python benchmarks/elastic.py --replicas 2       # what a shared 2-core box can run side by side

Fleets (`kvserve ray`, a local Ray cluster of its own; replicas are
`kvserve serve --simulate`: the real server, admission and scheduler with
an 8B model's L4 roofline step time slept, 4 batch slots each):
  fixed   one replica, no autoscaling;
  cold    autoscaling from one replica, up to N (--replicas, default 4):
          new replicas cold-start;
  warm    autoscaling with a warm pool: N replicas held, those not needed
          awake sleep (POST /sleep?level=1) and are woken first;
  steady  N replicas awake from the start: the steady state the step is
          measured against.
Each gets `kvserve bench --arrival step` (a low rate, then a step to about
0.75 N times one replica's capacity: within the fleet's, well beyond one
replica's) after a few requests that measure the drain.

Reported per fleet: goodput (req/s inside TTFT <= 2 s and TPOT <= 0.1 s)
over the step window (its first STEP_WINDOW_S seconds) and its ratio to
steady's, TTFT p99 and goodput per 5-s window over time, and the
replicas' start-to-ready (Ray's process start to /ready, and its phases)
and wake-up times from the ingress's /metrics. `kvserve simulate` runs the
same three with --autoscale, the measured cold start and wake-up.

Targets (issue 18): warm's step goodput >= 90% of steady where cold's
falls below; wake-up <= 1/10 of cold start. JSON: benchmarks/results/elastic.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "elastic.json"
SLO = "ttft=2,tpot=0.1"  # TTFT_SLO_S, TPOT_SLO_S
LOW_RATE, STEP_AT_S = 1.5, 15.0
HIGH_RATE_PER_REPLICA = 1.75  # req/s of the step per replica of the fleet (one replica serves ~2.3)
STEP_WINDOW_S = 25.0
WINDOW_S = 5.0
MODEL = ["--preset", "llama-3.1-8b", "--hardware", "l4", "--kv-cache-memory", "1GiB", "--max-num-seqs", "4"]
WORKLOAD = ["--workload", "prompt=fixed:256;output=fixed:24"]
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.1
# The scale-down delay is short so the warm pool's extra replicas are asleep
# before the run (one more each delay); no fleet scales down during the load.
AUTOSCALE = ["--queue-wait-target", "0.5", "--look-back", "5", "--scale-down-delay", "8"]
FLEETS = ("fixed", "cold", "warm", "steady")


def fleet_flags(name: str, n: int) -> list[str]:
    """`kvserve ray` flags of a fleet of at most n replicas."""
    return {"fixed": ["--num-replicas", "1"],
            "cold": ["--min-replicas", "1", "--max-replicas", str(n), *AUTOSCALE],
            "warm": ["--min-replicas", str(n), "--max-replicas", str(n), "--sleep-idle", *AUTOSCALE],
            "steady": ["--num-replicas", str(n)]}[name]


def kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def free_port() -> int:
    from kvserve.bench.cli import free_port as port

    return port()


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def metric_values(text: str, name: str) -> dict[str, float]:
    """{labels text: value} of one metric name."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


class RayFleet:
    def __init__(self, name: str, num_replicas: int, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"ray-{name}.log", "ab")
        cmd = kvserve("ray", "--simulate", *MODEL, "--served-model-name", "m", "--port", str(self.port), "--num-cpus", "2",
                      "--replica-cpus", "0.25", "--stats-period", "0.5", "--max-queue-wait", "1.0",
                      "--log-level", "warning", *fleet_flags(name, num_replicas))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve ray exited with {self.proc.returncode}")
            if get(self.url + "/ready")[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError("kvserve ray not ready")

    def metrics(self) -> str:
        return get(self.url + "/metrics")[1]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def warm_up(url: str) -> None:
    """A few requests so the replicas' drain is measured (a cold fleet's
    expected wait is unbounded and the ingress would refuse a queue)."""
    body = json.dumps({"model": "m", "prompt": "warm up", "max_tokens": 4}).encode()
    for _ in range(6):
        req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
    time.sleep(2.0)


def wait_for_pool_asleep(fleet: RayFleet, num_asleep: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric_values(fleet.metrics(), "kvserve_ray_replicas_sleeping").get("") == num_asleep:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the warm pool did not put {num_asleep} replicas to sleep")


def high_rate(num_replicas: int) -> float:
    return HIGH_RATE_PER_REPLICA * num_replicas


def arrival(duration_s: float, num_replicas: int) -> list[str]:
    return ["--arrival", f"step:rates={LOW_RATE}/{high_rate(num_replicas)},step={STEP_AT_S}",
            "--duration", str(duration_s)]


def run_bench(url: str, duration_s: float, num_replicas: int, out: Path) -> dict:
    cmd = kvserve("bench", "--base-url", url, "--model", "m", "--endpoint", "completions", *WORKLOAD,
                  *arrival(duration_s, num_replicas), "--seed", "1",
                  "--slo", SLO, "--retries", "0", "--timeout", "60", "--no-progress", "--no-metrics",
                  "--out", str(out))
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def good(record: dict) -> bool:
    """Inside the promise: answered, TTFT and TPOT within their bounds."""
    tpot = record.get("tpot_s")
    return (record["outcome"] == "success" and record.get("ttft_s") is not None
            and record["ttft_s"] <= TTFT_SLO_S and (tpot is None or tpot <= TPOT_SLO_S))


def over_time(report: dict, duration_s: float) -> dict:
    """Goodput (good req/s) and TTFT p99 per WINDOW_S window of send time,
    and goodput over the step window."""
    requests = report["requests"]
    t0 = min(r["sent_s"] for r in requests)
    windows = []
    for start in range(0, int(duration_s), int(WINDOW_S)):
        inside = [r for r in requests if start <= r["sent_s"] - t0 < start + WINDOW_S]
        ttfts = sorted(r["ttft_s"] for r in inside if r.get("ttft_s") is not None)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
        windows.append({"t_s": start, "sent": len(inside), "goodput": sum(1 for r in inside if good(r)) / WINDOW_S,
                        "ttft_p99_s": p99})
    step = [r for r in requests if STEP_AT_S <= r["sent_s"] - t0 < STEP_AT_S + STEP_WINDOW_S]
    return {"step_goodput": sum(1 for r in step if good(r)) / STEP_WINDOW_S, "step_sent": len(step),
            "windows": windows}


def startup_times(metrics: str) -> dict[str, list[float]]:
    by_phase: dict[str, list[float]] = {}
    for labels, value in metric_values(metrics, "kvserve_ray_replica_startup_seconds").items():
        phase = labels.split('phase="')[1].split('"')[0]
        by_phase.setdefault(phase, []).append(value)
    return by_phase


def run_live(name: str, duration_s: float, num_replicas: int, workdir: Path) -> dict:
    fleet = RayFleet(name, num_replicas, workdir)
    try:
        fleet.wait_ready()
        warm_up(fleet.url)
        if name == "warm":
            wait_for_pool_asleep(fleet, num_replicas - 1)
        started = time.time()
        report = run_bench(fleet.url, duration_s, num_replicas, workdir / f"bench-{name}")
        time.sleep(1.5)  # the last stats (a wake, a new replica's start) reach the ingress
        metrics = fleet.metrics()
    finally:
        fleet.stop()
    s = report["summary"]
    return {"goodput": s["goodput"], "ttft_p99_s": (s["ttft"] or {}).get("p99"),
            "outcomes": s["outcomes"], **over_time(report, duration_s), "startup_s": startup_times(metrics),
            "replicas_seen": metric_values(metrics, "kvserve_ray_replicas").get(""), "started_unix": started}


def run_simulated(name: str, duration_s: float, num_replicas: int, cold_start_s: float, wake_s: float,
                  workdir: Path) -> dict:
    n = str(num_replicas)
    fleet = {"fixed": ["--replicas", "1"], "steady": ["--replicas", n],
             "cold": ["--replicas", "1", "--autoscale-max-replicas", n],
             "warm": ["--replicas", "1", "--autoscale-max-replicas", n, "--warm-pool", str(num_replicas - 1)]}[name]
    scaling = ["--autoscale-interval", "1", "--autoscale-queue-wait-target", "0.5", "--autoscale-look-back", "5",
               "--autoscale-scale-down-delay", "8", "--cold-start", f"{cold_start_s:.3f}",
               "--warm-start", f"{wake_s:.3f}"]
    out = workdir / f"sim-{name}"
    cmd = kvserve("simulate", *MODEL, "--max-queue-wait", "1.0", *WORKLOAD, *arrival(duration_s, num_replicas),
                  "--seed", "1",
                  "--slo", SLO, *fleet, *scaling, "--out", str(out))
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    return {"goodput": s["goodput"], "ttft_p99_s": (s["ttft"] or {}).get("p99"), "outcomes": s["outcomes"],
            **over_time(report, duration_s)}


def step_targets(fleets: dict) -> dict:
    """Issue 18's target on one part's fleets: warm's step goodput >= 90% of
    steady's, where cold's falls below it."""
    steady = fleets["steady"]["step_goodput"] or 1e-9
    warm, cold = fleets["warm"]["step_goodput"] / steady, fleets["cold"]["step_goodput"] / steady
    return {"warm_step_goodput_vs_steady": warm, "cold_step_goodput_vs_steady": cold,
            "warm_at_least_90pct_where_cold_falls_below": warm >= 0.9 > cold}


def table(results: dict) -> str:
    lines = [f"{'fleet':8} {'live step goodput':>18} {'vs steady':>10} {'TTFT p99':>9} | "
             f"{'sim step goodput':>17} {'vs steady':>10} {'TTFT p99':>9}"]
    live_steady = results["live"]["steady"]["step_goodput"] or 1e-9
    sim_steady = results["simulated"]["steady"]["step_goodput"] or 1e-9
    for name in FLEETS:
        live, sim = results["live"][name], results["simulated"][name]
        lines.append(f"{name:8} {live['step_goodput']:18.2f} {live['step_goodput'] / live_steady:10.0%} "
                     f"{live['ttft_p99_s'] or 0:9.2f} | {sim['step_goodput']:17.2f} "
                     f"{sim['step_goodput'] / sim_steady:10.0%} {sim['ttft_p99_s'] or 0:9.2f}")
    t = results["times"]
    lines.append(f"cold start (process start to ready): {t['cold_start_s']:.2f} s; wake-up: {t['wake_up_s']:.4f} s "
                 f"({t['wake_up_s'] / t['cold_start_s']:.4f} of a cold start)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per fleet")
    parser.add_argument("--replicas", type=int, default=4, help="the autoscaled and steady fleets' size (>= 2)")
    parser.add_argument("--out", default=str(RESULTS), help="results JSON")
    args = parser.parse_args()
    results: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                     time.gmtime()), "duration_s": args.duration, "step": [LOW_RATE, high_rate(args.replicas), STEP_AT_S],
                     "step_window_s": STEP_WINDOW_S, "replicas": args.replicas, "live": {}, "simulated": {}}
    with tempfile.TemporaryDirectory(prefix="kvserve-elastic-") as tmp:
        workdir = Path(tmp)
        for name in FLEETS:
            print(f"live: {name}", file=sys.stderr, flush=True)
            results["live"][name] = run_live(name, args.duration, args.replicas, workdir)
        phases = {p: v for fleet in results["live"].values() for p, v in fleet["startup_s"].items()}
        cold_start_s = statistics.median(phases.get("process_start_to_ready") or [60.0])
        wake_s = statistics.median(phases.get("wake_up") or [0.0])
        results["times"] = {"cold_start_s": cold_start_s, "wake_up_s": wake_s,
                            "cold_start_phases_s": {p: statistics.median(v) for p, v in phases.items()}}
        for name in FLEETS:
            results["simulated"][name] = run_simulated(name, args.duration, args.replicas, cold_start_s, wake_s,
                                                       workdir)
    results["targets"] = {part: step_targets(results[part]) for part in ("live", "simulated")}
    results["targets"]["wake_up_vs_cold_start"] = wake_s / cold_start_s if cold_start_s else None
    results["targets"]["wake_up_at_most_a_tenth"] = wake_s <= cold_start_s / 10
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(json.dumps(results["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
