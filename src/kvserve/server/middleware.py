"""The ASGI layers in front of the routes, outermost first:

- ResponseHeaders: every response, errors included (the framework's 404 and
  405, a 401, a 413, a 500), carries `x-request-id` and the version headers;
  a client's own well-formed `x-request-id` is echoed.
- InternalErrors: an exception that escapes a route becomes a 500 in the
  OpenAI shape and the connection stays usable (Starlette's own handler
  re-raises, and uvicorn then closes the connection).
- RequireKey: with API keys configured, a request without a valid key gets
  401 from its headers alone: its body is never read or parsed.
- BodySizeLimit: 413 for a body over the limit, before any of it is parsed.

Pure ASGI (no BaseHTTPMiddleware): streaming responses pass through
unbuffered.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets

from starlette.requests import ClientDisconnect

from kvserve.server import errors
from kvserve.server.errors import APIError

log = logging.getLogger(__name__)

# A client's x-request-id is echoed when it is 1-128 characters of letters,
# digits and - _ . : / + = (UUIDs, ULIDs, base64 ids, "req_..."); anything
# else (empty, longer, spaces, quotes, control or non-ASCII bytes) is
# replaced by a fresh id, so it cannot split a log line or a header.
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
# Where RequireKey leaves the caller's Tenant for the routes (request.state).
TENANT_STATE = "kvserve_tenant"


class ResponseHeaders:
    """Adds `x-request-id` and the version headers to every HTTP response."""

    def __init__(self, app, version_headers: dict[str, str]) -> None:
        self.app = app
        self._versions = [(k.encode(), v.encode()) for k, v in version_headers.items()]
        # Fresh ids: a per-process random prefix and a counter (no syscall per request).
        self._prefix = f"req-{secrets.token_hex(6)}"
        self._counter = itertools.count()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client_id = client_request_id(scope["headers"])

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": self._with_headers(message.get("headers", []), client_id)}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _with_headers(self, headers, client_id: bytes | None) -> list:
        headers = list(headers)
        names = {name.lower() for name, _ in headers}
        if client_id is not None:
            headers = [(n, v) for n, v in headers if n.lower() != b"x-request-id"]
            headers.append((b"x-request-id", client_id))
        elif b"x-request-id" not in names:  # a route's own id (the completion's) stays
            headers.append((b"x-request-id", f"{self._prefix}{next(self._counter):010x}".encode()))
        headers.extend((n, v) for n, v in self._versions if n not in names)
        return headers


def client_request_id(headers) -> bytes | None:
    """The request's own x-request-id when well formed, else None."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            return value if _CLIENT_REQUEST_ID.fullmatch(value) else None
    return None


class InternalErrors:
    """An exception before the response started: a 500 the client can read
    on a connection it can reuse. After it started, nothing honest can be
    sent: re-raise, and the server closes the connection."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            return  # nobody to answer
        except Exception:
            if started:
                raise
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            await errors.internal_error_response()(scope, receive, send)


class RequireKey:
    """Authenticates from the Authorization header before anything reads the
    body; the Tenant goes to the routes as request.state.kvserve_tenant.
    `open_paths` need no key (/health and /ready for probes, and by default
    /metrics and the API docs)."""

    def __init__(self, app, serving, open_paths: frozenset[str]) -> None:
        self.app = app
        self.serving = serving
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        try:
            authorization = _header(scope["headers"], b"authorization")
            tenant = self.serving.authenticate(None if authorization is None else authorization.decode("latin-1"))
        except APIError as exc:
            response = errors.error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)
            return await response(scope, receive, send)
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


def _header(headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


class BodySizeLimit:
    """413 for bodies over the limit, checked on the declared Content-Length
    and on the bytes actually received."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = _header(scope["headers"], b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                messages.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        response = errors.error_response(413, f"request body exceeds {self.max_body_bytes} bytes",
                                         code="body_too_large")
        await response(scope, receive, send)
