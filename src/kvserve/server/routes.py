"""HTTP routes: thin; each hands its validated body to `Serving`. The
caller's Tenant comes from RequireKey (server/middleware.py), which has
authenticated the request before its body was read."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from kvserve.admission.tenants import Tenant
from kvserve.dashboard import dashboard_page
from kvserve.metrics import CONTENT_TYPE_LATEST
from kvserve.server.errors import APIError
from kvserve.server.middleware import TENANT_STATE
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoraAdapterRequest,
)
from kvserve.server.serving import Serving

router = APIRouter()
_ERRORS = {
    400: {"description": "Bad input (OpenAI error body)"},
    401: {"description": "Invalid API key"},
    404: {"description": "Unknown model"},
    413: {"description": "Body too large"},
    429: {"description": "Overloaded or over quota; see Retry-After"},
    503: {"description": "Not ready, shutting down, or queue timeout"},
}


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _tenant(request: Request) -> Tenant:
    return getattr(request.state, TENANT_STATE)


@router.post("/v1/completions", responses=_ERRORS)
async def completions(body: CompletionRequest, request: Request):
    return await _serving(request).create("completion", body, _tenant(request), request.headers, request)


@router.post("/v1/chat/completions", responses=_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _serving(request).create("chat", body, _tenant(request), request.headers, request)


@router.post("/tokenize", responses={k: _ERRORS[k] for k in (400, 401, 404)})
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request):
    """vLLM's: the prompt's token ids as a request would be charged them."""
    return JSONResponse(_serving(request).tokenize(body))


@router.post("/detokenize", responses={k: _ERRORS[k] for k in (400, 401, 404)})
async def detokenize(body: DetokenizeRequest, request: Request):
    return JSONResponse(_serving(request).detokenize(body))


@router.get("/v1/models", responses={401: _ERRORS[401]})
async def models(request: Request):
    serving = _serving(request)
    created = int(time.time())
    card = {"id": serving.model_name, "object": "model", "created": created,
            "owned_by": "kvserve", "max_model_len": serving.max_model_len,
            "root": serving.versions.model_revision, "parent": None}
    # vLLM's adapter cards: root is the adapter's folder, parent the base model.
    adapters = [{"id": adapter.name, "object": "model", "created": created, "owned_by": "kvserve",
                 "max_model_len": serving.max_model_len, "root": adapter.path, "parent": serving.model_name}
                for adapter in serving.core.adapters.names()]
    return JSONResponse({"object": "list", "data": [card, *adapters]}, headers=serving.version_headers())


@router.post("/v1/load_lora_adapter", responses={400: _ERRORS[400], 401: _ERRORS[401]})
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    message = await _serving(request).load_lora_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(message)


@router.post("/v1/unload_lora_adapter", responses={400: _ERRORS[400], 401: _ERRORS[401], 404: _ERRORS[404]})
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    return PlainTextResponse(_serving(request).unload_lora_adapter(body.lora_name))


@router.get("/health")
async def health(request: Request):
    serving = _serving(request)
    if serving.engine.dead is not None:
        raise APIError(503, f"engine failed: {serving.engine.dead}", "unavailable", "engine_dead")
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    serving = _serving(request)
    if serving.sleep_level:
        raise APIError(503, f"not ready: asleep (level {serving.sleep_level}); POST /wake_up", "unavailable",
                       "sleeping")
    if not serving.ready:
        raise serving.not_ready_error()
    return {"status": "ready"}


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, if_idle: bool = False):
    """vLLM's sleep mode: level 1 frees the KV cache (weights kept), level 2
    drops the weights too; not ready (503) until /wake_up. `if_idle=true`
    (kvserve's): 409 instead when requests are in flight. With API keys,
    RequireKey has checked the caller's key."""
    return await _serving(request).sleep(level, if_idle)


@router.post("/wake_up")
async def wake_up(request: Request):
    return await _serving(request).wake_up()


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    serving = _serving(request)
    return {"is_sleeping": bool(serving.sleep_level), "level": serving.sleep_level}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(_serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard(period_s: float = 2.0):
    """The live dashboard (kvserve/dashboard.py), drawn in the browser from /metrics."""
    if not 0.1 <= period_s <= 3600:
        raise APIError(400, "period_s must be between 0.1 and 3600 seconds", param="period_s")
    return HTMLResponse(dashboard_page("/metrics", period_s))
