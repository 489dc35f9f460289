"""Single-stream served TPOT of two source trees side by side: `kvserve serve`
(default model, default flags: the shipped Q4_1 computed quantized) from
each tree, both started once on 127.0.0.1, and one streaming completion at a
time sent to each in turn, so the machine's load drifts over both alike. A
request is a fresh prompt of token ids (--prompt-tokens, its own first token
so the prefix cache never hits), --max-tokens out, greedy, ignore_eos, as
`vllm bench serve`'s random workload at concurrency 1. TPOT of a request:
(last token's arrival - first token's) / (tokens - 1), at the client.

Beside it, each server's mean decode step over the same requests, from
/metrics (kvserve_engine_step_seconds{kind="decode"}: sum / count), to split
served time per token into the engine step and the rest (streaming,
detokenizing, the event loop, the engine thread's work between steps).

    .venv/bin/python benchmarks/served_tpot_ab.py --old /tmp/old_tree [--new .] [--requests 20]
        [--prompt-tokens 256] [--max-tokens 64]

Prints TPOT p50 / p90 per tree and the ratio of the p50s; writes
benchmarks/results/served_tpot_ab.json (--out); the servers' logs go to
the temp directory (served_tpot_old.log, served_tpot_new.log).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench.cli import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300
_STEP = re.compile(r'^kvserve_engine_step_seconds_(sum|count)\{[^}]*kind="decode"[^}]*\}\s+(\S+)$', re.M)


def start(tree: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tree))
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, READY_TIMEOUT_S)
    except RuntimeError as exc:
        proc.kill()
        raise SystemExit(f"server from {tree}: {exc}; see {log_path}") from exc
    return proc


def stop(servers: dict[str, subprocess.Popen]) -> None:
    """Terminate every server, killing one that does not exit within 30 s."""
    for proc in servers.values():
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def step_totals(client: httpx.Client, base_url: str) -> tuple[float, float]:
    found = dict((kind, float(value)) for kind, value in _STEP.findall(client.get(base_url + "/metrics").text))
    return found.get("sum", 0.0), found.get("count", 0.0)


def one_request(client: httpx.Client, base_url: str, model: str, prompt: list[int],
                max_tokens: int) -> tuple[float, int]:
    """(TPOT in seconds, tokens received) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    with client.stream("POST", base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1), len(arrivals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the baseline tree")
    parser.add_argument("--new", default=str(ROOT))
    parser.add_argument("--requests", type=int, default=20, help="requests per tree (after 2 warm-ups each)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "served_tpot_ab.json"))
    args = parser.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    out = Path(args.out)
    servers, urls = {}, {}
    tpot: dict[str, list[float]] = {name: [] for name in trees}
    steps: dict[str, list[float]] = {name: [0.0, 0.0] for name in trees}
    load_before = os.getloadavg()
    try:
        for name, tree in trees.items():
            port = free_port()
            servers[name] = start(tree, port, Path(tempfile.gettempdir()) / f"served_tpot_{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as client:
            model = client.get(urls["old"] + "/v1/models").json()["data"][0]["id"]
            for serial in range(args.requests + 2):
                order = list(trees) if serial % 2 == 0 else list(trees)[::-1]
                for name in order:
                    prompt = [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100
                                                for j in range(args.prompt_tokens - 1)]
                    before = step_totals(client, urls[name])
                    seconds, received = one_request(client, urls[name], model, prompt, args.max_tokens)
                    after = step_totals(client, urls[name])
                    if serial >= 2:  # the first two per server warm it up
                        tpot[name].append(seconds)
                        steps[name][0] += after[0] - before[0]
                        steps[name][1] += after[1] - before[1]
    finally:
        stop(servers)
    load_after = os.getloadavg()
    rows = {}
    print("| tree | TPOT p50 ms | TPOT p90 ms | decode step mean ms |")
    print("|---|---:|---:|---:|")
    for name in trees:
        values = sorted(tpot[name])
        rows[name] = {"tpot_p50_ms": statistics.median(values) * 1e3,
                      "tpot_p90_ms": values[int(0.9 * (len(values) - 1))] * 1e3,
                      "decode_step_mean_ms": steps[name][0] / max(1.0, steps[name][1]) * 1e3,
                      "tpot_ms": [v * 1e3 for v in tpot[name]]}
        r = rows[name]
        print(f"| {name} | {r['tpot_p50_ms']:.2f} | {r['tpot_p90_ms']:.2f} | {r['decode_step_mean_ms']:.2f} |")
    ratio = rows["old"]["tpot_p50_ms"] / rows["new"]["tpot_p50_ms"]
    print(f"\nold/new TPOT p50: {ratio:.2f}x; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "old": str(trees["old"]),
                               "new": str(trees["new"]), "prompt_tokens": args.prompt_tokens,
                               "max_tokens": args.max_tokens, "load_average_before": load_before,
                               "load_average_after": load_after, "speedup_tpot_p50": ratio, "results": rows},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
