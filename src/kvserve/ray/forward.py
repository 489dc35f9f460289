"""An HTTP request carried from the Ray ingress to a model replica, and run
there through kvserve's own ASGI app in process: the replica answers with
the server's validation, per-replica admission, errors, SSE and metrics,
unchanged, without a second HTTP hop.

`run_asgi` yields a `ResponseStart` (status, headers) and then the body's
chunks as they come; closing it early (the ingress's client left) is a
client disconnect to the app, so the engine aborts the request and frees
its KV. Plain Python objects, so they pickle across Ray processes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.fleet.router import RouteRequest

# The replica that answered, in its ResponseStart's headers (and so the client's).
REPLICA_HEADER = b"x-kvserve-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it, plus what the router
    needs to place it (`route`) and the replicas it must avoid (`exclude`:
    those that already failed it)."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    query_string: bytes = b""
    route: RouteRequest = field(default_factory=RouteRequest)
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)


def _scope(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
            "client": ("ray-ingress", 0), "server": ("ray-replica", 0)}


async def run_asgi(app, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The app's response to `request`: one ResponseStart, then body chunks."""
    out: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    async def call() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(call())
    try:
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message["headers"]))
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
        await task  # re-raises what the app raised
    finally:
        disconnected.set()  # the reader left (or it ended): the app sees its client go
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()
