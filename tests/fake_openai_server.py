"""A scripted OpenAI-compatible streaming server whose timings are known exactly.

Each request is matched to a `Script` by the index in its `X-Request-Id:
bench-<index>` header and its attempt number (how many times that index was
seen), so a test decides per request and per retry what happens:

    Script(status=200, headers_delay_s=0.1, chunks=((0.2, 1), (0.05, 3)))

sleeps 0.1 s (observed as queue time), sends headers, then after 0.2 s a
chunk with 1 token, after another 0.05 s a chunk with 3 tokens. Multi-token
chunks list their tokens in `logprobs` when `logprobs=True`, else they look
like one text chunk (only `usage` then tells the true count).

/metrics exposes vLLM's names (kv usage, running, waiting, preemptions, queue
time histogram, request_success). Reusable by other tests; run as a script
(`python tests/fake_openai_server.py --port 8123 --tokens 32 --gap-s 0.02`)
to serve one paced script to every request (used by the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

QUEUE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Script:
    """What the server does for one attempt of one request (seconds)."""

    status: int = 200
    retry_after: str | None = None
    error_code: str | None = None
    headers_delay_s: float = 0.0
    chunks: tuple[tuple[float, int], ...] = ((0.0, 1),)
    logprobs: bool = True
    usage: bool = True
    kv_usage: float = 0.5


ScriptFn = Callable[[int, int], Script]


class FakeOpenAIServer:
    """aiohttp app on 127.0.0.1; `script(index, attempt)` decides each answer."""

    def __init__(self, script: ScriptFn | Script = Script()) -> None:
        self._script = script if callable(script) else (lambda index, attempt: script)
        self.received: list[dict] = []
        self.disconnected: list[int] = []  # indices whose client went away mid-stream
        self._attempts: dict[int, int] = {}
        self._running = 0
        self.max_running = 0
        self._registry = CollectorRegistry()
        self._kv = Gauge("vllm:kv_cache_usage_perc", "kv", registry=self._registry)
        self._run_g = Gauge("vllm:num_requests_running", "running", registry=self._registry)
        self._wait_g = Gauge("vllm:num_requests_waiting", "waiting", registry=self._registry)
        self._preempt = Counter("vllm:num_preemptions", "preemptions", registry=self._registry)
        self._queue = Histogram("vllm:request_queue_time_seconds", "queue",
                                buckets=QUEUE_BUCKETS_S, registry=self._registry)
        self._success = Counter("vllm:request_success", "success", ["finished_reason"],
                                registry=self._registry)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/ready", self._ready)
        return app

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = int(request.headers.get("X-Request-Id", "bench-0").rsplit("-", 1)[1])
        attempt = self._attempts.get(index, 0)
        self._attempts[index] = attempt + 1
        self.received.append({"index": index, "attempt": attempt, "t": time.perf_counter(),
                              "headers": dict(request.headers), "body": body})
        script = self._script(index, attempt)
        await asyncio.sleep(script.headers_delay_s)
        if script.status != 200:
            return self._error(script)
        self._queue.observe(script.headers_delay_s)
        self._running += 1
        self.max_running = max(self.max_running, self._running)
        self._run_g.set(self._running)
        self._kv.set(script.kv_usage)
        try:
            return await self._stream(request, body, script)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.append(index)
            raise
        finally:
            self._running -= 1
            self._run_g.set(self._running)

    def _error(self, script: Script) -> web.Response:
        headers = {"Retry-After": script.retry_after} if script.retry_after else {}
        error = {"message": "scripted failure", "type": "overloaded",
                 "code": script.error_code, "param": None}
        return web.json_response({"error": error}, status=script.status, headers=headers)

    async def _stream(self, request: web.Request, body: dict, script: Script) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        total = 0
        for delay_s, num_tokens in script.chunks:
            await asyncio.sleep(delay_s)
            await resp.write(_sse(_chunk(chat, num_tokens, script.logprobs)))
            total += num_tokens
        if script.usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": total, "total_tokens": total + 1}
            await resp.write(_sse({"id": "x", "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        self._success.labels(finished_reason="length").inc()
        await resp.write_eof()
        return resp


def _chunk(chat: bool, num_tokens: int, logprobs: bool) -> dict:
    words = [" tok"] * num_tokens
    if chat:
        choice = {"index": 0, "delta": {"content": "".join(words)}, "finish_reason": None}
        if logprobs:
            choice["logprobs"] = {"content": [{"token": w, "logprob": -0.1} for w in words]}
    else:
        choice = {"index": 0, "text": "".join(words), "finish_reason": None}
        if logprobs:
            choice["logprobs"] = {"tokens": words, "token_logprobs": [-0.1] * num_tokens}
    return {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [choice]}


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@contextmanager
def serve_in_thread(server: FakeOpenAIServer):
    """Run the server on its own event loop in a thread (for sync callers)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("fake server did not start")
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description="Paced fake OpenAI streaming server.")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 = free)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per response")
    parser.add_argument("--gap-s", type=float, default=0.02, help="seconds between tokens")
    args = parser.parse_args()
    script = Script(chunks=tuple((args.gap_s, 1) for _ in range(args.tokens)))
    server = FakeOpenAIServer(script)

    async def run() -> None:
        await server.start(args.port)
        print(server.base_url, flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop  # a lighter loop: the fake server should not be the bottleneck
        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
