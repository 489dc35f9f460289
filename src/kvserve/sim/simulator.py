"""Discrete-event simulation of kvserve replicas driving the REAL scheduler
and admission code on a virtual clock.

Nothing of the policy is re-implemented here: each replica (sim/replica.py)
is a `scheduler.Scheduler` plus an `admission.AdmissionLoop`, handed its
`VirtualClock`, and a cost model stands in for the torch runner. The event
loop moves time forward and hands each event to its replica:

    arrival   -> a fleet's front door (fleet/door.py, as the gateway's:
                 429 when no ready replica could start it in time) ->
                 router picks a ready replica -> the replica's admission
                 decides -> scheduler.add_request (or its 429: the door
                 tries one other replica within the retry budget; else
                 a rejected record)
    step      -> the replica's step ends: scheduler.update() at that time
                 with a fixed sampled token, then its next step starts
    cancel    -> scheduler.abort() (the client's cancel_after_s)
    lose      -> a failure scenario (sim/failures.py): the replica stops being
                 ready; its requests not yet streaming are routed again,
                 the others end as lost (a broken stream)
    slow      -> a failure scenario: the replica's steps take k x as long
    autoscale -> fleet.autoscale.decide on what the replicas would record:
                 wake a sleeping one, start a cold one, or let one drain

A replica fast-forwards steady decode batches (multi-step decode runs) with
the same results as single steps, applying a run's steps when the
simulation next looks at it (`Replica.catch_up`). The cyclic garbage
collector is paused while the simulation runs (it makes no cycles).

Sampled tokens are a fixed non-EOS id and requests run with ignore_eos and
max_tokens = the workload's output length, so output lengths follow the
workload exactly. Every request ends as a `bench.report.RequestRecord`, so
`kvserve simulate` writes the same report.json as `kvserve bench`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvserve.admission.decision import AdmissionDecision, Reason
from kvserve.admission.retry_after import ReturnSlots
from kvserve.admission.tenants import DEFAULT_TENANT, Tenant, TenantDirectory
from kvserve.bench.report import RequestRecord
from kvserve.bench.workload import RequestSpec
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request, RequestFactory, SamplingParams
from kvserve.fleet.autoscale import ReplicaSignals, ScaleState, decide
from kvserve.fleet.autoscale import AutoscaleConfig as FleetAutoscaleConfig
from kvserve.fleet.backend_state import expected_wait_s, snapshot
from kvserve.fleet.door import FleetQuotas, FullAnswers, wait_refusal
from kvserve.fleet.router import Router, RouterConfig, RouteRequest, affinity_key
from kvserve.gc_pause import cyclic_gc_paused
from kvserve.sim.clock import VirtualClock
from kvserve.sim.cost_model import CostModel
from kvserve.sim.failures import ReplicaLoss, ReplicaSlowdown, check_failures
from kvserve.sim.replica import SIM_EOS_TOKEN_ID, SIM_TOKEN_ID, Replica, ReplicaHost
from kvserve.sim.speculation import SimSpeculation

__all__ = ["SIM_EOS_TOKEN_ID", "SIM_TOKEN_ID", "AutoscaleConfig", "SimConfig", "SimResult", "Simulator",
           "VirtualClock", "synth_prompt"]

_STEP_DONE: Final = 0
_CANCEL: Final = 1
_AUTOSCALE: Final = 2
_LOSE: Final = 3
_SLOW: Final = 4
# What the gateway answers when no backend is ready (503, its error code).
NO_BACKEND: Final = "no_backend"
# The gateway's error event when the backend serving a stream goes away,
# and its 502 when every backend a request was sent to failed.
STREAM_BROKEN: Final = "the backend serving this stream failed; the output is incomplete"
ALL_FAILED: Final = "every backend failed this request"


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaling of the simulated fleet by the one policy
    (fleet.autoscale.decide with `fleet`, the config kvserve ray's policy
    takes: its targets, look-back, scale-down delay and max_replicas; its
    min_replicas is the simulation's own, below), checked every
    `interval_s` on what each ready replica would record (its queue-wait
    p95 over the look-back, the expected wait of a new request, KV usage,
    asleep or not). A new replica serves after `cold_start_s` (loading
    weights, warming up). `warm_pool` replicas beyond the initial ones are
    held from the start, asleep: one the policy wakes serves after
    `warm_start_s` (its wake-up), and awake replicas the policy no longer
    needs go back to sleep once idle. Without a warm pool, a replica the
    policy lets go drains (no new requests, its own finish) and leaves."""

    fleet: FleetAutoscaleConfig
    interval_s: float = 10.0
    cold_start_s: float = 60.0
    warm_pool: int = 0
    warm_start_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.cold_start_s >= 0:
            raise ValueError("autoscale needs interval_s > 0 and cold_start_s >= 0")
        if self.warm_pool < 0 or not self.warm_start_s >= 0:
            raise ValueError("warm_pool and warm_start_s must be >= 0")

    def policy(self, num_replicas: int) -> FleetAutoscaleConfig:
        """The policy's config for a fleet that starts with `num_replicas`
        awake: those and the warm pool are always held."""
        held = num_replicas + self.warm_pool
        return replace(self.fleet, min_replicas=held, max_replicas=max(held, self.fleet.max_replicas))


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. admission None = every request goes straight
    to the scheduler (the "no admission control" baseline).

    exact_token_events: keep one event per token (exact ITL percentiles).
    False keeps (first, last) per request, which keeps TTFT / TPOT / E2E
    exact and memory flat for hour-long runs, but flattens ITL.
    record_trace: log every scheduler / admission call per replica, to
    replay them against a fresh scheduler (tests). A decode run logs the
    schedule / update pairs of the single steps it stands for. It also logs
    each routing decision with the backend states it was made from.
    router: a `fleet.router` policy name; router_config (when given) the
    whole routing configuration, as the gateway takes it.
    fast_forward: run steady decode batches as multi-step `DecodeRun`s
    (same results; False for checking that).
    frontend_latency_s: what a client sees beyond the engine (HTTP,
    request parsing, streaming out): a request reaches the engine this long
    after its client sent it, and its record counts from the send, as
    `kvserve bench` measures. `kvserve bench`'s TTFT minus the server's
    own (vllm:time_to_first_token_seconds) measures it.
    speculation: speculative decoding at a given acceptance rate and
    proposer cost (sim/speculation.py); single steps only.
    losses, slowdowns: failure scenarios (sim/failures.py) of the replicas
    the simulation starts with.
    front_door: run the fleet's front door (fleet/door.py) before routing,
    as `kvserve gateway` and the Ray ingress do: a request no ready replica
    could start within its class's queue-wait limit is refused there, and a
    replica's 429 is tried on one other replica within the retry budget.
    The door takes the replicas' AdmissionConfig (its queue-wait limits and
    retry budget). None: on for a fleet (more than one replica, or
    autoscaling), off for one replica (`kvserve serve` alone); never
    without admission.
    warm_up: each replica runs the server's measured warm-up
    (admission/warm_up.py) before it serves, its steps priced by the cost
    model, so its admission starts with the step-time fit a live server
    starts with (`kvserve serve` warms up by default). False: replicas
    start cold, admitting their first burst on guesses.
    """

    scheduler: SchedulerConfig
    cache: CacheConfig
    admission: AdmissionConfig | None = field(default_factory=AdmissionConfig)
    num_replicas: int = 1
    router: str = "least-queue"
    router_config: RouterConfig | None = None
    autoscale: AutoscaleConfig | None = None
    exact_token_events: bool = True
    record_trace: bool = False
    cache_namespace: str = "sim"
    fast_forward: bool = True
    frontend_latency_s: float = 0.0
    speculation: SimSpeculation | None = None
    losses: tuple[ReplicaLoss, ...] = ()
    slowdowns: tuple[ReplicaSlowdown, ...] = ()
    front_door: bool | None = None
    warm_up: bool = True

    def __post_init__(self) -> None:
        if not self.frontend_latency_s >= 0:
            raise ValueError(f"frontend_latency_s must be >= 0, got {self.frontend_latency_s}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self.routing()  # validates the name
        check_failures(self.losses, self.slowdowns, self.num_replicas)

    def routing(self) -> RouterConfig:
        return self.router_config or RouterConfig(policy=self.router)

    def has_front_door(self) -> bool:
        if self.admission is None:
            return False
        if self.front_door is not None:
            return self.front_door
        return self.num_replicas > 1 or self.autoscale is not None


@dataclass
class _Live:
    spec: RequestSpec
    replica: Replica
    request: Request
    sent_s: float  # the client's send, which its record counts from (a reroute keeps it)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # virtual seconds from 0 to the last event
    replicas: list[dict]
    replica_timeline: list[tuple[float, int]]  # (time, replicas awake or starting)
    num_steps: int
    traces: list[list[tuple]] | None = None
    num_decode_runs: int = 0  # the fast path's share: see Replica
    num_joined_steps: int = 0
    # With record_trace: (RouteRequest, [BackendState of each ready replica], RouteDecision).
    route_trace: list[tuple] | None = None
    # Each autoscaling check: (time, [ReplicaSignals of the ready replicas], replicas starting,
    # ScaleState before, ScaleDecision): what fleet.autoscale.decide was given and answered.
    scale_trace: list[tuple] = field(default_factory=list)
    # Requests a lost replica had not started streaming, sent to another one.
    num_rerouted: int = 0
    # The front door's work (SimConfig.front_door): refused before any
    # replica was asked, and replicas' 429s tried on another replica.
    num_door_refused: int = 0
    num_door_resent: int = 0


def synth_prompt(spec: RequestSpec) -> list[int]:
    """Token ids for a spec: a group's shared prefix (identical across the
    group, so prefix caching hits), then tokens unique to this request.
    Ids fit 32 bits (the block hash encodes them so)."""
    group = spec.prefix_group
    prefix: list[int] = []
    if group is not None:
        prefix = [1_000_000 + group.group_id] + [5] * (group.prefix_tokens - 1)
    rest = spec.prompt_tokens - len(prefix)
    if rest <= 0:
        return prefix[:spec.prompt_tokens]
    # The first own token is unique per request; chained block hashes make
    # every later block unique too.
    return prefix + [2**31 + spec.index % 2**31] + [7] * (rest - 1)


class Simulator(ReplicaHost):
    def __init__(self, config: SimConfig, cost_model: CostModel) -> None:
        self.config = config
        self.cost_model = cost_model
        self.clock = VirtualClock()
        self.router = Router(config.routing())
        self._route_trace: list[tuple] | None = [] if config.record_trace else None
        self.replicas = [self._new_replica(i, VirtualClock(), 0.0) for i in range(config.num_replicas)]
        self.timeline: list[tuple[float, int]] = [(0.0, config.num_replicas)]
        # (time, sequence, kind, payload): the payload's type depends on the kind.
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._live: dict[str, _Live] = {}
        self._records: list[RequestRecord] = []
        self._requests = RequestFactory((SIM_EOS_TOKEN_ID,), config.cache_namespace, self.clock)
        self._scale_state = ScaleState()
        self._scale_trace: list[tuple] = []
        if config.autoscale is not None:
            self._scale_policy = config.autoscale.policy(config.num_replicas)
            for i in range(config.num_replicas, config.num_replicas + config.autoscale.warm_pool):
                pooled = self._new_replica(i, VirtualClock(), 0.0)
                pooled.sleeping = True
                self.replicas.append(pooled)
        for slowdown in config.slowdowns:  # slow throughout: from the start, no event
            if slowdown.from_s == 0:
                self.replicas[slowdown.index].slow_down(slowdown.factor)
        self._all_routable = not any(r.sleeping for r in self.replicas)  # none asleep, retired or lost
        self._num_rerouted = 0
        # Built once per distinct value, not per arrival: SamplingParams are
        # immutable (validated once).
        self._sampling_params: dict[int, SamplingParams] = {}
        self._all_ready_s = 0.0  # every replica serves from this time on
        # The fleet's front door, on the simulation's clock (one tenant: the
        # simulated workload's tenants have no limits of their own).
        self._door: FleetQuotas | None = None
        if config.has_front_door():
            admission = config.admission
            assert admission is not None  # has_front_door
            self._door = FleetQuotas(TenantDirectory(), admission.retry_budget, admission.retry_budget_burst,
                                     self.clock)
        self._door_tenant = Tenant(DEFAULT_TENANT)
        self._return_slots = ReturnSlots(self.clock)
        self._num_door_refused = 0
        self._num_door_resent = 0

    def _new_replica(self, index: int, clock: VirtualClock, ready_s: float) -> Replica:
        config = self.config
        # Each replica its own machine: its own jitter draws and speed drift.
        for_replica = getattr(self.cost_model, "for_replica", None)
        cost_model = for_replica(index) if for_replica is not None else self.cost_model
        return Replica(index, config.scheduler, config.cache, config.admission, cost_model, self, clock,
                       ready_s, self.clock, fast_forward=config.fast_forward, record_trace=config.record_trace,
                       look_back_s=config.autoscale.fleet.look_back_s if config.autoscale is not None else 10.0,
                       speculation=config.speculation, warm_up=config.warm_up)

    # -- the loop ----------------------------------------------------------
    def run(self, specs: list[RequestSpec], offsets_s: list[float]) -> SimResult:
        """Simulate `specs` arriving at `offsets_s` (seconds, non-decreasing)
        until every request has ended. A Simulator runs once: its replicas
        keep their state (caches, measured drain rates) afterwards."""
        if self._seq or self._records:
            raise RuntimeError("a Simulator runs once; build a new one for another run")
        if len(specs) != len(offsets_s):
            raise ValueError(f"{len(specs)} specs but {len(offsets_s)} arrival offsets")
        if any(b < a for a, b in zip(offsets_s, offsets_s[1:])):
            raise ValueError("arrival offsets must be non-decreasing")
        if self.config.autoscale is not None and specs:
            self._push(self.config.autoscale.interval_s, _AUTOSCALE, None)
        for loss in self.config.losses:
            self._push(loss.at_s, _LOSE, loss)
        for slowdown in self.config.slowdowns:
            if slowdown.from_s > 0:
                self._push(slowdown.from_s, _SLOW, slowdown)
        if self.config.frontend_latency_s:  # the engine sees each request that much later
            offsets_s = [t + self.config.frontend_latency_s for t in offsets_s]
        # The loop makes no reference cycles (reference counting frees
        # everything), but allocates millions of objects: the cyclic
        # collector's passes over the growing live set (records, caches)
        # would cost time for nothing.
        with cyclic_gc_paused():
            self._loop(specs, offsets_s)
        return SimResult(sorted(self._records, key=lambda r: r.index), self.clock.now_s,
                         [r.stats() for r in self.replicas], self.timeline,
                         sum(r.num_steps for r in self.replicas),
                         [r.trace for r in self.replicas if r.trace is not None]
                         if self.config.record_trace else None,
                         sum(r.num_decode_runs for r in self.replicas),
                         sum(r.num_joined_steps for r in self.replicas), self._route_trace,
                         scale_trace=self._scale_trace, num_rerouted=self._num_rerouted,
                         num_door_refused=self._num_door_refused, num_door_resent=self._num_door_resent)

    def _loop(self, specs: list[RequestSpec], offsets_s: list[float]) -> None:
        next_arrival = 0
        while next_arrival < len(specs) or self._events:
            arrival_s = offsets_s[next_arrival] if next_arrival < len(specs) else math.inf
            event_s = self._events[0][0] if self._events else math.inf
            if arrival_s <= event_s:
                self.clock.advance_to(arrival_s)
                self._arrive(specs[next_arrival])
                next_arrival += 1
                continue
            _, _, kind, payload = heapq.heappop(self._events)
            if kind == _STEP_DONE and payload[1] != payload[0].step_event_id:
                continue  # a decode run that ended early (or a lost replica's step)
            if (kind == _LOSE or kind == _SLOW) and next_arrival == len(specs) and not self._live:
                continue  # a failure after the last request ended changes nothing
            self.clock.advance_to(event_s)
            self._handle(kind, payload, more_arrivals=next_arrival < len(specs))

    def push_step_done(self, replica: Replica, t_s: float) -> None:
        replica.step_event_id += 1
        self._push(t_s, _STEP_DONE, (replica, replica.step_event_id))

    def _push(self, t_s: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t_s, self._seq, kind, payload))

    def _handle(self, kind: int, payload: Any, more_arrivals: bool) -> None:
        if kind == _STEP_DONE:
            payload[0].on_step_done()
        elif kind == _CANCEL:
            self._cancel(payload)
        elif kind == _AUTOSCALE:
            self._autoscale(more_arrivals)
        elif kind == _LOSE:
            self._lose(payload)
        elif kind == _SLOW:
            self._slow(payload)

    # -- arrivals ----------------------------------------------------------
    def _arrive(self, spec: RequestSpec) -> None:
        self._send(spec, self.clock.now_s - self.config.frontend_latency_s, True)

    def _send(self, spec: RequestSpec, sent_s: float, first: bool) -> None:
        """The request reaches the fleet now (its first send, or a reroute
        from a lost one): the front door (a fleet's), routed, then the
        replica's admission; a replica's 429 may be tried on one other."""
        now = self.clock.now_s
        # The router reads every ready replica's load as of now; only the
        # chosen one's decode run needs its steps applied.
        ready = self.replicas if self._all_routable and now >= self._all_ready_s else self._routable(now)
        if not ready:  # the gateway's 503 for a new request, its 502 for one whose backend failed
            if first:
                self._reject(spec, 503, NO_BACKEND, "no replica is ready", sent_s)
            else:
                self._lost(spec, sent_s, None, 502, ALL_FAILED)
            return
        door = self._door
        if door is not None and first:
            refusal = self._door_refusal(door, spec, ready)
            if refusal is not None:
                self._num_door_refused += 1
                self._reject(spec, refusal.status, refusal.reason, refusal.message, sent_s)
                return
        prompt = synth_prompt(spec)
        full: FullAnswers | None = None
        while True:
            replica = self._route(ready, spec, prompt)
            replica.num_routed += 1
            replica.catch_up()
            replica.clock.advance_to(now)
            replica.drain.observe(now, replica.num_finished, True)
            request = self._requests.build(prompt, self._params(spec.output_tokens),
                                           request_id=f"r{spec.index}", arrival_time=now, priority=spec.priority,
                                           tenant=spec.tenant)
            refusal = replica.add(request)
            if refusal is None:
                break
            if door is not None and refusal.status == 429:
                # The gateway's rule for a backend's own 429 (not started):
                # one other replica, within the fleet's retry budget.
                full = full if full is not None else FullAnswers()
                full.record(refusal.retry_after_s, refusal.reason)
                ready = [r for r in ready if r is not replica]
                if full.may_try_another(len(ready), door):
                    self._num_door_resent += 1
                    continue
            self._door_finish(spec)
            self._reject(spec, refusal.status, refusal.reason, refusal.message, sent_s)
            return
        self._live[request.request_id] = _Live(spec, replica, request, sent_s)
        if first and spec.cancel_after_s is not None:
            self._push(now + spec.cancel_after_s, _CANCEL, request.request_id)
        replica.start_if_idle()

    def _door_refusal(self, door: FleetQuotas, spec: RequestSpec, ready: list[Replica]) -> AdmissionDecision | None:
        """The front door's decision on a new request (gateway/service.py's
        order): the fleet's quotas and retry budget, then 429 when no ready
        replica could start it within its class's queue-wait limit."""
        refusal = door.admit(f"r{spec.index}", self._door_tenant, spec.prompt_tokens, spec.output_tokens, False)
        if refusal is not None:
            return refusal
        for r in ready:  # the door reads every replica's waits and KV as of now
            r.catch_up()
        admission = self.config.admission
        assert admission is not None  # a door runs only with admission
        refusal = wait_refusal(ready, spec.prompt_tokens + spec.output_tokens, admission.max_wait_s(spec.priority),
                               self._return_slots)
        if refusal is not None:
            door.on_finish(f"r{spec.index}")
        return refusal

    def _door_finish(self, spec: RequestSpec) -> None:
        if self._door is not None:
            self._door.on_finish(f"r{spec.index}")

    def _route(self, ready: list[Replica], spec: RequestSpec, prompt: list[int]) -> Replica:
        """The gateway's routing policy over the ready replicas. Policies that
        read KV usage and waits see every replica as of now (decode runs
        applied); the others read only the load, which a run answers as of
        now without applying its steps."""
        router = self.router
        key = None
        if router.policy == "prefix-affinity":
            num_tokens = min(len(prompt), router.config.affinity_prefix_tokens)
            # Every simulated request runs under the one model its replicas' cache namespace names.
            key = affinity_key(spec.tenant, self.config.cache_namespace,
                               b"".join(t.to_bytes(4, "little") for t in prompt[:num_tokens]))
        if router.reads_kv:
            for r in ready:
                r.catch_up()
        request = RouteRequest(spec.prompt_tokens, spec.output_tokens, key)
        decision = router.pick(ready, request)
        if self._route_trace is not None:
            self._route_trace.append((request, [snapshot(r) for r in ready], decision))
        return ready[decision.position]

    def _params(self, max_tokens: int) -> SamplingParams:
        params = self._sampling_params.get(max_tokens)
        if params is None:
            params = self._sampling_params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return params

    def _reject(self, spec: RequestSpec, status: int, reason: str | None, message: str, sent: float) -> None:
        now = self.clock.now_s
        self._records.append(RequestRecord(
            index=spec.index, outcome="rejected", scheduled_s=sent, sent_s=sent, end_s=now,
            status_code=status, reject_reason=None if reason is None else str(reason), tenant=spec.tenant,
            priority=spec.priority, prompt_tokens=spec.prompt_tokens, expected_output_tokens=spec.output_tokens,
            last_sent_s=sent, error=message or None))

    # -- ends ----------------------------------------------------------------
    def _cancel(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is None:
            return  # already ended
        live.replica.catch_up()
        if rid not in self._live:
            return  # it finished in a step of the run before now
        live.replica.abort(rid)
        self.end(rid, "cancelled", None, None)

    def end(self, request_id: str, outcome: str, status: int | None, reason: Reason | None) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        replica, request, spec = live.replica, live.request, live.spec
        self._door_finish(spec)
        replica.num_finished += 1
        scheduler = replica.scheduler
        replica.drain.observe(replica.clock.now_s, replica.num_finished,
                              bool(len(scheduler.running) or len(scheduler.waiting)))
        if replica.admission is not None:
            replica.admission.on_finished(request_id, request.num_tokens)
        stamps = request.timestamps
        queue_s = None if stamps.scheduled is None else stamps.scheduled - stamps.arrival
        if queue_s is not None:  # recorded at the finish, as a server's queue-time histogram is
            replica.queue_waits.observe(replica.clock.now_s, queue_s)
        sent = live.sent_s
        self._records.append(RequestRecord(
            index=spec.index, outcome=outcome, scheduled_s=sent, sent_s=sent,
            headers_s=stamps.arrival, token_events=self._token_events(stamps.token_times),
            end_s=replica.clock.now_s, status_code=status, reject_reason=None if reason is None else str(reason),
            tenant=spec.tenant,
            priority=spec.priority, prompt_tokens=spec.prompt_tokens,
            output_tokens=request.num_output_tokens, expected_output_tokens=spec.output_tokens,
            last_sent_s=sent, queue_s=queue_s))

    def _token_events(self, token_times: list[float]) -> tuple[tuple[float, int], ...]:
        if self.config.exact_token_events or len(token_times) < 3:
            return tuple((t, 1) for t in token_times)
        return ((token_times[0], 1), (token_times[-1], len(token_times) - 1))

    # -- failure scenarios -------------------------------------------------
    def _lose(self, loss: ReplicaLoss) -> None:
        """The replica goes away, as the gateway sees a backend die: it stops
        being ready (routed nothing, counted gone by the autoscaler). Its
        requests that have not streamed a token fail before any answer and
        go to another ready replica (the gateway's retry of a failed
        backend); the ones streaming end with its error event (lost)."""
        replica = self.replicas[loss.index]
        if replica.lost_at_s is not None:
            return
        replica.catch_up()  # what it finished before now stays finished
        replica.lose()
        self._all_routable = False
        self._mark_timeline(self.clock.now_s)
        for live in [live for live in self._live.values() if live.replica is replica]:
            del self._live[live.request.request_id]
            if live.request.num_output_tokens:
                self._lost(live.spec, live.sent_s, live.request, 500, STREAM_BROKEN)
            else:
                self._num_rerouted += 1
                self._send(live.spec, live.sent_s, False)

    def _lost(self, spec: RequestSpec, sent_s: float, request: Request | None, status: int, message: str) -> None:
        """A request the failure ended (outcome error): with the tokens it had
        streamed, if any."""
        self._door_finish(spec)
        tokens = () if request is None else self._token_events(request.timestamps.token_times)
        self._records.append(RequestRecord(
            index=spec.index, outcome="error", scheduled_s=sent_s, sent_s=sent_s,
            headers_s=None if request is None else request.timestamps.arrival, token_events=tokens,
            end_s=self.clock.now_s, status_code=status, tenant=spec.tenant, priority=spec.priority,
            prompt_tokens=spec.prompt_tokens, output_tokens=0 if request is None else request.num_output_tokens,
            expected_output_tokens=spec.output_tokens, last_sent_s=sent_s, error=message))

    def _slow(self, slowdown: ReplicaSlowdown) -> None:
        replica = self.replicas[slowdown.index]
        if replica.lost_at_s is None:
            replica.slow_down(slowdown.factor)

    # -- autoscaling -------------------------------------------------------
    def _routable(self, now_s: float) -> list[Replica]:
        return [r for r in self.replicas
                if r.ready_s <= now_s and not r.sleeping and not r.retired and r.lost_at_s is None]

    def _mark_timeline(self, now_s: float) -> None:
        """(now, replicas awake or starting) on the timeline, when it changed."""
        serving = sum(1 for r in self.replicas if not r.sleeping and not r.retired and r.lost_at_s is None)
        if serving != self.timeline[-1][1]:
            self.timeline.append((now_s, serving))

    def _autoscale(self, more_arrivals: bool) -> None:
        """fleet.autoscale.decide on what the ready replicas would record,
        then its answer applied: wake, sleep, start, or let one go."""
        rule = self.config.autoscale
        assert rule is not None  # the event is pushed only with autoscaling on
        now = self.clock.now_s
        held = [r for r in self.replicas if not r.retired and r.lost_at_s is None]
        ready = [r for r in held if r.ready_s <= now]
        for r in ready:
            r.catch_up()
        signals = [ReplicaSignals(r.queue_waits.p95_s(now), expected_wait_s(r), r.kv_usage, r.sleeping)
                   for r in ready]
        num_starting = len(held) - len(ready)
        decision = decide(self._scale_policy, signals, self._scale_state, now, num_starting)
        self._scale_trace.append((now, signals, num_starting, self._scale_state, decision))
        self._scale_state = decision.state
        self._apply_scale(rule, decision.num_replicas, decision.num_awake, ready, len(held), now)
        if more_arrivals or self._live:
            self._push(now + rule.interval_s, _AUTOSCALE, None)

    def _apply_scale(self, rule: AutoscaleConfig, num_replicas: int, num_awake: int, ready: list[Replica],
                     num_held: int, now: float) -> None:
        awake = [r for r in ready if not r.sleeping]
        asleep = [r for r in ready if r.sleeping]
        for r in asleep[:max(0, num_awake - len(awake))]:  # woken before any new one starts
            r.sleeping, r.ready_s = False, now + rule.warm_start_s
            self._all_ready_s = max(self._all_ready_s, r.ready_s)
        if rule.warm_pool:  # the pool's extra replicas sleep again, once idle
            for r in awake[num_awake:]:
                if r.load == 0:
                    r.sleeping = True
        for _ in range(num_replicas - num_held):
            self.replicas.append(self._new_replica(len(self.replicas), VirtualClock(now), now + rule.cold_start_s))
            self._all_ready_s = max(self._all_ready_s, now + rule.cold_start_s)
        if num_replicas < num_held:  # drain one: an idle sleeper first, else the least loaded
            leaving = min(ready, key=lambda r: (not r.sleeping, r.load))
            leaving.retired = True
        self._all_routable = not any(r.sleeping or r.retired or r.lost_at_s is not None for r in self.replicas)
        self._mark_timeline(now)
