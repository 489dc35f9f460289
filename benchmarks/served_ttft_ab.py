"""Single-stream served TTFT of one or two source trees, and where it goes:
`kvserve serve` (default model, default flags) from each tree, both started
once on 127.0.0.1, and one streaming /v1/completions at a time sent to each
in turn (alternating, so the machine's drift falls on both alike). A request
is `vllm bench serve`'s random workload at concurrency 1: a text prompt of
--prompt-tokens random token ids decoded (by the server's /detokenize, its
own first token distinct so the prefix cache never hits), --max-tokens out,
ignore_eos. Client TTFT: the send to the first SSE event with a choice.

Beside it, the server's own split of each request (the request is alone,
so the difference of /metrics before and after it is its own): server TTFT
(arrival after the body is parsed -> the first token's timestamp, which the
engine takes right after sampling), queue (arrival -> first scheduled), the
prefill steps (count and the engine's step time) and what is left: the
client's TTFT minus the server's is HTTP, body parsing and the first event's
way out (detokenizing, the SSE write); the server's TTFT minus queue minus
prefill steps is the engine loop around them.

    .venv/bin/python benchmarks/served_ttft_ab.py [--old /tmp/old_tree] [--new .] [--requests 20]

Prints medians per tree (and the old/new ratio of client TTFT p50); writes
benchmarks/results/served_ttft_ab.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_tpot_ab import start, stop  # noqa: E402

from kvserve.bench.cli import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_SERIES = {
    "server_ttft": re.compile(r'^vllm:time_to_first_token_seconds_(sum|count)\{[^}]*\}\s+(\S+)$', re.M),
    "queue": re.compile(r'^vllm:request_queue_time_seconds_(sum|count)\{[^}]*\}\s+(\S+)$', re.M),
    "prefill_steps": re.compile(r'^kvserve_engine_step_seconds_(sum|count)\{[^}]*kind="prefill"[^}]*\}\s+(\S+)$',
                                re.M),
}


def totals(client: httpx.Client, base_url: str) -> dict[str, tuple[float, float]]:
    text = client.get(base_url + "/metrics").text
    found = {}
    for name, pattern in _SERIES.items():
        values = dict((kind, float(v)) for kind, v in pattern.findall(text))
        found[name] = (values.get("sum", 0.0), values.get("count", 0.0))
    return found


def client_ttft(client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first = None
    with client.stream("POST", base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]" \
                    and json.loads(line[6:]).get("choices"):
                first = time.perf_counter() - sent
    return first


def text_prompt(client: httpx.Client, base_url: str, model: str, serial: int, num_tokens: int) -> str:
    ids = [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100 for j in range(num_tokens - 1)]
    return client.post(base_url + "/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="the baseline tree (omit: measure --new alone)")
    parser.add_argument("--new", default=str(ROOT))
    parser.add_argument("--requests", type=int, default=20, help="requests per tree (after 2 warm-ups each)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "served_ttft_ab.json"))
    args = parser.parse_args()
    trees = {"new": Path(args.new).resolve()}
    if args.old:
        trees = {"old": Path(args.old).resolve(), **trees}
    servers, urls = {}, {}
    samples: dict[str, list[dict]] = {name: [] for name in trees}
    load_before = os.getloadavg()
    try:
        for name, tree in trees.items():
            port = free_port()
            servers[name] = start(tree, port, Path(tempfile.gettempdir()) / f"served_ttft_{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as client:
            first_url = next(iter(urls.values()))
            model = client.get(first_url + "/v1/models").json()["data"][0]["id"]
            for serial in range(args.requests + 2):
                prompt = text_prompt(client, first_url, model, serial, args.prompt_tokens)
                order = list(trees) if serial % 2 == 0 else list(trees)[::-1]
                for name in order:
                    before = totals(client, urls[name])
                    ttft_s = client_ttft(client, urls[name], model, prompt, args.max_tokens)
                    after = totals(client, urls[name])
                    if serial < 2:  # the first two per server warm it up
                        continue
                    diff = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
                    samples[name].append({"client_ttft_ms": ttft_s * 1e3,
                                          "server_ttft_ms": diff["server_ttft"][0] * 1e3,
                                          "queue_ms": diff["queue"][0] * 1e3,
                                          "prefill_steps_ms": diff["prefill_steps"][0] * 1e3,
                                          "prefill_steps": diff["prefill_steps"][1]})
    finally:
        stop(servers)
    load_after = os.getloadavg()
    columns = ["client_ttft_ms", "server_ttft_ms", "queue_ms", "prefill_steps_ms", "prefill_steps"]
    rows = {}
    print("| tree | client TTFT p50 (min) | server TTFT p50 | queue p50 | prefill steps p50 (count) | "
          "client - server p50 | server - queue - steps p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in samples.items():
        row = {f"{c}_p50": statistics.median(r[c] for r in runs) for c in columns}
        row["client_ttft_ms_min"] = min(r["client_ttft_ms"] for r in runs)
        row["client_minus_server_ms_p50"] = statistics.median(r["client_ttft_ms"] - r["server_ttft_ms"] for r in runs)
        row["engine_loop_ms_p50"] = statistics.median(r["server_ttft_ms"] - r["queue_ms"] - r["prefill_steps_ms"]
                                                      for r in runs)
        row["samples"] = runs
        rows[name] = row
        print(f"| {name} | {row['client_ttft_ms_p50']:.1f} ({row['client_ttft_ms_min']:.1f}) | "
              f"{row['server_ttft_ms_p50']:.1f} | {row['queue_ms_p50']:.1f} | {row['prefill_steps_ms_p50']:.1f} "
              f"({row['prefill_steps_p50']:.0f}) | {row['client_minus_server_ms_p50']:.1f} | "
              f"{row['engine_loop_ms_p50']:.1f} |")
    document = {"date": time.strftime("%Y-%m-%d %H:%M"), "trees": {k: str(v) for k, v in trees.items()},
                "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                "load_average_before": load_before, "load_average_after": load_after, "results": rows}
    if "old" in rows:
        document["speedup_client_ttft_p50"] = rows["old"]["client_ttft_ms_p50"] / rows["new"]["client_ttft_ms_p50"]
        print(f"\nold/new client TTFT p50: {document['speedup_client_ttft_p50']:.2f}x")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    Path(args.out).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
