"""The gateway's FastAPI app: the OpenAI front (completions, chat, models),
health, readiness, metrics, the dashboard per backend, and the Batch API
subset; OpenAI-shaped errors.

The completion routes take the raw body (the backend validates it, so bad
input gets exactly a server's 4xx); their OpenAPI schema is still the
server's request models, for clients and for fuzzing.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.dashboard import dashboard_page, fleet_index_page
from kvserve.gateway.batches import BatchError
from kvserve.gateway.service import Gateway, GatewayError
from kvserve.server import protocol

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 2**20
_ERRORS = {
    400: {"description": "Bad input (OpenAI error body)"},
    401: {"description": "Invalid API key"},
    404: {"description": "Unknown model, file or batch"},
    413: {"description": "Body too large"},
    429: {"description": "Overloaded or over quota; see Retry-After"},
    503: {"description": "No backend available, or shutting down"},
}
_BODY_SCHEMAS = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=256)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def create_gateway_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.drain(gateway.config.shutdown_grace_s)
            await gateway.stop()

    app = FastAPI(title="kvserve gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    _openai_routes(app, gateway)
    _batch_routes(app, gateway)
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app)
    return app


def _openai_routes(app: FastAPI, gateway: Gateway) -> None:
    for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat")):
        body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{_BODY_SCHEMAS[path].__name__}"}}}}
        app.add_api_route(path, _completion_endpoint(gateway, kind), methods=["POST"], responses=_ERRORS,
                          openapi_extra={"requestBody": body}, name=kind)

    @app.get("/v1/models")
    async def models(authorization: str | None = Header(default=None)):
        gateway.authenticate(authorization)
        names = [p.model for p in gateway.pools if p.model] + list(gateway.aliases)
        created = int(time.time())
        cards = [{"id": n, "object": "model", "created": created, "owned_by": "kvserve-gateway", "parent": None}
                 for n in names]
        # the backends' LoRA adapters, with their base model as parent (vLLM's adapter cards)
        cards += [{"id": n, "object": "model", "created": created, "owned_by": "kvserve-gateway", "parent": parent}
                  for n, parent in gateway.adapters().items() if n not in names]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not gateway.ready:
            raise GatewayError(503, "not ready: no backend is available, or shutting down", "unavailable",
                               "not_ready")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        from kvserve.metrics import CONTENT_TYPE_LATEST

        return Response(gateway.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    _dashboard_routes(app, gateway)


def _dashboard_routes(app: FastAPI, gateway: Gateway) -> None:
    """The server's dashboard per backend (kvserve/dashboard.py), under an index."""

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboards():
        return HTMLResponse(fleet_index_page([(v.name, v.ready) for v in gateway.backend_list()]))

    @app.get("/dashboard/{index}", response_class=HTMLResponse, responses=_ERRORS)
    async def dashboard(index: int, period_s: float = 2.0):
        gateway.backend_at(index)
        if not 0.1 <= period_s <= 3600:
            raise GatewayError(400, "period_s must be between 0.1 and 3600 seconds", param="period_s")
        return HTMLResponse(dashboard_page(f"/dashboard/{index}/metrics", period_s))

    @app.get("/dashboard/{index}/metrics", responses=_ERRORS)
    async def backend_metrics(index: int):
        from kvserve.metrics import CONTENT_TYPE_LATEST

        return Response(await gateway.backend_metrics(index), media_type=CONTENT_TYPE_LATEST)


def _completion_endpoint(gateway: Gateway, kind: str):
    async def endpoint(request: Request):
        body = await _read_body(request, gateway.config.max_body_bytes)
        return await gateway.create(kind, request, body)
    return endpoint


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body; 413 past the limit, on the declared length and on what arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise GatewayError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise GatewayError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _batch_routes(app: FastAPI, gateway: Gateway) -> None:
    def tenant_of(authorization: str | None) -> str:
        return gateway.authenticate(authorization).name

    @app.post("/v1/files", responses=_ERRORS)
    async def upload(request: Request, authorization: str | None = Header(default=None)):
        tenant = tenant_of(authorization)
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_FILE_BYTES)
        except Exception as exc:  # malformed multipart of any kind is the client's
            raise GatewayError(400, f"expected multipart/form-data with 'file' and 'purpose': {exc}",
                               param="file") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise GatewayError(400, "the form needs a 'file' part", param="file")
        if purpose != "batch":
            raise GatewayError(400, "purpose must be 'batch'", param="purpose")
        content = await upload.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise GatewayError(413, f"file exceeds {MAX_FILE_BYTES} bytes", code="body_too_large")
        return gateway.batches.create_file(tenant, "batch", upload.filename or "input.jsonl", content)

    @app.get("/v1/files/{file_id}", responses=_ERRORS)
    async def file(file_id: str, authorization: str | None = Header(default=None)):
        return gateway.batches.file(tenant_of(authorization), file_id)

    @app.get("/v1/files/{file_id}/content", responses=_ERRORS)
    async def file_content(file_id: str, authorization: str | None = Header(default=None)):
        return Response(gateway.batches.file_content(tenant_of(authorization), file_id), media_type="application/jsonl")

    @app.post("/v1/batches", responses=_ERRORS)
    async def create_batch(body: BatchCreate, authorization: str | None = Header(default=None)):
        return gateway.batches.create_batch(tenant_of(authorization), body.input_file_id, body.endpoint,
                                  body.completion_window, body.metadata)

    @app.get("/v1/batches/{batch_id}", responses=_ERRORS)
    async def batch(batch_id: str, authorization: str | None = Header(default=None)):
        return gateway.batches.batch(tenant_of(authorization), batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=_ERRORS)
    async def cancel(batch_id: str, authorization: str | None = Header(default=None)):
        return gateway.batches.cancel(tenant_of(authorization), batch_id)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_, exc: GatewayError):
        return exc.response()

    @app.exception_handler(BatchError)
    async def batch_error(_, exc: BatchError):
        return JSONResponse(protocol.error_body(str(exc), "invalid_request_error", exc.code, exc.param),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = first.get("msg", "invalid request")
        return JSONResponse(protocol.error_body(f"{param + ': ' if param else ''}{message}",
                                                "invalid_request_error", "invalid_value", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(protocol.error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("internal error")
        return JSONResponse(protocol.error_body("internal server error", "internal_error"), status_code=500)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the server's request models, which the raw-body
    completion routes refer to."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODY_SCHEMAS.values():
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema
