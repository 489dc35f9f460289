"""The gateway: one object that owns the backend views, pools, fleet
admission, the ladder, the deferred lane and the HTTP client, and serves
each request through them:

    authenticate -> read the body (unvalidated) -> model -> pool (an alias
    picks one) -> tenant quotas + retry budget (once for the fleet) ->
    place: the pool can start it within its class's limit, else the
    ladder's next rung (cap max_tokens -> the smaller model's pool -> the
    deferred lane (202 + batch id) -> 429) -> route (fleet.router) -> send;
    a failed backend before the stream starts: the next one; a backend's
    429: one other (retry budget) -> relay the answer / the stream.

Every degraded answer says what changed in `x-kvserve-degraded`, and the
response's `model` is the backend's, i.e. the model that answered.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.admission.decision import AdmissionDecision, Outcome
from kvserve.admission.tenants import Tenant
from kvserve.fleet.backend_state import expected_wait_s
from kvserve.fleet.door import FleetQuotas, FullAnswers, Saturated, wait_refusal
from kvserve.fleet.router import RouteDecision, RouteRequest, affinity_key
from kvserve.gateway import proxy
from kvserve.gateway.backends import BackendView, Sent
from kvserve.gateway.batches import BatchRunner, BatchStore, PendingLine, RetryLater
from kvserve.gateway.config import CAP_MAX_TOKENS, DEFERRED, REJECT, SMALLER_MODEL, GatewayConfig
from kvserve.gateway.inbound import BYTES_PER_TOKEN, Inbound, read_inbound
from kvserve.gateway.metrics import DEFER, LADDER, GatewayMetrics
from kvserve.gateway.pools import AliasPolicy, Pool
from kvserve.gateway.scrape import Scraper
from kvserve.server import protocol

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An OpenAI-shaped error the gateway answers itself."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    @classmethod
    def of(cls, refusal: AdmissionDecision) -> GatewayError:
        """The server's answer to the same refusal (status, type, code, Retry-After)."""
        headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else {}
        return cls(refusal.status, refusal.message, protocol.refusal_type(refusal.status, refusal.reason),
                   refusal.reason, None, headers)

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.type, self.code, self.param),
                            status_code=self.status, headers=self.headers)


@dataclass
class _Placement:
    """Where a request goes after the ladder: its pool, the max_tokens cap
    and model it runs with, and what was changed (for the header)."""

    pool: Pool
    rename: bool = False  # send the pool's model name (an alias resolved, a smaller model)
    adapter: str | None = None  # a LoRA adapter's name: only backends that list it
    max_tokens: int | None = None
    degraded: list[str] = field(default_factory=list)


class Gateway:
    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.views = {b.name: BackendView(b, config.breaker, clock) for p in config.pools for b in p.backends}
        self.pools = [Pool(p, [self.views[b.name] for b in p.backends], config.router, clock)
                      for p in config.pools]
        self.aliases = {a.name: AliasPolicy(a) for a in config.aliases}
        self.quotas = FleetQuotas.from_keys_file(config.api_keys_path, config.admission.retry_budget,
                                                 config.admission.retry_budget_burst, clock)
        self.metrics = GatewayMetrics()
        self._batches: BatchStore | None = None  # opened by start(): the app can be built without I/O
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self._tasks: list[asyncio.Task] = []
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._num_active = 0  # requests in flight, streams until their end: what a drain waits for

    @property
    def batches(self) -> BatchStore:
        if self._batches is None:
            raise GatewayError(503, "the gateway is not started", "unavailable", "not_ready")
        return self._batches

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self._batches = BatchStore(self.config.state_dir)
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        scraper = Scraper(list(self.views.values()), self.session, self.config)
        await scraper.scrape_all()  # a first view before /ready
        runner = BatchRunner(self.batches, self._run_batch_line, self._batch_has_room, self.config.batch_concurrency)
        self._tasks = [asyncio.create_task(scraper.run()), asyncio.create_task(runner.run())]

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests; let those in flight finish for up to grace_s."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self._batches is not None:
            self._batches.close()

    @property
    def ready(self) -> bool:
        return not self.draining and any(p.eligible(self.config.stale_after_s) for p in self.pools)

    # ---- requests ----------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Tenant:
        tenant = self.quotas.authenticate(authorization)
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               "authentication_error", "invalid_api_key")
        return tenant

    async def create(self, kind: str, http_request, body: bytes) -> Response:
        """Serve one /v1/completions or /v1/chat/completions request (its body read)."""
        if self.draining:
            raise GatewayError(503, "the gateway is shutting down", "unavailable", "shutting_down")
        headers = http_request.headers
        tenant = self.authenticate(headers.get("authorization"))
        inbound = read_inbound(kind, http_request.url.path, body, tenant.priority, headers)
        pool, adapter = await self._target_of(inbound)
        request_id = f"gw-{self._id_prefix}{next(self._ids):08x}"
        max_tokens = inbound.requested_max_tokens or self.config.admission.default_max_tokens
        refusal = self.quotas.admit(request_id, tenant, inbound.num_prompt_tokens, max_tokens, inbound.is_retry)
        if refusal is not None:
            self.metrics.record_admission(pool.label, Outcome.REJECT, refusal.reason)
            raise GatewayError.of(refusal)
        self._num_active += 1
        streaming = False
        try:
            response = await self._serve(request_id, inbound, tenant, pool, http_request, headers, adapter=adapter)
            streaming = isinstance(response, StreamingResponse)  # it ends (and finishes) with its stream
            return response
        finally:
            if not streaming:
                self._num_active -= 1
                self.quotas.on_finish(request_id)  # a no-op when the answer already did it

    async def _target_of(self, inbound: Inbound) -> tuple[Pool, str | None]:
        """(pool, LoRA adapter or None) for the body's model: a pool's model,
        an alias's choice, or an adapter some backends list (the pool of
        its base model, later filtered to those backends). 404 for a name
        no pool, alias or listed adapter has."""
        models = {p.model for p in self.pools if p.model}
        alias = self.aliases.get(inbound.model or "")
        if alias is not None:
            chosen = self._pool_named(await alias.choose(inbound.prompt_text, inbound.requested_max_tokens, models))
            assert chosen is not None  # the config checked that every alias target is a pool
            return chosen, None
        pool = self._pool_named(inbound.model)
        if pool is not None:
            return pool, None
        pool = self._pool_with_adapter(inbound.model)
        if pool is not None:
            return pool, inbound.model
        if len(self.pools) == 1 and (inbound.model is None or not self.pools[0].listing_known):
            return self.pools[0], None  # no name, or backends whose names it could not read: their own answer
        raise GatewayError(404, f"model {inbound.model!r} does not exist; this gateway serves "
                                f"{sorted(models | set(self.aliases) | set(self.adapters()))}",
                           "invalid_request_error", "model_not_found", "model")

    def _pool_with_adapter(self, name: str | None) -> Pool | None:
        """The pool whose backends list the LoRA adapter `name`: the one of
        its parent model where several do."""
        having = [p for p in self.pools if name is not None and name in p.adapters()]
        parent_pools = [p for p in having if p.model is not None and p.model == p.adapters()[name]]
        return (parent_pools or having or [None])[0]

    def adapters(self) -> dict[str, str | None]:
        """Every LoRA adapter the backends list: name -> parent model."""
        listed: dict[str, str | None] = {}
        for pool in self.pools:
            for name, parent in pool.adapters().items():
                listed.setdefault(name, parent)
        return listed

    def _pool_named(self, model: str | None) -> Pool | None:
        return next((p for p in self.pools if model is not None and p.model == model), None)

    async def _serve(self, request_id: str, inbound: Inbound, tenant: Tenant, pool: Pool, http_request,
                     headers, ladder: bool = True, adapter: str | None = None) -> Response:
        placement = _Placement(pool, rename=inbound.model in self.aliases, adapter=adapter)
        rungs = list(self.config.rungs_for(inbound.priority)) if ladder else [REJECT]
        while True:
            outcome = await self._try_pool(request_id, inbound, tenant, placement, http_request, headers)
            if not isinstance(outcome, Saturated):
                return outcome
            rung = self._next_rung(rungs, inbound, placement)
            label = placement.pool.label
            if rung is None or rung == REJECT:
                self.metrics.record_admission(label, Outcome.REJECT, outcome.reason)
                raise GatewayError(429, outcome.message, protocol.refusal_type(429, outcome.reason), outcome.reason,
                                   None, {"Retry-After": str(outcome.retry_after_s)})
            self.metrics.degradations.labels(label, rung).inc()
            if rung == DEFERRED:
                return self._defer(request_id, inbound, tenant, placement)

    def _next_rung(self, rungs: list[str], inbound: Inbound, placement: _Placement) -> str | None:
        """Apply the next rung that changes something; None when none is left."""
        while rungs:
            rung = rungs.pop(0)
            if rung == CAP_MAX_TOKENS:
                cap = self.config.ladder_max_tokens
                current = placement.max_tokens or inbound.requested_max_tokens \
                    or self.config.admission.default_max_tokens
                if current > cap:
                    placement.max_tokens = cap
                    placement.degraded.append(f"max_tokens={cap}")
                    return rung
            elif rung == SMALLER_MODEL:
                # an adapter runs on its own base model: a smaller one cannot serve it
                smaller = None if placement.adapter is not None else self._pool_named(placement.pool.smaller)
                if smaller is not None:
                    placement.pool, placement.rename = smaller, True
                    placement.degraded.append(f"model={smaller.model}")
                    return rung
            else:
                return rung
        return None

    async def _try_pool(self, request_id: str, inbound: Inbound, tenant: Tenant, placement: _Placement,
                        http_request, headers) -> Response | Saturated:
        pool, cfg = placement.pool, self.config
        candidates = pool.eligible(cfg.stale_after_s, adapter=placement.adapter)
        if not candidates:
            serving = pool.label if placement.adapter is None else f"{pool.label!r} with adapter {placement.adapter}"
            raise GatewayError(503, f"no backend of model {serving!r} is available (all ejected or not ready)",
                               "unavailable", "no_backend")
        max_tokens = placement.max_tokens or inbound.requested_max_tokens or cfg.admission.default_max_tokens
        num_tokens = inbound.num_prompt_tokens + max_tokens
        refusal = wait_refusal(candidates, num_tokens, cfg.admission.max_wait_s(inbound.priority),
                               pool.return_slots)
        if refusal is not None:
            assert refusal.reason is not None and refusal.retry_after_s is not None  # a 429 has both
            return Saturated(refusal.reason, refusal.message, refusal.retry_after_s)
        route = RouteRequest(inbound.num_prompt_tokens, max_tokens, self._key(placement, inbound, tenant))
        body = inbound.body_bytes(pool.model if placement.rename else None, placement.max_tokens)
        tried: set[str] = set()
        full = FullAnswers()
        while candidates:
            backend, decision = self.choose(pool, route, candidates)
            tried.add(backend.name)
            self.metrics.routed.labels(pool.label, backend.name, decision.reason).inc()
            sent = backend.on_send(num_tokens)
            try:
                upstream = await self._send(backend, inbound, body, headers, http_request)
            except BaseException:
                backend.on_done(sent)
                raise
            if upstream.outcome == proxy.ANSWER:
                response = await self._answer(request_id, upstream, sent, inbound, pool, placement, route,
                                              http_request)
                if response is not None:
                    return response
                upstream.outcome, upstream.failure = proxy.FAILED, "broke while answering"
            else:
                backend.on_done(sent)
            candidates = pool.eligible(cfg.stale_after_s, exclude=tried, adapter=placement.adapter)
            if upstream.outcome == proxy.FAILED:
                backend.breaker.record_failure()
                log.warning("backend %s failed (%s); %d left", backend.name, upstream.failure, len(candidates))
                self.metrics.retries.labels(pool.label, "backend_failed").inc()
                continue
            full.record(upstream.retry_after_s, proxy.error_code(upstream.body or b""))
            if not full.may_try_another(len(candidates), self.quotas):
                break
            self.metrics.retries.labels(pool.label, "backend_full").inc()
        if full:
            return full.saturated(candidates)
        raise GatewayError(502, f"every backend of model {pool.label!r} failed this request",
                           "unavailable", "backend_failed")

    @staticmethod
    def choose(pool: Pool, route: RouteRequest, candidates: list[BackendView]) -> tuple[BackendView, RouteDecision]:
        """The routing decision: the pool's router over its eligible backends
        in configured order (what `kvserve simulate` decides over its replicas)."""
        decision = pool.router.pick(candidates, route)
        return candidates[decision.position], decision

    def _key(self, placement: _Placement, inbound: Inbound, tenant: Tenant) -> int | None:
        """The prefix-affinity key, for the model the request runs under: its
        adapter's, else its pool's (whatever name, alias or none it was sent with)."""
        if placement.pool.router.policy != "prefix-affinity" or not inbound.prompt_bytes:
            return None
        num_bytes = self.config.router.affinity_prefix_tokens * BYTES_PER_TOKEN
        return affinity_key(tenant.name, placement.adapter or placement.pool.label, inbound.prompt_bytes[:num_bytes])

    async def _send(self, backend: BackendView, inbound: Inbound, body: bytes, headers,
                    http_request) -> proxy.Upstream:
        """Send, abandoning the backend's request if the client leaves first."""
        assert self.session is not None
        sending = asyncio.create_task(proxy.send(self.session, backend, inbound.path, body, headers,
                                                 self.config.connect_timeout_s))
        return await self._unless_disconnected(sending, http_request)

    async def _unless_disconnected(self, task: asyncio.Task, http_request):
        """The task's result; cancel it (closing its backend connection) when
        the client disconnects first."""
        if http_request is None:
            return await task
        watcher = asyncio.create_task(_disconnected(http_request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task not in done:
            task.cancel()
            raise asyncio.CancelledError("client disconnected")
        return task.result()

    async def _answer(self, request_id: str, upstream: proxy.Upstream, sent: Sent, inbound: Inbound, pool: Pool,
                      placement: _Placement, route: RouteRequest, http_request) -> Response | None:
        """The client's response; None when the backend broke before the
        whole (non-streaming) answer came, so another may be asked."""
        backend = upstream.backend
        headers = upstream.headers()
        headers["x-kvserve-backend"] = backend.name
        headers["x-kvserve-gateway-request-id"] = request_id
        if route.affinity_key is not None:
            headers["x-kvserve-route-key"] = f"{route.affinity_key:016x}"
        if placement.degraded:
            own = headers.get("x-kvserve-degraded")
            headers["x-kvserve-degraded"] = ", ".join(placement.degraded + ([own] if own else []))
        if placement.degraded:
            self.metrics.record_admission(pool.label, Outcome.DEGRADE, LADDER)
        else:
            self.metrics.record_admission(pool.label, Outcome.ADMIT, None)
        if upstream.status != 200 or upstream.body is not None:
            backend.on_done(sent)
            return _bytes_response(upstream.body or b"", upstream.status, headers)
        if inbound.stream:
            return self._stream(request_id, upstream, sent, headers)
        try:
            content = await self._unless_disconnected(asyncio.create_task(upstream.response.read()), http_request)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        finally:
            upstream.response.release()
            backend.on_done(sent)
        self.quotas.on_finish(request_id, _tokens_of(content))  # refunds tokens per minute to what was used
        return _bytes_response(content, 200, headers)

    def _stream(self, request_id: str, upstream: proxy.Upstream, sent: Sent,
                headers: dict[str, str]) -> StreamingResponse:
        backend = upstream.backend

        def failed(why: str) -> None:
            log.warning("stream from %s broke: %s", backend.name, why)
            backend.breaker.record_failure()
            self.metrics.stream_errors.labels(backend.name).inc()

        relay = proxy.StreamRelay(upstream, failed)
        ended = False

        async def end() -> None:
            # Runs once, from the stream's end or, if the body was never
            # iterated (the client left first), after the response.
            nonlocal ended
            if ended:
                return
            ended = True
            self._num_active -= 1
            upstream.response.close()
            backend.on_done(sent)
            self.quotas.on_finish(request_id, proxy.usage_tokens(relay.usage))

        async def events():
            try:
                async for chunk in relay.events():
                    yield chunk
            finally:
                await end()

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers,
                                 background=BackgroundTask(end))

    # ---- the deferred lane -----------------------------------------------
    def _defer(self, request_id: str, inbound: Inbound, tenant: Tenant, placement: _Placement) -> Response:
        if inbound.body is None:  # unreadable: no batch line can hold it; the backend's 400 is what it earns
            raise GatewayError(400, "request body must be a JSON object", "invalid_request_error", "invalid_value")
        body = dict(inbound.body)
        body.pop("stream", None)
        body.pop("stream_options", None)
        batch = self.batches.create_from_request(tenant.name, inbound.path, body, request_id)
        self.metrics.record_admission(placement.pool.label, DEFER, LADDER)
        # The line runs later as it came (no cap, its own model): the lane, not the rungs before, is the change.
        headers = {"x-kvserve-degraded": f"deferred={batch['id']}", "location": f"/v1/batches/{batch['id']}"}
        return JSONResponse(batch, status_code=202, headers=headers)

    def _batch_has_room(self) -> bool:
        """Some backend could start a request now, without queueing."""
        for pool in self.pools:
            candidates = pool.eligible(self.config.stale_after_s)
            if candidates and min(expected_wait_s(v) for v in candidates) <= 0.0:
                return True
        return False

    async def _run_batch_line(self, line: PendingLine) -> tuple[int | None, dict | None, dict | None]:
        """One batch line through the fleet at the lowest priority."""
        body = dict(line.body)
        body["stream"] = False
        body["priority"] = max(int(body.get("priority") or 0), self.config.batch_priority) \
            if isinstance(body.get("priority", 0), int) else body.get("priority")
        key = self.quotas.key_of(line.tenant)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        kind = "chat" if line.endpoint.endswith("chat/completions") else "completion"
        inbound = read_inbound(kind, line.endpoint, json.dumps(body).encode(), None, headers)
        tenant = Tenant(line.tenant)
        try:
            pool, adapter = await self._target_of(inbound)
            response = await self._serve(f"batch-{line.batch_id}-{line.line}", inbound, tenant, pool, None, headers,
                                         ladder=False, adapter=adapter)
        except GatewayError as exc:
            if exc.status == 429 or exc.status >= 500:  # no room or no backend after all: later
                raise RetryLater() from None
            return exc.status, None, {"code": exc.code or "error", "message": exc.message}
        try:
            content = json.loads(response.body)
        except ValueError:
            content = None
        return response.status_code, content, None

    # ---- metrics ----------------------------------------------------------
    def backend_list(self) -> list[BackendView]:
        """Every backend, in configuration order: the dashboard's indexes."""
        return list(self.views.values())

    def backend_at(self, index: int) -> BackendView:
        """Backend `index` of backend_list(); a 404 for no such backend."""
        backends = self.backend_list()
        if not 0 <= index < len(backends):
            raise GatewayError(404, f"no backend {index} (the gateway has {len(backends)})", "not_found_error",
                               "backend_not_found", "index")
        return backends[index]

    async def backend_metrics(self, index: int) -> bytes:
        """Backend `index`'s /metrics now (its dashboard, drawn through the
        gateway, polls this): a 502 when it does not answer."""
        view = self.backend_at(index)
        if self.session is None:
            raise GatewayError(503, "the gateway is not started", "unavailable", "not_ready")
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout_s)
        try:
            async with self.session.get(view.url + "/metrics", timeout=timeout) as response:
                content = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise GatewayError(502, f"backend {view.name}: {type(exc).__name__}: {exc}", "backend_error",
                               "backend_failed") from None
        if response.status != 200:
            raise GatewayError(502, f"backend {view.name}: /metrics answered HTTP {response.status}",
                               "backend_error", "backend_failed")
        return content

    def render_metrics(self) -> bytes:
        stale = self.config.stale_after_s
        self.metrics.refresh(((p.label, p.views, len(p.eligible(stale))) for p in self.pools),
                             self._batches.counts_by_status() if self._batches is not None else {})
        return self.metrics.render()


async def _disconnected(http_request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def _bytes_response(content: bytes, status: int, headers: dict[str, str]) -> Response:
    media_type = headers.pop("content-type", "application/json")
    return Response(content, status_code=status, headers=headers, media_type=media_type)


def _tokens_of(content: bytes) -> int | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return proxy.usage_tokens(usage if isinstance(usage, dict) else None)
