"""HTTP to one backend: send a request, classify what came back, and relay
a stream that may break.

What a backend's answer means for the gateway:
- connection refused / reset / timed out before an answer, a 5xx other than
  the request's own 503s: the backend failed (its breaker counts it) and a
  request not yet streaming may go to another backend;
- 429: the backend is full: one other backend may be tried (retry budget);
- anything else (200, a 4xx, a 503 for the request's own queue timeout or
  deadline): the answer, relayed as it came.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from kvserve.gateway.backends import BackendView

# Headers of the backend's answer the client gets as they came.
PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", "x-kvserve-max-tokens")
PASSED_RESPONSE_PREFIX = "x-kvserve-"
# Headers of the client's request the backend gets: the key (backends
# namespace their prefix cache by tenant), deadlines, trace context.
PASSED_REQUEST_HEADERS = ("authorization", "x-kvserve-deadline-s", "traceparent", "tracestate")
# 503 codes that are the request's own fate, not the backend's health.
REQUEST_503_CODES = ("queue_timeout", "deadline")

FAILED, FULL, ANSWER = "failed", "full", "answer"


@dataclass
class Upstream:
    """What one backend answered: its classification and the open response
    (ANSWER / FULL; the caller reads or releases it), or why it failed."""

    outcome: str
    backend: BackendView
    response: aiohttp.ClientResponse | None = None
    body: bytes | None = None  # read for anything but a 200
    failure: str = ""

    @property
    def status(self) -> int:
        return self.response.status if self.response is not None else 502

    @property
    def retry_after_s(self) -> int | None:
        return retry_after_s(self.response.headers.get("retry-after") if self.response is not None else None)

    def headers(self) -> dict[str, str]:
        if self.response is None:
            return {}
        return {k.lower(): v for k, v in self.response.headers.items()
                if k.lower() in PASSED_RESPONSE_HEADERS or k.lower().startswith(PASSED_RESPONSE_PREFIX)}


async def send(session: aiohttp.ClientSession, backend: BackendView, path: str, body: bytes, headers,
               connect_timeout_s: float) -> Upstream:
    out_headers = {"content-type": "application/json"}
    for name in PASSED_REQUEST_HEADERS:
        value = headers.get(name)
        if value is not None:
            out_headers[name] = value
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=None)
    try:
        response = await session.post(backend.url + path, data=body, headers=out_headers, timeout=timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return Upstream(FAILED, backend, failure=f"{type(exc).__name__}: {exc}")
    if response.status == 200:
        return Upstream(ANSWER, backend, response)
    try:
        content = await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        response.release()
        return Upstream(FAILED, backend, failure=f"{type(exc).__name__}: {exc}")
    finally:
        response.release()
    if response.status == 429:
        return Upstream(FULL, backend, response, content)
    if response.status >= 500 and not (response.status == 503 and error_code(content) in REQUEST_503_CODES):
        return Upstream(FAILED, backend, response, content, failure=f"HTTP {response.status}")
    return Upstream(ANSWER, backend, response, content)


def retry_after_s(raw: str | None) -> int | None:
    """A Retry-After header's whole seconds (>= 1); None when absent or not a number."""
    try:
        return max(1, int(float(raw))) if raw else None
    except ValueError:
        return None


def error_code(content: bytes) -> str | None:
    try:
        error = json.loads(content).get("error") or {}
        return error.get("code")
    except (ValueError, AttributeError):
        return None


class StreamRelay:
    """Passes a backend's SSE bytes through as they arrive, keeping the last
    event (for the envelope of an error event) and the usage, if sent."""

    def __init__(self, upstream: Upstream, on_backend_failure: Callable[[str], None]) -> None:
        self.upstream = upstream
        self.on_backend_failure = on_backend_failure
        self.usage: dict | None = None
        self.completed = False  # saw [DONE]
        self._tail = b""
        self._last_event: bytes | None = None

    async def events(self) -> AsyncIterator[bytes]:
        response = self.upstream.response
        assert response is not None
        try:
            async for chunk in response.content.iter_any():
                self._scan(chunk)
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.on_backend_failure(f"{type(exc).__name__}: {exc}")
        finally:
            response.close()  # the client left early or the stream ended: the backend sees the connection go
        if not self.completed:  # the backend went away mid-stream: end it cleanly and say so
            yield self._error_events()

    def _scan(self, chunk: bytes) -> None:
        data = self._tail + chunk
        *events, self._tail = data.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                self.completed = True
            elif payload.startswith(b"{"):
                self._last_event = payload
                if b'"usage":{' in payload:
                    usage = json.loads(payload).get("usage")
                    if isinstance(usage, dict):
                        self.usage = usage

    def _error_events(self) -> bytes:
        """A final chunk with finish_reason "error" in the stream's own
        envelope, an OpenAI error event, and [DONE]."""
        try:
            envelope = json.loads(self._last_event) if self._last_event else {}
        except ValueError:
            envelope = {}
        chat = envelope.get("object") == "chat.completion.chunk"
        choice = {"index": 0, "logprobs": None, "finish_reason": "error",
                  **({"delta": {}} if chat else {"text": ""})}
        final = {k: envelope[k] for k in ("id", "object", "created", "model", "system_fingerprint") if k in envelope}
        final["choices"] = [choice]
        error = {"error": {"message": "the backend serving this stream failed; the output is incomplete",
                           "type": "backend_error", "code": "backend_failed", "param": None}}
        return (b"data: " + json.dumps(final).encode() + b"\n\n" + b"data: " + json.dumps(error).encode()
                + b"\n\ndata: [DONE]\n\n")


def usage_tokens(usage: dict | None) -> int | None:
    if not usage:
        return None
    total = usage.get("total_tokens")
    return total if isinstance(total, int) else None
