"""Fleet: every router side by side behind `kvserve gateway`, beside
`kvserve simulate` of the same fleet, router, workload and cost model.

    python benchmarks/fleet.py                       # both parts (~40 min on the 2-core dev box)
    python benchmarks/fleet.py --part simulated --duration 30
    python benchmarks/fleet.py --part simulated --rates 5.25 --live-seeds 3   # one rate, 3 workload seeds
    python benchmarks/fleet.py --capacity-only --duration 120 [--seeds 10]   # the simulator alone, ~1 min

Part `simulated`: 4 `kvserve serve --simulate` replicas (preset llama-3.1-8b
on an L4 roofline, 1 GiB of KV each: prefill of a long shared prefix is
expensive and KV binds). Part `tiny`: 2 real `kvserve serve` replicas of a
random-weight tiny Llama on this CPU, and a `kvserve profile` of it for the
simulator.

For each part:
1. the simulator's capacity search (`kvserve simulate --sweep`) for
   round-robin and prefix-affinity: C_rr and C_pa;
2. three Poisson rates: C_rr, 1.6 x C_rr (past round-robin's capacity,
   where routing decides goodput), 3 x max(C_rr, C_pa) (overload);
3. per router, fresh backends and a gateway, `kvserve bench` at each rate
   (the shared-prefix chat workload below), and `kvserve simulate` of the
   same;
4. goodput (req/s inside TTFT <= 2 s and TPOT <= 0.1 s), TTFT p99, prefix
   hit rate (the backends' own counters) and refusals, live and simulated.

Targets (issue 16): prefix-affinity or kv-aware goodput >= 1.3x
round-robin's at the first rate where round-robin misses the SLO; at 3x
capacity the fleet's goodput >= 90% of its peak; the simulated fleet's
goodput within 15% of the live one. JSON: benchmarks/results/fleet.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fleet.json"
ROUTERS = ("round-robin", "least-loaded", "kv-aware", "prefix-affinity")
# Chat behind long shared system prompts (8 groups of 2048 tokens, 90% of
# requests; ~250 tokens of the user's own): prefill is what a prefix hit
# saves. Outputs are short so the token stream through gateway and client
# stays inside a 2-core machine.
def workload(prefix_tokens: int, prompt_median: int) -> list[str]:
    return ["--workload", f"prompt=lognormal:median={prompt_median},sigma=0.1,min={prefix_tokens + 50},"
                          f"max={2 * prompt_median};output=lognormal:median=32,sigma=0.5,min=8,max=128",
            "--prefix-groups", "8", "--prefix-tokens", str(prefix_tokens), "--prefix-share", "0.9",
            "--arrival", "poisson"]
ENGINE = ["--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--block-size", "16", "--max-model-len", "8192"]
# The tiny model's context is 2048 tokens: its system prompts are shorter;
# it has no chat template (completions), and its steps on a shared 2-core
# CPU take tens of ms, so its promise is a CPU's (TTFT 5 s, TPOT 0.5 s).
PARTS = {
    "simulated": {"replicas": 4, "model": ["--preset", "llama-3.1-8b"], "hardware": "l4", "kv": "1GiB",
                  "serve": ["--simulate"], "workload": workload(2048, 2300), "endpoint": "chat",
                  "slo": "ttft=2,tpot=0.1"},
    "tiny": {"replicas": 2, "kv": "8MiB", "serve": ["--torch-threads", "1"], "workload": workload(512, 600),
             "endpoint": "completions", "slo": "ttft=5,tpot=0.5"},
}


def kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def free_port() -> int:
    from kvserve.bench.cli import free_port as port

    return port()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    out = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            for name in names:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Fleet:
    """Fresh backends and a gateway with one router."""

    def __init__(self, part: dict, model_flags: list[str], router: str, workdir: Path,
                 gateway_args: list[str] | None = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.backends = []
        log = open(workdir / f"fleet-{router}.log", "ab")
        for _ in range(part["replicas"]):
            port = free_port()
            cmd = kvserve("serve", *part["serve"], *model_flags, "--port", str(port), "--served-model-name", "m",
                          "--kv-cache-memory", part["kv"], *ENGINE, *part.get("serve_hardware", []),
                          *slo_flags(part["slo"]))
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            self.backends.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(self.backends, self.procs):
            wait_ready(url, proc)
        port = free_port()
        cmd = kvserve("gateway", "--router", router, "--port", str(port), "--state-dir", str(workdir / router),
                      "--log-level", "warning", *(x for b in self.backends for x in ("--backend", b)),
                      *(gateway_args or []))
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{port}"
        wait_ready(self.url, self.procs[-1])
        time.sleep(2.5)  # every backend scraped and closed in the gateway's view

    def prefix_counters(self) -> tuple[float, float]:
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        totals = [counters(b, names) for b in self.backends]
        return sum(t[names[0]] for t in totals), sum(t[names[1]] for t in totals)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def slo_flags(slo: str) -> list[str]:
    """The backends' (and the simulator's) promise: the SLO the bench judges."""
    values = dict(item.split("=") for item in slo.split(","))
    return ["--ttft-slo", values["ttft"], "--tpot-slo", values["tpot"]]


def summary_row(report: dict) -> dict:
    s = report["summary"]
    return {"goodput": s["goodput"], "slo_passed": s["slo_passed"], "ttft_p99_s": (s["ttft"] or {}).get("p99"),
            "success": s["outcomes"]["success"], "rejected": s["outcomes"]["rejected"],
            "errors": s["outcomes"]["error"] + s["outcomes"]["timed_out"], "num_requests": s["num_requests"]}


def run_bench(part: dict, url: str, rate: float, args, out: Path, seed: int = 1) -> dict:
    # Exact prompt lengths (the backends' tokenizer), so the simulator sees the same token counts.
    cmd = kvserve("bench", "--base-url", url, "--model", "m", "--endpoint", part["endpoint"], *part["workload"],
                  "--tokenizer", part["tokenizer"], "--rate", f"{rate:.4g}",
                  "--duration", str(args.duration), "--seed", str(seed), "--slo", part["slo"], "--retries", "0",
                  "--timeout", "60", "--no-progress", "--out", str(out))
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def sim_flags(part: dict, model_flags: list[str], hardware: str) -> list[str]:
    return [*model_flags, "--hardware", hardware, "--kv-cache-memory", part["kv"], "--replicas",
            str(part["replicas"]), *ENGINE, *part["workload"], "--seed", str(part.get("seed", 1)), "--slo", part["slo"],
            *slo_flags(part["slo"])]


def run_simulate(part, model_flags, hardware, router: str, rate: float, args, out: Path) -> dict:
    cmd = kvserve("simulate", *sim_flags(part, model_flags, hardware), "--router", router, "--rate", f"{rate:.4g}",
                  "--duration", str(args.duration), "--out", str(out))
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "report.json").read_text())
    replicas = report["config"]["simulation"]["replicas"]
    hits = sum(r["prefix_cache_hits"] for r in replicas)
    queries = sum(r["prefix_cache_queries"] for r in replicas)
    return {**summary_row(report), "prefix_hit_rate": hits / queries if queries else None}


def capacity(part, model_flags, hardware, router: str, args, out: Path) -> float:
    cmd = kvserve("simulate", *sim_flags(part, model_flags, hardware), "--router", router, "--sweep",
                  "--duration", str(args.duration), "--out", str(out))
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    sweep = json.loads((out / "sweep.json").read_text())
    return sweep["capacity_at_slo_per_s"] or sweep["max_sustainable_rate_per_s"] or 1.0


def tiny_model(workdir: Path) -> tuple[list[str], str]:
    """The random-weight Llama of benchmarks/overload.py, and a profile of it here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from overload import random_model_folder

    folder = random_model_folder(workdir / "tiny-llama", hidden=256, layers=4)
    profile = workdir / "tiny-profile.json"
    # Profiled with the replicas' own flags (one torch thread each): a step
    # profiled on two threads is not the step the replicas run.
    subprocess.run(kvserve("profile", "--model", str(folder), "--kv-cache-memory", PARTS["tiny"]["kv"],
                           "--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--time-budget", "90",
                           *PARTS["tiny"]["serve"], "--out", str(profile)),
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return ["--model", str(folder)], str(profile)


def run_part(name: str, args, workdir: Path) -> dict:
    part = dict(PARTS[name])
    if name == "tiny":
        model_flags, hardware = tiny_model(workdir)
        part["tokenizer"] = str(Path(model_flags[1]) / "tokenizer.json")
    else:
        from kvserve.model_facts.default_model import default_model_path

        model_flags, hardware = part["model"], part["hardware"]
        part["serve_hardware"] = ["--hardware", hardware]
        part["tokenizer"] = str(default_model_path())  # a preset's simulated replica uses SmolLM2's tokenizer
    c_rr = capacity(part, model_flags, hardware, "round-robin", args, workdir / f"{name}-cap-rr")
    c_pa = capacity(part, model_flags, hardware, "prefix-affinity", args, workdir / f"{name}-cap-pa")
    rates = args.rates or sorted({round(c_rr, 2), round(1.6 * c_rr, 2), round(3 * max(c_pa, c_rr), 2)})
    seeds = range(1, args.live_seeds + 1)
    print(f"[{name}] simulated capacity: round-robin {c_rr:.2f}, prefix-affinity {c_pa:.2f} req/s; "
          f"rates {rates}", flush=True)
    rows: dict[str, dict[str, dict]] = {}
    for router in args.routers:
        fleet = Fleet(part, model_flags, router, workdir, shlex.split(args.gateway_args))
        try:
            for rate in rates:
                runs = []
                for seed in seeds:  # the workload's seed: arrivals, lengths and prefixes
                    hits0, queries0 = fleet.prefix_counters()
                    live = summary_row(run_bench(part, fleet.url, rate, args,
                                                 workdir / f"{name}-{router}-{rate}-{seed}", seed))
                    hits1, queries1 = fleet.prefix_counters()
                    live["prefix_hit_rate"] = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else None
                    sim = run_simulate({**part, "seed": seed}, model_flags, hardware, router, rate, args,
                                       workdir / f"{name}-{router}-{rate}-{seed}-sim")
                    runs.append({"live": live, "sim": sim})
                    print(f"[{name}] {router:15s} {rate:6.2f} req/s seed {seed}  live goodput {live['goodput']:.2f} "
                          f"(ttft p99 {live['ttft_p99_s']}, hit {live['prefix_hit_rate']}, refused "
                          f"{live['rejected']})  sim {sim['goodput']:.2f}", flush=True)
                rows.setdefault(f"{rate:g}", {})[router] = mean_of_seeds(runs)
        finally:
            fleet.stop()
    return {"capacity_rr": c_rr, "capacity_pa": c_pa, "slo": part["slo"], "workload": part["workload"],
            "rates": rows, "targets": targets(rows)}


def mean_of_seeds(runs: list[dict]) -> dict:
    """One row from the runs of several workload seeds: each figure's mean
    (the SLO passed only if it passed in every run), and each run's goodput.
    Past capacity one 45 s run's goodput moves by up to ~40% between two
    runs of the same seed (admission's refusals there turn on timing), so
    the simulator is compared with the mean over seeds."""
    row: dict = {"seeds": len(runs)}
    for side in ("live", "sim"):
        figures = [run[side] for run in runs]
        merged: dict = {}
        for key in figures[0]:
            values = [f[key] for f in figures]
            if key == "slo_passed":
                merged[key] = all(values)
            elif all(isinstance(v, (int, float)) for v in values):
                merged[key] = sum(values) / len(values)
            else:
                present = [v for v in values if isinstance(v, (int, float))]
                merged[key] = sum(present) / len(present) if present else None
        merged["goodput_per_seed"] = [f["goodput"] for f in figures]
        row[side] = merged
    return row


def targets(rows: dict[str, dict[str, dict]]) -> dict:
    """The issue's three targets, checked on this run's numbers (of the
    routers it ran)."""
    rates = sorted(rows, key=float)
    routers = [p for p in ROUTERS if p in rows[rates[0]]]
    miss = None
    if "round-robin" in routers:
        miss = next((r for r in rates if not rows[r]["round-robin"]["live"]["slo_passed"]), None)
    others = [p for p in ("prefix-affinity", "kv-aware") if p in routers]
    best_ratio = None
    if miss is not None and others:
        rr = rows[miss]["round-robin"]["live"]["goodput"] or 1e-9
        best_ratio = max(rows[miss][p]["live"]["goodput"] for p in others) / rr
    peak = {p: max(rows[r][p]["live"]["goodput"] for r in rates) for p in routers}
    overload = {p: rows[rates[-1]][p]["live"]["goodput"] / peak[p] if peak[p] else None for p in routers}
    sim_error = {f"{r}/{p}": (rows[r][p]["sim"]["goodput"] - rows[r][p]["live"]["goodput"])
                 / rows[r][p]["live"]["goodput"] for r in rates for p in routers if rows[r][p]["live"]["goodput"]}
    return {"rr_first_miss_rate": miss, "best_affinity_or_kv_over_rr": best_ratio,
            "overload_goodput_over_peak": overload, "sim_goodput_relative_error": sim_error}


def format_table(results: dict) -> str:
    lines = []
    for name, part in results["parts"].items():
        lines.append(f"\n{name}: capacity (simulated) round-robin {part['capacity_rr']:.2f}, "
                     f"prefix-affinity {part['capacity_pa']:.2f} req/s")
        lines.append(f"{'rate':>6} {'router':15} {'goodput':>8} {'sim':>6} {'ttft p99':>9} {'hit':>5} "
                     f"{'sim hit':>7} {'refused':>8} {'SLO':>4}")
        for rate, routers in part["rates"].items():
            for router, row in routers.items():
                live, sim = row["live"], row["sim"]
                ttft = f"{live['ttft_p99_s']:.2f}" if live["ttft_p99_s"] is not None else "-"
                hit = f"{live['prefix_hit_rate']:.0%}" if live["prefix_hit_rate"] is not None else "-"
                sim_hit = f"{sim['prefix_hit_rate']:.0%}" if sim["prefix_hit_rate"] is not None else "-"
                verdict = "ok" if live["slo_passed"] else "miss"
                lines.append(f"{rate:>6} {router:15} {live['goodput']:8.2f} {sim['goodput']:6.2f} {ttft:>9} "
                             f"{hit:>5} {sim_hit:>7} {live['rejected']:8.0f} {verdict:>4}")
        t = part["targets"]
        ratio = t["best_affinity_or_kv_over_rr"]
        lines.append(f"round-robin first misses at {t['rr_first_miss_rate']} req/s; best of prefix-affinity / "
                     f"kv-aware there: {ratio:.2f}x round-robin" if ratio else "round-robin never missed")
        lines.append("at 3x capacity, goodput / peak: " + ", ".join(
            f"{p} {v:.0%}" for p, v in t["overload_goodput_over_peak"].items() if v is not None))
        errors = list(t["sim_goodput_relative_error"].values())
        if errors:
            lines.append(f"simulated vs live goodput: max |error| {max(map(abs, errors)):.0%}, "
                         f"mean {sum(errors) / len(errors):+.0%}")
    return "\n".join(lines)


def capacity_only(args) -> int:
    """The simulated part's capacity at the SLO per router and seed, from
    the simulator alone: virtual time, so a loaded machine does not move it."""
    part, seeds = PARTS["simulated"], tuple(range(1, args.seeds + 1))
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-fleet-") as tmp:
        for router in ROUTERS:
            rows[router] = []
            for seed in seeds:
                rows[router].append(capacity({**part, "seed": seed}, part["model"], part["hardware"], router, args,
                                             Path(tmp) / f"{router}-{seed}"))
    rr = rows["round-robin"]
    print(f"capacity at the SLO ({part['slo']}), simulated {part['replicas']} replicas, seeds {seeds} (req/s)")
    # Per seed the capacity moves with a handful of refusals (the promise allows 1%): the mean over
    # the seeds is the comparison to read, the per-seed ratios its spread.
    rr_mean = sum(rr) / len(rr)
    print(f"{'router':15} " + " ".join(f"{'seed ' + str(s):>7}" for s in seeds)
          + f"  {'mean':>6}  x round-robin (of the means; per seed)")
    for router, caps in rows.items():
        ratios = [c / r for c, r in zip(caps, rr)]
        mean = sum(caps) / len(caps)
        print(f"{router:15} " + " ".join(f"{c:7.3f}" for c in caps) + f"  {mean:6.3f}  {mean / rr_mean:.2f}; "
              + " ".join(f"{x:.2f}" for x in ratios))
    out = Path(args.out) if args.out != str(RESULTS) else RESULTS.with_name("fleet_capacity.json")
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "slo": part["slo"], "seeds": seeds,
                               "workload": part["workload"], "duration_s": args.duration,
                               "capacity_at_slo_per_s": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    parser.add_argument("--out", default=str(RESULTS), help="results JSON")
    parser.add_argument("--seeds", type=int, default=3, help="--capacity-only: workload seeds 1..N per router")
    parser.add_argument("--live-seeds", type=int, default=1,
                        help="live runs (and simulations) per rate and router, workload seeds 1..N; the table "
                             "shows their means")
    parser.add_argument("--routers", type=lambda v: v.split(","), default=list(ROUTERS),
                        help=f"comma-separated routers to run live (default: all, {','.join(ROUTERS)})")
    parser.add_argument("--gateway-args", default="",
                        help="more flags for each `kvserve gateway`, e.g. '--scrape-interval 0.2'")
    parser.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="comma-separated request rates (req/s) instead of the simulated capacities' 1x, "
                             "1.6x and 3x")
    parser.add_argument("--capacity-only", action="store_true",
                        help="only the simulated part's capacity search per router over --seeds seeds "
                             "(benchmarks/results/fleet_capacity.json)")
    args = parser.parse_args()
    if args.capacity_only:
        return capacity_only(args)
    parts = list(PARTS) if args.part == "all" else [args.part]
    out = Path(args.out)
    # Parts run on their own keep the other parts' last results.
    results = json.loads(out.read_text()) if out.exists() else {"parts": {}}
    with tempfile.TemporaryDirectory(prefix="kvserve-fleet-") as tmp:
        for name in parts:
            results["parts"][name] = {**run_part(name, args, Path(tmp)), "date": time.strftime("%Y-%m-%d"),
                                      "duration_s": args.duration}
            results.update(machine=f"{os.cpu_count()} CPUs (shared)", engine=ENGINE)
            out.write_text(json.dumps(results, indent=1))  # after each part: a long run keeps what it measured
    print(format_table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
