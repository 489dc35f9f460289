"""Validate `kvserve simulate` against the real server on this machine.

1. for each rate, `kvserve serve` starts fresh on loopback (engine and
   admission settings below: an empty prefix cache, as the simulation's);
2. `kvserve profile` times real engine steps with the same
   engine settings just before and just after `kvserve bench` runs a
   workload against the server, and one cost model is fitted to both sets of
   steps (with the mean of their serving loop overheads: the time a served
   step takes beyond the engine step); a few probe requests measure the time a client's TTFT holds beyond
   the engine step that made the token (HTTP, the handoffs to and from the
   engine thread, streaming: `--frontend-latency-ms`), and
   others, before and after the bench run, the live server's batch-1
   decode step;
   `kvserve simulate --hardware profile.json` then runs the same
   workload (same seed: identical request lengths and arrival times), with
   the profile as measured and with the profile scaled to the live decode
   step (the machine's speed drifts between profiling and serving, and the
   server shares it with its frontend and the bench client), both with the
   step jitter and the speed drift over seconds the profiles measured
   (`--step-jitter profile`, the median
   of --jitter-seeds realizations), and the profile as measured without it;
3. prints the relative error of p50 / p99 TTFT and TPOT, of p99 queue
   wait, of the requests served and of goodput for each, and the verdict
   against issue 22's goal: every p50 / p99 TTFT and TPOT error within
   --target (10%) in at least 4 of 5 repeated runs (--repeats; each repeat
   its own seed), naming the rows that missed; writes OUT/validation.json.
   With --live-twice, each run's workload is served once more, on another
   fresh server right after the second profile, and judged against the
   first live run by the same rule: the machine's own floor (how far the
   same workload on the same machine moves within minutes, which no
   profile taken beside a run can predict). A simulator missing where
   the live runs agree has a fault of its own; one missing where they do
   not is at the machine's floor.
   `--resimulate` redoes step 2's simulations and step 3 against the live
   runs saved in OUT, the bracketed and calibrated profiles fitted again
   from the saved before / after profiles' timed steps (a change to the
   cost model's fit is a change to the simulation).

With --saturation, first the saturation rate itself: a fresh server (no
prefix cache, as every run of a search must start equal) under `kvserve
bench --sweep`, profiled before and after, against `kvserve simulate
--sweep` on that bracketed profile: the error of the max sustainable rate
and of the capacity at the SLO; the live max sustainable rate then joins
the validated rates. `--arrival` (e.g. gamma:burstiness=0.25) and
`--workload mixed` validate bursty mixed load, where the issue saw the
simulated queue wait far past the live one.

Bounded: the profile has a time budget and each rate sends --num-requests.

    python benchmarks/sim_validation.py --rates 0.25,0.5 --num-requests 16
    python benchmarks/sim_validation.py --rates 0.5,1,1.5 --saturation --arrival gamma:burstiness=0.25 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvserve.bench.cli import free_port, wait_ready  # noqa: E402
from kvserve.cli import main as kvserve_main  # noqa: E402
from kvserve.model_facts.default_model import default_model_path  # noqa: E402

METRICS = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"))


def kvserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *argv]


# Subprocesses find kvserve from this checkout even when it is not installed.
# One torch thread for the profile and the server alike: on a small shared
# machine, two threads per process oversubscribe the cores and step times
# swing by 10x, which no profile can predict.
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def bracket(before: str, after: str, path: Path) -> str:
    """One fit over the steps timed just before and just after the bench
    run: the machine's speed during the run is bracketed, not guessed from
    one side of it."""
    if before == after:  # one profile (--profile): used as it is, under the name the simulations read
        path.write_text(Path(before).read_text())
        return str(path)
    from kvserve.sim.cost_model import SpeedDrift, StepShape, fit_linear_cost_model, profile_json

    docs = [json.loads(Path(p).read_text()) for p in (before, after)]
    samples = [(StepShape(*(row[f] for f in StepShape._fields)), row["step_s"])
               for doc in docs for row in doc["samples"]]
    # The token curve's knots: every sweep size either profile timed.
    knots = sorted({n for doc in docs for n in (doc.get("token_curve") or {}).get("tokens", ())})
    model, stats = fit_linear_cost_model(samples, "bracketed kvserve profile", docs[0]["engine"],
                                         token_knots=tuple(knots))
    # The step jitter both profiles measured (each repeat over its median),
    # and the mean of their serving loop overheads.
    jitter = [r for doc in docs for r in (doc.get("step_jitter") or {}).get("ratios", ())]
    overheads = [(doc.get("serving_loop") or {}).get("overhead_per_step_s", 0.0) for doc in docs]
    # Both speed drift traces, one after the other: each is over its own
    # median, the level between them is the fit's.
    drifts = [SpeedDrift.from_json(doc["speed_drift"]) for doc in docs if doc.get("speed_drift")]
    drift = (dataclasses.replace(drifts[0], factors=tuple(f for d in drifts for f in d.factors))
             if drifts else None)
    model = dataclasses.replace(model, step_jitter=tuple(jitter), serving_overhead_s=statistics.mean(overheads),
                                speed_drift=drift)
    loop = {"bracketed_overheads_s": overheads}
    path.write_text(json.dumps(profile_json(model, stats, docs[0]["engine"], docs[0]["about"], samples, loop)))
    return str(path)


@contextlib.contextmanager
def serving(flags: list[str]):
    """`kvserve serve` on a free loopback port until the block ends; yields its URL."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(kvserve("serve", "--port", str(port), *flags, "--log-level", "warning"), env=ENV)
    try:
        wait_ready(base_url, server, timeout_s=180.0)
        yield base_url
    finally:
        server.terminate()
        server.wait(timeout=60)


def served_model(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


# Greedy, as `kvserve bench` samples: at the OpenAI default (temperature
# 1) a step also samples the whole vocabulary, ~1 ms a token here, which a
# probe of the bench's decode step must not count.
PROBE_SAMPLING = {"temperature": 0.0}


def frontend_latency_s(base_url: str, num_probes: int = 8) -> float:
    """What a client's TTFT holds beyond the engine's step that made the
    first token (HTTP, request parsing, the handoffs to and from the engine
    thread, streaming out, the client's reading): the mean streamed TTFT of
    a few sequential probe requests on the idle server minus the mean of
    their prompt steps (kvserve_engine_step_seconds, kind prefill), the
    time `kvserve profile` fits. Measured on the fresh server before the
    bench run, so it is not fitted to the run it predicts. Against the
    server's own TTFT instead, the ~2 ms of the engine thread's handoffs
    (queue time 0.8 ms, the first token's way out ~1 ms on the 2026-12-06
    Xeon) were in no term of the simulation. (The probes' prompts are
    unlike the workload's: no prefix-cache hits for it.)"""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def prompt_steps() -> tuple[float, float]:
        text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("kind") != "prefill":
                    continue
                if sample.name == "kvserve_engine_step_seconds_sum":
                    total += sample.value
                elif sample.name == "kvserve_engine_step_seconds_count":
                    count += sample.value
        return total, count

    model = served_model(base_url)
    total0, count0 = prompt_steps()
    client = []
    for i in range(num_probes):
        body = json.dumps({"model": model, "prompt": f"Probe {i}: the weather on the coast today is",
                           "max_tokens": 2, "stream": True, **PROBE_SAMPLING}).encode()
        request = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
        start = time.perf_counter()
        first = None
        with urllib.request.urlopen(request, timeout=60) as resp:
            for line in resp:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - start
        client.append(first)
        time.sleep(0.2)
    total1, count1 = prompt_steps()
    if count1 - count0 != num_probes or None in client:
        raise RuntimeError("frontend probe: the server did not report one prompt step per probe")
    return max(0.0, sum(client) / num_probes - (total1 - total0) / num_probes)


PROBE_PROMPT_TOKENS = 48  # a short workload's prompt length, about
PROBE_NEW_TOKENS = 24


def live_decode_gaps_s(base_url: str, num_probes: int = 4, first_probe: int = 0) -> list[float]:
    """Gaps between the streamed tokens of a few sequential batch-1 probe
    requests: the live server's decode step (a client's ITL equals the
    server's own inter-token latency here: docs/performance.md). Taken on
    either side of the bench run, never during it."""
    import urllib.request

    model = served_model(base_url)
    gaps = []
    for i in range(first_probe, first_probe + num_probes):
        prompt = [1000 + 7 * i + j for j in range(PROBE_PROMPT_TOKENS)]  # no prefix hits between probes
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": PROBE_NEW_TOKENS,
                           "ignore_eos": True, "stream": True, **PROBE_SAMPLING}).encode()
        request = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
        times = []
        with urllib.request.urlopen(request, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
        gaps += [b - a for a, b in zip(times, times[1:])]
        time.sleep(0.2)
    return gaps


def calibrated(profile: str, live_step_s: float, path: Path) -> tuple[str, float]:
    """The profile with every coefficient and curve point scaled so that its
    batch-1 decode step at the probes' median context equals the live
    server's: the shape of the cost measured offline, its level on the
    serving process (which shares the machine with its frontend and the
    bench client, and drifts with the machine's speed). Returns the path
    and the scale."""
    from kvserve.sim.cost_model import StepShape, load_profile

    context = PROBE_PROMPT_TOKENS + PROBE_NEW_TOKENS // 2
    predicted = load_profile(Path(profile)).step_time_s(StepShape(0, 1, context + 1, context + 1))
    scale = live_step_s / predicted
    doc = json.loads(Path(profile).read_text())
    doc["coefficients"] = {k: v * scale for k, v in doc["coefficients"].items()}
    if doc.get("serving_loop"):  # the probes' gaps hold it too: the whole served step is scaled
        doc["serving_loop"]["overhead_per_step_s"] *= scale
    if doc.get("token_curve"):
        doc["token_curve"]["step_s"] = [t * scale for t in doc["token_curve"]["step_s"]]
    doc["about"] = {**doc.get("about", {}), "calibration": {"live_decode_step_s": live_step_s,
                                                            "predicted_s": predicted, "scale": scale}}
    path.write_text(json.dumps(doc, indent=1))
    return str(path), scale


def relative_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return abs(sim - real) / abs(real)


# The goal's rows (within --target), then what explains a miss: the queue
# wait, how many were served, goodput.
LATENCY_ROWS = tuple(f"{metric}_{q}" for metric, q in METRICS)
ROWS = LATENCY_ROWS + ("queue_time_p99", "served", "goodput")


def summary_value(report: dict, row: str) -> float | None:
    summary = report["summary"]
    if row == "goodput":
        return summary["goodput"]
    if row == "served":
        return summary["outcomes"]["success"]
    metric, q = row.rsplit("_", 1)
    return summary[metric][q]


def compare(real: dict, sims: list[dict]) -> dict:
    """Per row: the real value, the median of the simulated ones (one per
    jitter realization; a single one without jitter), their range, and the
    median's relative error."""
    rows = {}
    for row in ROWS:
        a = summary_value(real, row)
        values = sorted(v for v in (summary_value(sim, row) for sim in sims) if v is not None)
        b = statistics.median(values) if values else None
        rows[row] = {"real": a, "sim": b, "rel_error": relative_error(b, a),
                     "sim_min": values[0] if values else None, "sim_max": values[-1] if values else None}
    return rows


# The simulations compared with each live run, by name: which profile
# (the bracketed one, or it calibrated to the live decode step) and the
# step jitter. "sim" is the method: the profile as measured, with
# its jitter.
VARIANTS = {"sim": ("", "profile"), "sim_no_jitter": ("", "none"), "sim_calibrated": ("_calibrated", "profile")}
ENGINE_FLAGS = ["--kv-cache-memory", "1GiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
# The admission promise matches what this CPU can keep (the default 0.1 s
# TPOT would cap the batch at one sequence here).
ADMISSION_FLAGS = ["--ttft-slo", "3", "--tpot-slo", "0.5"]


def workload_flags(args: argparse.Namespace, seed: int) -> list[str]:
    """The workload, arrivals and judging flags bench and simulate share (no rate)."""
    arrival = ["--arrival", args.arrival] if args.arrival else []
    return ["--workload", args.workload, *arrival, "--num-requests", str(args.num_requests),
            "--seed", str(seed), "--slo", args.slo]


def load_flags(args: argparse.Namespace, rate: float, seed: int) -> list[str]:
    return ["--rate", str(rate), *workload_flags(args, seed)]


@dataclasses.dataclass(frozen=True)
class Run:
    """One live run to validate: a rate, and which repeat of it (its seed)."""

    rate: float
    repeat: int = 0

    @property
    def key(self) -> str:  # file names and JSON keys; repeat 0 keeps the old names
        return f"{self.rate:g}" + (f"_r{self.repeat}" if self.repeat else "")

    def seed(self, args: argparse.Namespace) -> int:
        return args.seed + self.repeat

    @classmethod
    def of_key(cls, key: str) -> "Run":
        rate, _, repeat = key.partition("_r")
        return cls(float(rate), int(repeat or 0))


def simulate_rate(args: argparse.Namespace, out: Path, run: Run, gguf: str, frontend_s: float) -> dict:
    """Every variant's comparison with the live run saved under `out` (its
    bench report and bracketed profiles). A variant with jitter runs
    --jitter-seeds realizations: a p99 of a few dozen requests is nearly
    their maximum, and one draw of it says little."""
    real = json.loads((out / f"bench_{run.key}" / "report.json").read_text())
    compared = {}
    for name, (profile_suffix, jitter) in VARIANTS.items():
        hardware, summaries = out / f"profile_{run.key}{profile_suffix}.json", []
        for jitter_seed in range(args.jitter_seeds if jitter == "profile" else 1):
            run_out = out / (f"{name}_{run.key}" + (f"_j{jitter_seed}" if jitter_seed else ""))
            quiet = contextlib.redirect_stdout(io.StringIO()) if jitter_seed else contextlib.nullcontext()
            with quiet:  # the first realization's report is printed
                rc = kvserve_main(["simulate", "--model", gguf, "--hardware", str(hardware),
                                   *load_flags(args, run.rate, run.seed(args)), *ENGINE_FLAGS, *ADMISSION_FLAGS,
                                   "--frontend-latency-ms", f"{frontend_s * 1e3:.3f}", "--step-jitter", jitter,
                                   "--jitter-seed", str(jitter_seed), "--out", str(run_out)])
            if rc != 0:
                raise SystemExit(f"simulate failed with {rc}")
            summaries.append(json.loads((run_out / "report.json").read_text()))
        compared[name] = compare(real, summaries)
    return compared


def profile_now(args: argparse.Namespace, path: Path) -> str:
    """Profile right before (or after) the run it predicts: on a shared
    machine the speed drifts with other load within minutes."""
    if args.profile is not None:
        return args.profile
    subprocess.run(kvserve("profile", *ENGINE_FLAGS, "--prefill-tokens", "0,16,48,96",
                           "--decode-batch", "0,1,2,4,8", "--context", "32,96", "--repeats", "5",
                           "--time-budget", str(args.profile_budget), "--out", str(path)),
                   check=True, env=ENV)
    return str(path)


def bench_run(args: argparse.Namespace, run: Run, base_url: str, gguf: str, report_dir: Path) -> None:
    """`kvserve bench` of the run's workload against the server at `base_url`."""
    subprocess.run(kvserve("bench", "--base-url", base_url, *load_flags(args, run.rate, run.seed(args)),
                           "--tokenizer", gguf, "--no-progress", "--out", str(report_dir)),
                   check=True, env=ENV)


def measure_rate(args: argparse.Namespace, out: Path, run: Run, gguf: str) -> dict:
    """The live part for one run: profile, a fresh server with probes around
    the bench run, profile again; writes the bracketed and calibrated
    profiles and returns what the simulation stage needs besides them."""
    key = run.key
    before = profile_now(args, out / f"profile_{key}_before.json")
    # A fresh server per rate, as the simulation starts fresh: every rate
    # sends the same prompts (same seed), and a server kept from the last
    # rate would serve most of them from its prefix cache.
    with serving(ENGINE_FLAGS + ADMISSION_FLAGS) as base_url:
        frontend_s = frontend_latency_s(base_url)
        gaps_before = live_decode_gaps_s(base_url)
        bench_run(args, run, base_url, gguf, out / f"bench_{key}")
        # Probes after the run too, as the profile brackets it: one
        # moment's probe can catch the machine slow or fast.
        gaps_after = live_decode_gaps_s(base_url, first_probe=4)
        live_step_s = statistics.median(gaps_before + gaps_after)
    after = profile_now(args, out / f"profile_{key}_after.json")
    if args.live_twice:  # after the bracket, so the simulated run's profiles lie as close to it as ever
        with serving(ENGINE_FLAGS + ADMISSION_FLAGS) as base_url:
            bench_run(args, run, base_url, gguf, out / f"bench_{key}_again")
    return {**fit_profiles(out, key, before, after, live_step_s), "frontend_latency_s": frontend_s,
            "live_decode_step_s": live_step_s,
            "live_decode_step_before_s": statistics.median(gaps_before),
            "live_decode_step_after_s": statistics.median(gaps_after)}


def fit_profiles(out: Path, key: str, before: str, after: str, live_step_s: float) -> dict:
    """Run `key`'s bracketed and calibrated profiles from the profiles timed
    before and after it; returns their fit's summary."""
    profile = bracket(before, after, out / f"profile_{key}.json")
    _, scale = calibrated(profile, live_step_s, out / f"profile_{key}_calibrated.json")
    profile_doc = json.loads(Path(profile).read_text())
    jitter = {k: v for k, v in (profile_doc.get("step_jitter") or {}).items() if k != "ratios"}
    drift = {k: v for k, v in (profile_doc.get("speed_drift") or {}).items() if k not in ("factors", "about")}
    overhead_s = (profile_doc.get("serving_loop") or {}).get("overhead_per_step_s", 0.0)
    return {**profile_doc["fit"], "step_jitter": jitter, "speed_drift": drift, "serving_overhead_s": overhead_s,
            "calibration_scale": scale}


SATURATION_FLAGS = ["--no-prefix-caching"]  # every rate of a search starts equal, as each simulated one does


def saturation(args: argparse.Namespace, out: Path, gguf: str) -> dict:
    """The saturation rate itself: bench's capacity search against a fresh
    live server vs the simulator's on the profile bracketing it."""
    search = ["--sweep", "--sweep-start-rate", str(args.sweep_start_rate),
              "--sweep-max-runs", str(args.sweep_max_runs), *workload_flags(args, args.seed)]
    before = profile_now(args, out / "profile_saturation_before.json")
    with serving(ENGINE_FLAGS + SATURATION_FLAGS + ADMISSION_FLAGS) as base_url:
        frontend_s = frontend_latency_s(base_url)
        subprocess.run(kvserve("bench", "--base-url", base_url, *search, "--tokenizer", gguf, "--no-progress",
                               "--out", str(out / "saturation_bench")), check=True, env=ENV)
    after = profile_now(args, out / "profile_saturation_after.json")
    profile = bracket(before, after, out / "profile_saturation.json")
    rc = kvserve_main(["simulate", "--model", gguf, "--hardware", profile, *search, *ENGINE_FLAGS,
                       *SATURATION_FLAGS, *ADMISSION_FLAGS, "--frontend-latency-ms", f"{frontend_s * 1e3:.3f}",
                       "--step-jitter", "profile", "--out", str(out / "saturation_sim")])
    if rc != 0:
        raise SystemExit(f"simulate --sweep failed with {rc}")
    real, sim = (json.loads((out / name / "sweep.json").read_text()) for name in ("saturation_bench", "saturation_sim"))
    # Each answer with the sides whose search never saw a rate fail (sweep.json's
    # *_found): there it is a lower bound, and the error says little.
    return {field: {"real": real[field], "sim": sim[field], "rel_error": relative_error(sim[field], real[field]),
                    "lower_bound": [side for side, doc in (("real", real), ("sim", sim))
                                    if not doc[field.removesuffix("_per_s") + "_found"]]}
            for field in ("max_sustainable_rate_per_s", "capacity_at_slo_per_s")}


def live_again(out: Path, run: Run) -> dict | None:
    """The run's second live run (--live-twice) against its first, row by
    row as a simulation is ("sim" holding the second); None without one."""
    again = out / f"bench_{run.key}_again" / "report.json"
    if not again.is_file():
        return None
    first = json.loads((out / f"bench_{run.key}" / "report.json").read_text())
    return compare(first, [json.loads(again.read_text())])


def verdicts(rows_by_run: dict[str, dict], target: float, repeats: int) -> dict[str, dict]:
    """Per rate, issue 22's goal: every p50 / p99 TTFT and TPOT error within
    `target` in at least 4 of 5 runs (scaled to `repeats`), and what missed."""
    by_rate: dict[str, dict] = {}
    for key, rows in rows_by_run.items():
        run = Run.of_key(key)
        verdict = by_rate.setdefault(f"{run.rate:g}", {"runs": 0, "within": 0, "misses": []})
        missed = {row: rows[row]["rel_error"] for row in LATENCY_ROWS
                  if rows[row]["rel_error"] is None or rows[row]["rel_error"] > target}
        verdict["runs"] += 1
        verdict["within"] += not missed
        if missed:
            verdict["misses"].append({"repeat": run.repeat, **missed})
    needed = -(-4 * repeats // 5)  # 4 of 5, rounded up
    for verdict in by_rate.values():
        verdict["needed"] = needed
        verdict["passed"] = verdict["within"] >= needed
    return by_rate


def format_verdicts(by_rate: dict[str, dict], target: float) -> str:
    lines = []
    for rate, v in by_rate.items():
        misses = "; ".join(f"repeat {m['repeat']}: " + ", ".join(
            f"{row} {'-' if err is None else format(err, '.0%')}" for row, err in m.items() if row != "repeat")
            for m in v["misses"])
        lines.append(f"rate {rate}: p50/p99 TTFT and TPOT within {target:.0%} in {v['within']} of {v['runs']} "
                     f"runs (goal {v['needed']}): {'met' if v['passed'] else 'MISSED'}"
                     + (f"; left: {misses}" if misses else ""))
    return "\n".join(lines)


def format_saturation(sat: dict) -> str:
    line = "saturation (bench --sweep live vs simulate --sweep): " + ", ".join(
        f"{field} real {row['real']} sim {row['sim']} error "
        f"{'-' if row['rel_error'] is None else format(row['rel_error'], '.0%')}" for field, row in sat.items())
    for field, row in sat.items():
        if row.get("lower_bound"):  # runs saved before the field have none
            line += (f"\n  the {' and '.join(row['lower_bound'])} search ran out of runs before any rate failed: "
                     f"its {field} is a lower bound, not the limit (raise --sweep-max-runs)")
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.25,0.5", help="request rates to compare, requests/s")
    parser.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    parser.add_argument("--workload", default="short", help="bench workload (same flag as kvserve bench)")
    parser.add_argument("--arrival", default=None,
                        help="arrival process (kvserve bench's flag, e.g. gamma:burstiness=0.25); default poisson")
    parser.add_argument("--slo", default="ttft=3,tpot=0.5", help="SLO for goodput (bench syntax)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="live runs per rate, repeat i with seed --seed + i (the goal: 4 of 5 within --target)")
    parser.add_argument("--target", type=float, default=0.10,
                        help="relative error the p50 / p99 TTFT and TPOT must stay within")
    parser.add_argument("--saturation", action="store_true",
                        help="first compare the capacity search live vs simulated, then validate the live "
                             "max sustainable rate too")
    parser.add_argument("--sweep-start-rate", type=float, default=0.5, help="with --saturation: first rate")
    # 9 runs from 0.5 req/s: doubling to 32, then two bisections; the
    # validation's server saturates at 26 req/s on the AMX Xeon (2026-12-08).
    parser.add_argument("--sweep-max-runs", type=int, default=9, help="with --saturation: most runs per search")
    parser.add_argument("--jitter-seeds", type=int, default=9,
                        help="step jitter realizations simulated per rate; the table shows their median")
    parser.add_argument("--profile-budget", type=float, default=90.0,
                        help="seconds of profiling before and after each rate")
    parser.add_argument("--live-twice", action="store_true",
                        help="serve each run's workload a second time (another fresh server, after the "
                             "second profile) and judge it against the first by the same rule: the "
                             "machine's floor beside the simulator's error")
    parser.add_argument("--profile", default=None, help="reuse this profile JSON instead of profiling")
    parser.add_argument("--resimulate", action="store_true",
                        help="skip the live runs: simulate again against those saved in --out (its "
                             "validation.json, bench reports and profiles), e.g. after a simulator change; "
                             "the saturation search is kept as saved")
    parser.add_argument("--out", default="bench-out/sim-validation")
    args = parser.parse_args()
    if args.jitter_seeds < 1 or args.repeats < 1:
        parser.error("--jitter-seeds and --repeats must be >= 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = str(default_model_path())
    started = time.monotonic()
    load_before = os.getloadavg()
    sat = None
    if args.resimulate:
        saved = json.loads((out / "validation.json").read_text())
        for key in ("rates", "num_requests", "workload", "arrival", "slo", "seed", "repeats", "live_twice"):
            setattr(args, key, saved["args"].get(key, getattr(args, key)))
        fits, sat = saved["profile_fits"], saved.get("saturation")
        for key, fit in fits.items():  # fitted again: the fit may have changed since
            before, after = (out / f"profile_{key}_{side}.json" for side in ("before", "after"))
            if before.is_file() and after.is_file():
                fit.update(fit_profiles(out, key, str(before), str(after), fit["live_decode_step_s"]))
    else:
        rates = [float(r) for r in args.rates.split(",")]
        if args.saturation:
            sat = saturation(args, out, gguf)
            live_rate = sat["max_sustainable_rate_per_s"]["real"]
            if live_rate and live_rate not in rates:
                rates.append(live_rate)
        runs = [Run(rate, i) for rate in rates for i in range(args.repeats)]
        fits = {run.key: measure_rate(args, out, run, gguf) for run in runs}
        # The live runs kept before simulating: --resimulate can redo the rest.
        (out / "validation.json").write_text(json.dumps({"profile_fits": fits, "saturation": sat,
                                                         "args": vars(args)}, indent=1))
    results: dict[str, dict] = {name: {} for name in VARIANTS}
    for key, fit in fits.items():
        for name, rows in simulate_rate(args, out, Run.of_key(key), gguf, fit["frontend_latency_s"]).items():
            results[name][key] = rows
    judged = verdicts(results["sim"], args.target, args.repeats)
    # Only the second runs this run made: an --out reused without --live-twice keeps older ones.
    floor_rows = {}
    if args.live_twice:
        floor_rows = {key: rows for key in fits if (rows := live_again(out, Run.of_key(key))) is not None}
    floor = verdicts(floor_rows, args.target, args.repeats) if floor_rows else None
    document = {"rates": results["sim"], "rates_no_jitter": results["sim_no_jitter"],
                "rates_calibrated": results["sim_calibrated"], "verdicts": judged,
                "live_again": floor_rows or None, "live_again_verdicts": floor, "saturation": sat,
                "profile_fits": fits, "wall_s": time.monotonic() - started,
                "load_average": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
                "args": vars(args)}
    (out / "validation.json").write_text(json.dumps(document, indent=1))
    print(f"error of the simulation: as measured (the profile and its step jitter: the median over "
          f"{args.jitter_seeds} realizations, and their range), as measured without the jitter, and "
          f"calibrated to the live server's batch-1 decode step (probes before and after the bench run)")
    print(format_table(results))
    print(format_verdicts(judged, args.target))
    if floor is not None:
        print("the machine's floor: the same workload live a second time, against the first")
        print(format_table({"live_again": floor_rows}))
        print(format_verdicts(floor, args.target))
    if sat is not None:
        print(format_saturation(sat))
    load = document["load_average"]
    print(f"wall {document['wall_s']:.0f} s; load average {load['before'][0]:.1f} -> {load['after'][0]:.1f} "
          f"on {load['cpus']} CPUs; wrote {out / 'validation.json'}")
    return 0


def format_table(results: dict[str, dict]) -> str:
    """One row per rate and metric: the real value, then each variant's
    simulated value and relative error."""
    variants = list(results)
    lines = [f"{'rate':>6} {'metric':<16} {'real':>9}"
             + "".join(f" {v:>22}" + (f" {'range':>15}" if v == variants[0] else "") for v in variants)]
    for rate, rows in results[variants[0]].items():
        for name, row in rows.items():
            scale, unit = {"goodput": (1.0, "req/s"), "served": (1.0, "req")}.get(name, (1000.0, "ms"))
            line = f"{rate:>6} {name + ' ' + unit:<16} {_number(row['real'], scale):>9}"
            for variant in variants:
                cell = results[variant][rate][name]
                err = "-" if cell["rel_error"] is None else f"{cell['rel_error']:.0%}"
                line += f" {_number(cell['sim'], scale):>14} {err:>7}"
                if variant == variants[0]:
                    low, high = cell.get("sim_min"), cell.get("sim_max")
                    line += f" {_number(low, scale) + '-' + _number(high, scale):>15}"
            lines.append(line)
    return "\n".join(lines)


def _number(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


if __name__ == "__main__":
    sys.exit(main())
