"""The FastAPI app factory: routes, error handlers, the ASGI layers in front
of them (server/middleware.py), and the engine's lifespan."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvserve.server import errors
from kvserve.server.middleware import BodySizeLimit, InternalErrors, RequireKey, ResponseHeaders
from kvserve.server.routes import router
from kvserve.server.serving import Serving

# Open whatever the keys: liveness and readiness probes carry no key.
PROBE_PATHS = frozenset({"/health", "/ready"})


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
    errors.install_error_handlers(app)
    # add_middleware puts each layer outside the ones added before it.
    app.add_middleware(BodySizeLimit, max_body_bytes=serving.config.max_body_bytes)
    app.add_middleware(RequireKey, serving=serving, open_paths=_open_paths(app, serving))
    app.add_middleware(InternalErrors)
    app.add_middleware(ResponseHeaders, version_headers=serving.version_headers())
    return app


def _open_paths(app: FastAPI, serving: Serving) -> frozenset[str]:
    if serving.config.auth_metrics_and_docs:
        return PROBE_PATHS
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    return PROBE_PATHS | {"/metrics", "/dashboard"} | {path for path in docs if path}
