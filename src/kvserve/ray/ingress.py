"""The Ray application's ingress: the OpenAI API in front of the model
deployment, applying the gateway's fleet admission once for every replica:

    authenticate -> tenant quotas + retry budget (fleet.door.FleetQuotas)
    -> 429 + Retry-After before any replica when none can start it within its
    class's queue-wait limit (fleet.door.wait_refusal over the router's
    views: what binds, and a return slot staggered over the fleet's drain)
    -> the model deployment's handle, routed by kvserve's router
    (ray.router) -> the replica's own admission and answer, relayed; a
    replica's 429 (refused, not started) is sent to one other replica within
    the retry budget, and when none takes it the client gets one 429 with
    the soonest Retry-After (fleet.door.FullAnswers, as the gateway).

A replica that dies before its answer starts (Ray reports the actor dead)
is dropped by Ray's router and the request is sent again, to another; a
stream already under way ends with a clean error event. A client that
leaves cancels the replica's call, which aborts the request there. A
replica that answers 503 "shutting_down" (its drain began after the request
was routed there; it never started it) has the request sent to another.

Scale-down: Ray takes a replica it stops out of the running set it
broadcasts to the router, and never tells the replica's own code until its
requests are over (see kvserve.ray.replica). Each model replica asks the
ingress every stats period (`replica_stopping`) whether the router's set
still holds it; when it does not, the replica drains.

A warm pool (`warm_pool` set): every interval the ingress runs
`fleet.autoscale.decide` over the signals the replicas record (the ones
the Ray policy reads) and puts the replicas it does not need awake to
sleep once idle (`POST /sleep?level=1&if_idle=true` to that replica), and
wakes sleeping ones (`POST /wake_up`); the Ray policy, counting sleepers
as held replicas, asks for new ones only beyond them.
"""

# No `from __future__ import annotations`: Ray's class-based FastAPI view
# rewrites the route methods' signatures and reads their annotations as
# objects (as strings, `request: Request` becomes a query parameter: 422).
import asyncio
import dataclasses
import itertools
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvserve.fleet.autoscale import AutoscaleConfig, ScaleState, decide
from kvserve.fleet.router import RouteRequest, affinity_key
from kvserve.admission.decision import AdmissionDecision
from kvserve.admission.retry_after import ReturnSlots
from kvserve.config import AdmissionConfig
from kvserve.fleet.door import FleetQuotas, FullAnswers, Saturated, wait_refusal
from kvserve.gateway.inbound import BYTES_PER_TOKEN, read_inbound
from kvserve.gateway.proxy import error_code, retry_after_s, usage_tokens
from kvserve.metrics import CONTENT_TYPE_LATEST
from kvserve.ray.forward import REPLICA_HEADER, ForwardedRequest, ResponseStart
from kvserve.ray.fleet_metrics import replica_series
from kvserve.ray.views import replica_views
from kvserve.server import protocol

# Under "ray.serve": Ray Serve sends its loggers to the replica logs.
log = logging.getLogger("ray.serve." + __name__)

# Sends of one request: the first and, after replicas died under it, others.
MAX_ATTEMPTS = 3
# A replica's 503 code while it drains (kvserve serve's at its shutdown).
DRAINING_CODE = "shutting_down"
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class IngressConfig:
    """deployment_name: the model deployment's. api_keys_path / retry
    budget: the fleet's tenants and retries. admission: the replicas'
    AdmissionConfig (its classes' queue-wait limits, its default max_tokens:
    the projection of a request without one).
    router_policy / affinity_prefix_tokens: as the router's (for the key).
    warm_pool: the autoscaling config whose awake count the ingress
    applies every warm_pool_interval_s (None: no sleeping)."""

    deployment_name: str
    api_keys_path: str | None = None
    retry_budget: float = 0.1
    retry_budget_burst: float = 5.0
    admission: AdmissionConfig = AdmissionConfig()
    router_policy: str = "kv-aware"
    affinity_prefix_tokens: int = 64
    warm_pool: dict | None = None
    warm_pool_interval_s: float = 1.0


class IngressError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers or {}

    @classmethod
    def saturated(cls, full: Saturated) -> "IngressError":
        return cls(429, full.message, protocol.refusal_type(429, full.reason), full.reason,
                   {"Retry-After": str(full.retry_after_s)})

    @classmethod
    def of(cls, refusal: AdmissionDecision) -> "IngressError":
        """The server's answer to the same refusal (status, type, code, Retry-After)."""
        headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else {}
        return cls(refusal.status, refusal.message, protocol.refusal_type(refusal.status, refusal.reason),
                   refusal.reason, headers)

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.type, self.code), status_code=self.status,
                            headers=self.headers)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.forwards = Counter("kvserve_ray_forwards", "Requests sent to a replica, by outcome: answered "
                                "(its answer started), replica_gone (it died first: sent again elsewhere), "
                                "replica_full (its own admission answered 429).", ["outcome"], registry=r)
        self.retries = Counter("kvserve_ray_retries", "Re-sends to another replica, by what the first answered.",
                               ["reason"], registry=r)
        self.refusals = Counter("kvserve_ray_admission_rejections", "Refused at the ingress, by reason.",
                                ["reason"], registry=r)
        self.sleeping = Gauge("kvserve_ray_replicas_sleeping", "Replicas asleep in the warm pool.", registry=r)
        self.awake_target = Gauge("kvserve_ray_replicas_awake_target",
                                  "Replicas the warm pool keeps awake (fleet.autoscale.decide).", registry=r)
        self.replicas = Gauge("kvserve_ray_replicas", "Model replicas the ingress sees.", registry=r)
        self.startup = Gauge("kvserve_ray_replica_startup_seconds",
                             "Each replica's start-to-ready by phase (imports, weight_load, kv_allocation, warm_up, "
                             "process_start_to_ready: from its process's start) and its latest wake_up (s).",
                             ["replica", "phase"], registry=r)

    def refresh(self, views) -> None:
        self.replicas.set(len(views.views))
        self.sleeping.set(sum(1 for level in views.sleeping.values() if level))
        self.startup.clear()
        for replica, phases in views.startup_s.items():
            for phase, seconds in phases.items():
                self.startup.labels(replica, phase).set(seconds)


def _tokens_of(body: bytes) -> int | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage_tokens(usage if isinstance(usage, dict) else None)


class _AlreadyRead:
    """A body already read, as the replica's stream it came from (the relay
    reads it again; cancel is a no-op: the replica's call has ended)."""

    def __init__(self, body: bytes) -> None:
        self._chunks = [body] if body else []

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop()

    def cancel(self) -> None:
        pass


def _stream_usage(chunk: bytes) -> int | None:
    """Total tokens from a usage chunk (stream_options.include_usage)."""
    if b'"usage"' not in chunk:
        return None
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            total = _tokens_of(line[len(b"data: "):])
            if total is not None and math.isfinite(total):
                return total
    return None


# Ray pickles the ingress class by value when it is decorated, with the
# module's globals as they are then: everything it uses is defined above.
app = FastAPI(title="kvserve on Ray Serve")


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, model, config: dict) -> None:
        self.config = IngressConfig(**config)
        self.model = model.options(stream=True)
        self.quotas = FleetQuotas.from_keys_file(self.config.api_keys_path, self.config.retry_budget,
                                                 self.config.retry_budget_burst, time.monotonic)
        self.replicas = replica_views(self.config.deployment_name)
        self.views = self.replicas.views
        self.metrics = IngressMetrics()
        # The return slots its refused requests are told, staggered over the fleet's drain (as a gateway pool's).
        self.return_slots = ReturnSlots(time.monotonic)
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._warm_pool_task: asyncio.Task | None = None  # started by the first request, on the serving loop
        self._controls: dict[str, asyncio.Task] = {}  # the warm pool's call in flight to each replica

    # ---- routes ------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._guarded(self._create("completion", request))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._guarded(self._create("chat", request))

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._guarded(self._relay(request, b"", RouteRequest(), None))

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self, request: Request):
        """A replica's /ready, through the router: ready when one is."""
        return await self._guarded(self._relay(request, b"", RouteRequest(), None))

    @app.get("/metrics")
    async def prometheus(self):
        """The ingress's own series, then every replica's vllm:* series
        (labelled by replica) from its latest routing stats."""
        self.metrics.refresh(self.replicas)
        fleet = replica_series(self.replicas.series)
        return Response(generate_latest(self.metrics.registry) + fleet, media_type=CONTENT_TYPE_LATEST)

    # ---- replica control (handle calls, no route) ---------------------------
    async def replica_stopping(self, replica_id: str) -> bool:
        """Whether Ray took this model replica out of the running set it
        broadcasts to this ingress's router (it is stopping it: a scale-down,
        an upgrade; or it died). Each replica asks every stats period."""
        return self.replicas.is_stopping(replica_id)

    # ---- requests ----------------------------------------------------------
    async def _guarded(self, call) -> Response:
        if self.config.warm_pool is not None and self._warm_pool_task is None:
            self._warm_pool_task = asyncio.get_running_loop().create_task(self._run_warm_pool())
        try:
            return await call
        except IngressError as exc:
            return exc.response()

    async def _create(self, kind: str, request: Request) -> Response:
        tenant = self.quotas.authenticate(request.headers.get("authorization"))
        if tenant is None:
            raise IngressError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               "authentication_error", "invalid_api_key")
        raw = await request.body()
        inbound = read_inbound(kind, request.url.path, raw, tenant.priority, request.headers)
        max_tokens = inbound.requested_max_tokens or self.config.admission.default_max_tokens
        request_id = f"ray-{self._id_prefix}{next(self._ids):08x}"
        refusal = self.quotas.admit(request_id, tenant, inbound.num_prompt_tokens, max_tokens, inbound.is_retry)
        if refusal is None:
            refusal = self._wait_refusal(inbound.num_prompt_tokens + max_tokens, inbound.priority)
            if refusal is not None:
                self.quotas.on_finish(request_id)
        if refusal is not None:
            self.metrics.refusals.labels(str(refusal.reason)).inc()
            raise IngressError.of(refusal)
        key = None
        if self.config.router_policy == "prefix-affinity" and inbound.prompt_bytes:
            # Keyed by the model state it runs under (a LoRA adapter, or the base
            # model however the request names it).
            key = affinity_key(tenant.name, self.replicas.state_name(inbound.model),
                               inbound.prompt_bytes[:self.config.affinity_prefix_tokens * BYTES_PER_TOKEN])
        route = RouteRequest(inbound.num_prompt_tokens, max_tokens, key)
        try:
            return await self._relay(request, raw, route, request_id)
        except BaseException:
            self.quotas.on_finish(request_id)
            raise

    def _wait_refusal(self, num_tokens: int, priority: int) -> AdmissionDecision | None:
        limit_s = self.config.admission.max_wait_s(priority)
        return wait_refusal(self._eligible(), num_tokens, limit_s, self.return_slots)

    def _eligible(self, exclude: frozenset[str] = frozenset()) -> list:
        """The views of replicas that can take a request now (ready, awake)."""
        asleep = self.replicas.sleeping
        return [v for name, v in self.views.items() if v.ready and not asleep.get(name) and name not in exclude]

    async def _relay(self, request: Request, raw: bytes, route: RouteRequest, request_id: str | None) -> Response:
        forwarded = ForwardedRequest(request.method, request.url.path, raw, tuple(request.scope["headers"]),
                                     request.scope.get("query_string", b""), route)
        stream, start = await self._send_admitted(forwarded) if request_id is not None \
            else await self._send(forwarded)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                   if k.lower() not in (b"content-length", b"transfer-encoding")}
        media_type = headers.pop("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            return StreamingResponse(self._events(stream, request_id), status_code=start.status,
                                     headers=headers, media_type=media_type)
        try:
            body = b"".join([chunk async for chunk in stream])
        except _REPLICA_GONE:  # after its answer started: it cannot be sent again
            raise IngressError(502, "the replica serving this request failed", "unavailable",
                               "replica_failed") from None
        if request_id is not None:
            self.quotas.on_finish(request_id, _tokens_of(body))
        return Response(body, status_code=start.status, headers=headers, media_type=media_type)

    async def _send(self, forwarded: ForwardedRequest):
        """The replica's stream and its ResponseStart; sent again when the
        replica dies before its answer starts."""
        for attempt in range(MAX_ATTEMPTS):
            stream = self.model.handle_http.remote(forwarded)
            try:
                start = await stream.__anext__()
            except _REPLICA_GONE as exc:
                self.metrics.forwards.labels("replica_gone").inc()
                log.warning("a replica died before answering (%s); sending again (%d)", type(exc).__name__,
                            attempt + 1)
                continue
            except BaseException:
                stream.cancel()
                raise
            assert isinstance(start, ResponseStart)
            self.metrics.forwards.labels("replica_full" if start.status == 429 else "answered").inc()
            return stream, start
        raise IngressError(503, f"the replicas died under this request {MAX_ATTEMPTS} times", "unavailable",
                           "replica_failed")

    async def _send_admitted(self, forwarded: ForwardedRequest):
        """_send, and a replica's 429 (its own admission refused the request
        before starting it) sent to one other replica as the gateway does;
        a replica's 503 "shutting_down" (draining: it did not start it) sent
        to each other eligible replica in turn."""
        full = FullAnswers()
        while True:
            stream, start = await self._send(forwarded)
            if start.status not in (429, 503):
                return stream, start
            body = b"".join([chunk async for chunk in stream])
            replica = start.header(REPLICA_HEADER.decode())
            tried = forwarded.exclude | {replica or ""}
            if start.status == 503:
                if error_code(body) != DRAINING_CODE or replica is None or not self._eligible(tried):
                    return _AlreadyRead(body), start
                self.metrics.retries.labels("replica_draining").inc()
                forwarded = dataclasses.replace(forwarded, exclude=tried)
                continue
            full.record(retry_after_s(start.header("retry-after")), error_code(body))
            left = self._eligible(tried)
            if not full.may_try_another(len(left), self.quotas):
                saturated = full.saturated(left)
                self.metrics.refusals.labels(saturated.reason).inc()
                raise IngressError.saturated(saturated)
            self.metrics.retries.labels("replica_full").inc()
            forwarded = dataclasses.replace(forwarded, exclude=tried)

    async def _events(self, stream, request_id: str | None):
        num_tokens = None
        try:
            async for chunk in stream:
                num_tokens = _stream_usage(chunk) or num_tokens
                yield chunk
        except _REPLICA_GONE:
            error = protocol.error_body("the replica serving this stream failed", "unavailable", "replica_failed")
            yield f"data: {json.dumps(error)}\n\n".encode() + protocol.SSE_DONE.encode()
        finally:
            stream.cancel()  # a no-op when it ended; aborts the request on the replica when the client left
            if request_id is not None:
                self.quotas.on_finish(request_id, num_tokens)

    # ---- the warm pool -----------------------------------------------------
    async def _run_warm_pool(self) -> None:
        config = AutoscaleConfig(**self.config.warm_pool)
        state = ScaleState()
        while True:
            await asyncio.sleep(self.config.warm_pool_interval_s)
            try:
                state = await self._apply_warm_pool(config, state)
            except Exception:
                log.exception("warm pool step failed")

    async def _apply_warm_pool(self, config: AutoscaleConfig, state: ScaleState) -> ScaleState:
        """One step: decide over the replicas' own recorded signals (those the
        Ray policy reads), then wake or put to sleep; each call runs on its
        own (a sleep waits for the replica to be idle), one per replica."""
        # Sorted by name: the same replicas stay awake from one step to the next.
        names = sorted(n for n in self.views if n in self.replicas.signals)
        signals = [self.replicas.signals[n] for n in names]
        decision = decide(config, signals, state, time.monotonic())
        awake = [n for n, s in zip(names, signals) if not s.sleeping]
        asleep = [n for n, s in zip(names, signals) if s.sleeping]
        self.metrics.awake_target.set(decision.num_awake)
        for name in asleep[:max(0, decision.num_awake - len(awake))]:
            self._start_control(name, "/wake_up")
        for name in awake[decision.num_awake:]:
            self._start_control(name, "/sleep", b"level=1&if_idle=true")
        return decision.state

    def _start_control(self, replica: str, path: str, query: bytes = b"") -> None:
        pending = self._controls.get(replica)
        if pending is not None and not pending.done():
            return
        self._controls[replica] = asyncio.get_running_loop().create_task(self._control(replica, "POST", path, query))

    async def _control(self, replica: str, method: str, path: str, query: bytes = b"") -> None:
        """A control request to one named replica (the router sends a
        request that excludes every other)."""
        others = frozenset(n for n in self.views if n != replica)
        forwarded = ForwardedRequest(method, path, b"", (), query, RouteRequest(), others)
        stream = self.model.handle_http.remote(forwarded)
        start = await stream.__anext__()
        async for _ in stream:
            pass
        log.info("warm pool: %s %s -> %s (%d)", path, query.decode(), replica, start.status)
