"""The FastAPI app factory: routes, OpenAI-shaped error handlers, the body
size limit, and the engine's lifespan."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server import protocol
from kvserve.server.routes import router
from kvserve.server.serving import APIError, Serving

log = logging.getLogger(__name__)


def create_app(serving: Serving) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await serving.start()
        try:
            yield
        finally:
            await serving.drain(serving.config.shutdown_grace_s)
            await serving.stop()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    app.state.serving = serving
    app.include_router(router)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=serving.config.max_body_bytes)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 with the error shape.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        elif first.get("type") == "model_attributes_type" and not loc:
            message = "request body must be a JSON object (Content-Type: application/json)"
        return JSONResponse(protocol.error_body(f"{param + ': ' if param else ''}{message}",
                                                "invalid_request_error", "invalid_value", param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(protocol.error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("internal error")
        return JSONResponse(protocol.error_body("internal server error", "internal_error"), status_code=500)


class BodySizeLimit:
    """Pure ASGI middleware: 413 for bodies over the limit, checked on the
    declared Content-Length and on the bytes actually received."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await _too_large(send, self.max_body_bytes)
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                messages.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await _too_large(send, self.max_body_bytes)
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


async def _too_large(send, limit: int) -> None:
    body = JSONResponse(protocol.error_body(f"request body exceeds {limit} bytes",
                                            "invalid_request_error", "body_too_large"), status_code=413)
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body.body)).encode())]})
    await send({"type": "http.response.body", "body": body.body})
