"""Where a lone streamed completion's TTFT goes on `kvserve serve` (default
model, default flags), stage by stage: the server runs with timestamps
(time.monotonic, the system's CLOCK_MONOTONIC, which the client reads too)
taken by wrappers around its own functions, and a client sends one
256-token text prompt at a time (`vllm bench serve`'s random workload at
concurrency 1; --max-tokens out, ignore_eos) and stamps the send and the
first SSE event. Stages: client send -> ASGI request -> prepare (parse,
tokenize) -> engine.add -> the engine thread takes it -> the prefill step
-> the event loop gets the first output -> headers -> the first SSE event
-> the client reads it. Only this script wraps those functions.

    .venv/bin/python benchmarks/ttft_stages.py [--requests 14] [--tree .]

Prints the median / min / max ms of each stage; writes
benchmarks/results/ttft_stages.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve_with_stamps(stamps_path: str, serve_args: list[str]) -> int:
    """`kvserve serve` with a timestamp line per stage appended to stamps_path."""
    out = open(stamps_path, "a", buffering=1)
    lock = threading.Lock()

    def mark(event: str) -> None:
        with lock:
            out.write(f"{time.monotonic():.6f} {event}\n")

    from kvserve.engine import async_engine, core
    from kvserve.server import app, prepare, serving, streaming

    create_app = app.create_app

    def stamped_app(s):
        inner = create_app(s)

        async def asgi(scope, receive, send):
            if scope["type"] != "http" or not scope["path"].startswith("/v1/completions"):
                return await inner(scope, receive, send)
            mark("asgi_request")
            first_body = [True]

            async def stamped_send(message):
                if message["type"] == "http.response.start":
                    mark("headers_sent")
                if message["type"] == "http.response.body" and message.get("body") and first_body[0]:
                    first_body[0] = False
                    mark("first_body_sent")
                await send(message)
            return await inner(scope, receive, stamped_send)
        return asgi
    app.create_app = stamped_app

    def wrap(owner, name: str, before: str | None, after: str | None = None) -> None:
        fn = getattr(owner, name)

        def stamped(*args, **kwargs):
            if before:
                mark(before)
            result = fn(*args, **kwargs)
            if after:
                mark(after)
            return result
        setattr(owner, name, stamped)
    wrap(prepare.RequestPreparer, "prepare", "prepare_start", "prepare_end")
    wrap(serving.Serving, "_add_choice", "engine_add")
    wrap(async_engine.AsyncEngine, "_add", "engine_thread_add")
    wrap(core.EngineCore, "step", "step_start", "step_end")
    wrap(async_engine.AsyncEngine, "_deliver", "loop_deliver")
    sse = streaming.sse

    async def stamped_sse(*args, **kwargs):
        first = True
        async for event in sse(*args, **kwargs):
            if first:
                mark("first_event_built")
                first = False
            yield event
    streaming.sse = stamped_sse

    from kvserve.cli import main
    return main(["serve", *serve_args])


STAGES = [  # (name, from event, to event); "step*" is the first step after the engine took the request
    ("client send -> ASGI request", "client_send", "asgi_request"),
    ("ASGI -> prepare (routing, body parse)", "asgi_request", "prepare_start"),
    ("prepare (checks, tokenize)", "prepare_start", "prepare_end"),
    ("prepare -> engine.add", "prepare_end", "engine_add"),
    ("engine.add -> engine thread", "engine_add", "engine_thread_add"),
    ("engine thread -> step start", "engine_thread_add", "step*_start"),
    ("the prefill step", "step*_start", "step*_end"),
    ("step end -> event loop delivers", "step*_end", "loop_deliver"),
    ("delivered -> headers sent", "loop_deliver", "headers_sent"),
    ("headers -> first SSE event built", "headers_sent", "first_event_built"),
    ("first event -> written", "first_event_built", "first_body_sent"),
    ("written -> client reads it", "first_body_sent", "client_first_event"),
    ("client TTFT", "client_send", "client_first_event"),
]


def per_request(lines: list[tuple[float, str]]) -> list[dict[str, float]]:
    """The stamps of each request (from its client_send on), the first step after the
    engine thread took it as step*."""
    requests, current = [], None
    for stamp, event in lines:
        if event == "client_send":
            current = {"client_send": stamp, "steps": []}
            requests.append(current)
        elif current is not None and event in ("step_start", "step_end"):
            current["steps"].append((event, stamp))
        elif current is not None and event not in current:
            current[event] = stamp
    for r in requests:
        starts = [t for e, t in r["steps"] if e == "step_start" and t >= r.get("engine_thread_add", float("inf"))]
        if starts:
            r["step*_start"] = starts[0]
            r["step*_end"] = min(t for e, t in r["steps"] if e == "step_end" and t >= starts[0])
        del r["steps"]
    return requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(ROOT), help="the source tree whose server to time")
    parser.add_argument("--requests", type=int, default=14, help="requests (the first 2 are dropped)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ttft_stages.json"))
    args = parser.parse_args()
    if args.serve is not None:
        return serve_with_stamps(os.environ["KVSERVE_STAMPS"], args.serve)
    import httpx

    from kvserve.bench.cli import free_port, wait_ready

    stamps_path = Path(tempfile.mkdtemp()) / "stamps.log"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(args.tree).resolve() / "src"), "KVSERVE_STAMPS": str(stamps_path)}
    log = open(stamps_path.with_name("serve.log"), "w")
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()
    try:
        wait_ready(base_url, server, 300)
        with httpx.Client(timeout=120) as client, open(stamps_path, "a", buffering=1) as stamps:
            model = client.get(base_url + "/v1/models").json()["data"][0]["id"]
            for serial in range(args.requests):
                ids = [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100
                                         for j in range(args.prompt_tokens - 1)]
                prompt = client.post(base_url + "/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]
                body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream": True}
                stamps.write(f"{time.monotonic():.6f} client_send\n")
                first = True
                with client.stream("POST", base_url + "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if first and line.startswith("data: "):
                            stamps.write(f"{time.monotonic():.6f} client_first_event\n")
                            first = False
                time.sleep(0.3)  # the engine idle between requests, as at c1 between a stream's end and the next
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    lines = [(float(t), e) for t, e in (line.split() for line in stamps_path.read_text().splitlines())]
    requests = per_request(lines)[2:]
    rows = []
    print("| stage | p50 ms | min ms | max ms |\n|---|---:|---:|---:|")
    for name, start, end in STAGES:
        values = [(r[end] - r[start]) * 1e3 for r in requests if start in r and end in r]
        row = {"stage": name, "p50_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values)}
        rows.append(row)
        print(f"| {name} | {row['p50_ms']:.2f} | {row['min_ms']:.2f} | {row['max_ms']:.2f} |")
    load_after = os.getloadavg()
    print(f"\n{len(requests)} requests; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "tree": args.tree,
                                          "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                          "load_average_before": load_before, "load_average_after": load_after,
                                          "stages": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
