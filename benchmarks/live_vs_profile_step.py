"""Does serving slow the engine's step? The live server's own mean batch-1
decode step against `kvserve profile`'s serving-loop step, alternated.

Each round first runs a short `kvserve profile` (its serving-loop part:
requests one at a time through AsyncEngine with an event loop encoding SSE
chunks) and takes its mean decode step; then starts `kvserve serve` with the
same engine flags and sends --requests streamed completions one at a time
from this process (48-token prompts of token ids, 24 tokens, greedy,
ignore_eos: the serving loop's shape), and reads the server's mean decode
step from its `/metrics` (kvserve_engine_step_seconds{kind="decode"}) over
them. A ratio near 1 says the HTTP loop and a client sharing the machine do
not slow the step itself. Both run on one torch thread
(OMP_NUM_THREADS=1), as benchmarks/sim_validation.py runs them.

    .venv/bin/python benchmarks/live_vs_profile_step.py [--rounds 3] [--requests 6]

Prints one row per round; writes benchmarks/results/live_vs_profile_step.json (--out).
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

import httpx

from kvserve.bench.cli import free_port, wait_ready
from served_tpot_ab import one_request, step_totals

ROOT = Path(__file__).resolve().parents[1]
# sim_validation.py's engine and admission flags.
ENGINE_FLAGS = ["--kv-cache-memory", "1GiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
ADMISSION_FLAGS = ["--ttft-slo", "3", "--tpot-slo", "0.5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
PROMPT_TOKENS, NEW_TOKENS = 48, 24


def profile_serving_loop_step_s() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        subprocess.run([sys.executable, "-m", "kvserve.cli", "profile", *ENGINE_FLAGS, "--prefill-tokens", "0,16",
                        "--decode-batch", "0,1,2", "--context", "32", "--repeats", "3", "--tokens", "1,8",
                        "--drift-seconds", "0", "--time-budget", "20", "--out", str(out)],
                       env=ENV, check=True, capture_output=True)
        return json.loads(out.read_text())["serving_loop"]["mean_step_s"]


def live_decode_step_s(rng: random.Random, requests: int) -> tuple[float, float]:
    """(the server's mean decode step, the client's mean TPOT) over `requests` streams."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *ENGINE_FLAGS, *ADMISSION_FLAGS, "--log-level", "warning"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, proc, 300)
        with httpx.Client(timeout=60) as client:
            model = client.get(base_url + "/v1/models").json()["data"][0]["id"]

            def prompt() -> list[int]:
                return [rng.randrange(100, 40_000) for _ in range(PROMPT_TOKENS)]

            for _ in range(2):  # warm-up
                one_request(client, base_url, model, prompt(), NEW_TOKENS)
            sum0, count0 = step_totals(client, base_url)
            tpots = [one_request(client, base_url, model, prompt(), NEW_TOKENS)[0] for _ in range(requests)]
            sum1, count1 = step_totals(client, base_url)
        return (sum1 - sum0) / (count1 - count0), statistics.mean(tpots)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="streams per live round (after 2 warm-ups)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "live_vs_profile_step.json"))
    args = parser.parse_args()
    rng, rows = random.Random(0), []
    print("| round | profile serving-loop step ms | live server decode step ms | client TPOT ms | live / profile |")
    print("|---|---:|---:|---:|---:|")
    for round_ in range(args.rounds):
        profiled = profile_serving_loop_step_s()
        step, tpot = live_decode_step_s(rng, args.requests)
        rows.append({"profile_serving_loop_step_ms": profiled * 1e3, "live_decode_step_ms": step * 1e3,
                     "client_tpot_ms": tpot * 1e3, "live_over_profile": step / profiled})
        print(f"| {round_} | {profiled * 1e3:.2f} | {step * 1e3:.2f} | {tpot * 1e3:.2f} | {step / profiled:.2f} |",
              flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": load,
                                          "requests": args.requests, "rounds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
