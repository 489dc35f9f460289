"""Discrete-event simulation of kvserve replicas driving the REAL scheduler
and admission controller on a virtual clock.

Nothing of the policy is re-implemented here: each replica is a
`scheduler.Scheduler` plus an `admission.AdmissionController`, both handed
the `VirtualClock`, and a cost model stands in for the torch runner. The
event loop is the engine's step (schedule -> execute -> update) with
"execute" replaced by advancing the clock by the cost model's step time:

    arrival   -> router picks a ready replica -> admission check/admit ->
                 scheduler.add_request (or a rejected record)
    step      -> scheduler.schedule() at t; the step ends at t + step_time;
                 scheduler.update() at that time with a fixed sampled token
    cancel    -> scheduler.abort() (the client's cancel_after_s)
    autoscale -> maybe add a replica, ready after a cold start

Fast forward (multi-step decode): when a replica's batch is a steady pure
decode, the real scheduler plans a `DecodeRun` of several steps and the
replica applies them lazily, each at the time it would have run, whenever
the simulation next changes or inspects that replica (an arrival routed to
it, a cancel, an autoscale check, the run's end); the router's load read
counts the run's finishes before now without applying its steps. A
request added to the replica cuts the run after its in-flight step; the
step after starts it beside the run's decodes as one more step of the run
(its chunk through the ordinary update()), and the run then goes on with
it when the batch is steady again, else ends. A cancel ends the run at
once, handing the in-flight step to the ordinary update(). Step end times
are computed a stretch at a time, as most runs are cut early. Each replica
reads its own clock, so a step applied late still sees its own time.
Timestamps, outcomes, preemptions and admission decisions are those of
single steps (tests/test_sim_fast_forward.py). The cyclic garbage
collector is paused while the simulation runs (it makes no cycles).

Sampled tokens are a fixed non-EOS id and requests run with ignore_eos and
max_tokens = the workload's output length, so output lengths follow the
workload exactly. Every request ends as a `bench.report.RequestRecord`, so
`kvserve simulate` writes the same report.json as `kvserve bench`.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Final

from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionRequest, Reason
from kvserve.bench.report import RequestRecord
from kvserve.bench.workload import RequestSpec
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.gc_pause import cyclic_gc_paused
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput
from kvserve.sim.cost_model import CostModel, StepShape, chunk_shape, decode_step_ends_s
from kvserve.sim.fast_forward import DecodeRun, plan_decode_run
from kvserve.sim.router import Router

# Constants are Final: the compiled core (kvserve/compiled) inlines them
# instead of looking them up in the module's dict at every use.
#
# The token every simulated step "samples": any id that is not EOS works,
# since requests run with ignore_eos.
SIM_TOKEN_ID: Final = 1
SIM_EOS_TOKEN_ID: Final = 0
_STEP_DONE: Final = 0
_CANCEL: Final = 1
_AUTOSCALE: Final = 2
# Decode run lengths: a run ended early (the next arrival at its replica)
# wastes the planning of its remaining steps, one ended by its length costs
# a new plan of the whole batch (far more than a step). Each replica plans
# about three times the mean of the steps its runs used (a moving average:
# the gaps between arrivals vary too much to follow the last one) and times
# them (a cost-model call per step) a stretch of about three quarters of
# that mean at a time, within these bounds.
MIN_RUN_STEPS: Final = 8
MAX_RUN_STEPS: Final = 512
RUN_LENGTH_DECAY: Final = 0.8


class VirtualClock:
    """The simulation's time in seconds; the event loop moves it forward.
    Called like `time.monotonic` by the scheduler and admission controller."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, t_s: float) -> None:
        if t_s < self.now_s:
            raise ValueError(f"virtual time cannot go back: {t_s} < {self.now_s}")
        self.now_s = t_s


@dataclass(frozen=True)
class AutoscaleConfig:
    """A simple scale-out rule, checked every `interval_s`: add a replica when
    the ready ones average KV usage above `scale_up_kv_usage`, or more than
    `scale_up_waiting_per_replica` waiting requests, or rejected any request
    since the last check. A new replica serves after `cold_start_s` (loading
    weights, warming up) unless one of `warm_pool` pre-started replicas is
    left, which serves after `warm_start_s`."""

    max_replicas: int
    interval_s: float = 10.0
    cold_start_s: float = 60.0
    warm_pool: int = 0
    warm_start_s: float = 0.0
    scale_up_kv_usage: float = 0.8
    scale_up_waiting_per_replica: float = 4.0

    def __post_init__(self) -> None:
        if self.max_replicas < 1 or self.interval_s <= 0 or self.cold_start_s < 0:
            raise ValueError("autoscale needs max_replicas >= 1, interval_s > 0, cold_start_s >= 0")
        if self.warm_pool < 0 or self.warm_start_s < 0:
            raise ValueError("warm_pool and warm_start_s must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. admission None = every request goes straight
    to the scheduler (the "no admission control" baseline).

    exact_token_events: keep one event per token (exact ITL percentiles).
    False keeps (first, last) per request, which keeps TTFT / TPOT / E2E
    exact and memory flat for hour-long runs, but flattens ITL.
    record_trace: log every scheduler / admission call per replica, to
    replay them against a fresh scheduler (tests). A decode run logs the
    schedule / update pairs of the single steps it stands for.
    fast_forward: run steady decode batches as multi-step `DecodeRun`s
    (same results; False for checking that).
    frontend_latency_s: what a client sees beyond the engine (HTTP,
    request parsing, streaming out): a request reaches the engine this long
    after its client sent it, and its record counts from the send, as
    `kvserve bench` measures. `kvserve bench`'s TTFT minus the server's
    own (vllm:time_to_first_token_seconds) measures it.
    """

    scheduler: SchedulerConfig
    cache: CacheConfig
    admission: AdmissionConfig | None = field(default_factory=AdmissionConfig)
    num_replicas: int = 1
    router: str = "least-queue"
    autoscale: AutoscaleConfig | None = None
    exact_token_events: bool = True
    record_trace: bool = False
    cache_namespace: str = "sim"
    fast_forward: bool = True
    frontend_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.frontend_latency_s >= 0:
            raise ValueError(f"frontend_latency_s must be >= 0, got {self.frontend_latency_s}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        Router(self.router)  # validates the name


class Replica:
    """One simulated server: the real scheduler and admission controller."""

    def __init__(self, index: int, config: SimConfig, clock: VirtualClock, ready_s: float,
                 sim_clock: VirtualClock) -> None:
        self.index = index
        self.ready_s = ready_s
        # Its own clock: a decode run's steps are applied when the simulation
        # next looks at this replica, each at its own (earlier) time.
        self.clock = clock
        self.sim_clock = sim_clock  # the simulation's now, which `load` answers for
        self.scheduler = Scheduler(config.scheduler, config.cache, clock)
        self.trace: list[tuple] | None = [] if config.record_trace else None
        # An AdmissionController, or a _Recorded one forwarding to it when
        # tracing: Any, since the wrapper forwards by __getattr__.
        self.admission: Any = None if config.admission is None else AdmissionController(
            config.admission, config.cache.num_blocks, config.cache.block_size,
            config.scheduler.max_num_seqs, clock)
        if self.admission is not None and self.trace is not None:
            self.admission = _Recorded(self.admission, clock, self.trace)
        self.in_flight: SchedulerOutput | None = None
        self.in_flight_shape: StepShape | None = None  # chunk_shape of in_flight
        self.step_started_s = 0.0
        self.run: DecodeRun | None = None  # while a decode run is in flight
        self.run_started_s = 0.0
        self.run_end_times: list[float] = []
        self.run_next_update = 0  # steps of the run updated so far
        self.run_first_step = 0  # where the run last started or took in new requests
        self.run_last_step = 0  # the run ends after updating this step
        self.run_steps_planned = MIN_RUN_STEPS
        self.run_steps_timed = MIN_RUN_STEPS  # steps of a run timed at once
        # Decayed sums of the steps runs used and of the runs an event ended
        # (the rest ran out of steps: their gap to the next event was longer).
        self.run_steps_used = float(MIN_RUN_STEPS)
        self.runs_ended_by_events = 1.0
        # Bumped per step event pushed, so the event of a run ended early is ignored.
        self.step_event_id = 0
        self.started_ids: set[str] = set()
        self.num_steps = 0
        self.busy_s = 0.0
        # How much of the work the fast path took (results never depend on it).
        self.num_decode_runs = 0  # multi-step runs planned
        self.num_joined_steps = 0  # run steps that also started waiting requests

    @property
    def busy(self) -> bool:
        return self.in_flight is not None or self.run is not None

    @property
    def load(self) -> int:
        # What stats() reports as num_running + num_waiting, without building
        # the whole stats (the router asks every replica at every arrival),
        # as of the simulation's now: requests a decode run finishes in
        # steps that ended before now count as gone, as _catch_up would
        # leave them, without applying those steps yet.
        load = len(self.scheduler.running) + len(self.scheduler.waiting)
        if self.run is None:
            return load
        last = self._last_step_before(self.sim_clock.now_s)
        if last < self.run_next_update:
            return load
        return load - self.run.num_finishing(self.run_next_update, last)

    def _last_step_before(self, now_s: float) -> int:
        """The last step of the run that ended before `now_s`, never the run's
        last (its own event applies it); -1 when none."""
        return bisect.bisect_left(self.run_end_times, now_s, hi=min(self.run_last_step, len(self.run_end_times))) - 1

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {"index": self.index, "ready_s": self.ready_s, "num_steps": self.num_steps,
                "busy_s": self.busy_s, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits}


class _Recorded:
    """Forwards every method call to the admission controller and logs
    ("admission", time, method, args, result), so a test can replay the same
    calls into a fresh controller and compare every answer."""

    def __init__(self, target: AdmissionController, clock: VirtualClock, log: list[tuple]) -> None:
        self._target, self._clock, self._log = target, clock, log

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args):
            result = attr(*args)
            self._log.append(("admission", self._clock(), name, args, result))
            return result
        return call


@dataclass
class _Live:
    spec: RequestSpec
    replica: Replica
    request: Request


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # virtual seconds from 0 to the last event
    replicas: list[dict]
    replica_timeline: list[tuple[float, int]]  # (time, replicas started so far)
    num_steps: int
    traces: list[list[tuple]] | None = None
    num_decode_runs: int = 0  # the fast path's share: see Replica
    num_joined_steps: int = 0


def _plan_next_run(replica: Replica, steps_used: int, ended_by_event: bool) -> None:
    """A run used `steps_used` steps, cut by an event (an arrival, a cancel)
    or not: choose the lengths for the next one from the mean steps between
    events, the steps used per run ended by one (the estimate of an
    exponential mean from samples of which some are cut short: each run
    that ran out of steps adds its steps but no end)."""
    replica.run_steps_used = RUN_LENGTH_DECAY * replica.run_steps_used + steps_used
    replica.runs_ended_by_events = RUN_LENGTH_DECAY * replica.runs_ended_by_events + ended_by_event
    mean_steps = replica.run_steps_used / max(replica.runs_ended_by_events, 1e-3)
    replica.run_steps_planned = max(MIN_RUN_STEPS, min(MAX_RUN_STEPS, int(3 * mean_steps) + 8))
    replica.run_steps_timed = max(MIN_RUN_STEPS, min(MAX_RUN_STEPS, int(0.75 * mean_steps) + 4))


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


class Simulator:
    def __init__(self, config: SimConfig, cost_model: CostModel) -> None:
        self.config = config
        self.cost_model = cost_model
        self.clock = VirtualClock()
        self.router = Router(config.router)
        self.replicas = [Replica(i, config, VirtualClock(), 0.0, self.clock) for i in range(config.num_replicas)]
        self.timeline: list[tuple[float, int]] = [(0.0, config.num_replicas)]
        # (time, sequence, kind, payload): the payload's type depends on the kind.
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._live: dict[str, _Live] = {}
        self._records: list[RequestRecord] = []
        self._rejections_since_check = 0
        self._warm_left = config.autoscale.warm_pool if config.autoscale else 0
        # Built once per distinct value, not per arrival: SamplingParams are
        # immutable (validated once), and so are namespace strings.
        self._sampling_params: dict[int, SamplingParams] = {}
        self._namespaces: dict[str, str] = {}
        self._all_ready_s = 0.0  # every replica serves from this time on

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
                         sum(r.num_joined_steps for r in self.replicas))

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
                continue  # a decode run that ended early
            self.clock.advance_to(event_s)
            self._handle(kind, payload, more_arrivals=next_arrival < len(specs))

    def _push_step_done(self, replica: Replica, t_s: float) -> None:
        replica.step_event_id += 1
        self._push(t_s, _STEP_DONE, (replica, replica.step_event_id))

    def _push(self, t_s: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t_s, self._seq, kind, payload))

    def _handle(self, kind: int, payload: Any, more_arrivals: bool) -> None:
        if kind == _STEP_DONE:
            replica = payload[0]
            if replica.run is not None:
                self._finish_run(replica)  # moves the replica's clock step by step
            else:
                replica.clock.advance_to(self.clock.now_s)
                self._finish_step(replica)
        elif kind == _CANCEL:
            self._cancel(payload)
        elif kind == _AUTOSCALE:
            self._autoscale(more_arrivals)

    # -- arrivals ----------------------------------------------------------
    def _arrive(self, spec: RequestSpec) -> None:
        now = self.clock.now_s
        # The router reads every ready replica's load as of now; only the
        # chosen one's decode run needs its steps applied.
        ready = self.replicas if now >= self._all_ready_s else [r for r in self.replicas if r.ready_s <= now]
        group = spec.prefix_group.group_id if spec.prefix_group else None
        replica = ready[self.router.pick(ready, group)]
        self._catch_up(replica)
        replica.clock.advance_to(now)
        rid = f"r{spec.index}"
        prompt = synth_prompt(spec)
        request = Request(rid, prompt, self._params(spec.output_tokens), arrival_time=now,
                          eos_token_ids=(SIM_EOS_TOKEN_ID,), priority=spec.priority, tenant=spec.tenant,
                          cache_namespace=self._namespace(spec))
        if replica.admission is not None and not self._admit(replica, spec, request):
            return
        max_tokens = request.sampling_params.max_tokens
        self._end_run_after_in_flight(replica)
        try:
            replica.scheduler.add_request(request)
        except ValueError as exc:
            if replica.admission is not None:
                replica.admission.on_finish(rid)
            self._reject(spec, 400, Reason.NEVER_FITS, str(exc))
            return
        if replica.trace is not None:  # not built untraced: it copies the prompt
            replica.trace.append(("add", now, rid, list(prompt), max_tokens, spec.priority, spec.tenant,
                                  request.cache_namespace))
        self._live[rid] = _Live(spec, replica, request)
        if spec.cancel_after_s is not None:
            self._push(now + spec.cancel_after_s, _CANCEL, rid)
        if not replica.busy:
            self._start_step(replica)

    def _namespace(self, spec: RequestSpec) -> str:
        # As the server does: tenants never share cached KV.
        namespace = self._namespaces.get(spec.tenant)
        if namespace is None:
            namespace = self._namespaces[spec.tenant] = f"{self.config.cache_namespace}:{spec.tenant}"
        return namespace

    def _params(self, max_tokens: int) -> SamplingParams:
        params = self._sampling_params.get(max_tokens)
        if params is None:
            params = self._sampling_params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return params

    def _admit(self, replica: Replica, spec: RequestSpec, request: Request) -> bool:
        """Whether admission admits the request (its max_tokens capped if
        degraded); a refusal is recorded."""
        ask = AdmissionRequest(request.request_id, len(request.prompt_token_ids), spec.output_tokens,
                               num_cached_tokens=replica.scheduler.prefix_hit_tokens(request),
                               priority=spec.priority, tenant=spec.tenant)
        decision = replica.admission.decide(ask)
        if not decision.admitted:
            self._reject(spec, decision.status, decision.reason, decision.message)
            return False
        if decision.max_tokens is not None and decision.max_tokens != spec.output_tokens:
            request.sampling_params = self._params(decision.max_tokens)
        return True

    def _reject(self, spec: RequestSpec, status: int, reason: str | None, message: str) -> None:
        now = self.clock.now_s
        sent = now - self.config.frontend_latency_s
        self._rejections_since_check += 1
        self._records.append(RequestRecord(
            index=spec.index, outcome="rejected", scheduled_s=sent, sent_s=sent, end_s=now,
            status_code=status, reject_reason=reason, tenant=spec.tenant, priority=spec.priority,
            prompt_tokens=spec.prompt_tokens, expected_output_tokens=spec.output_tokens,
            last_sent_s=sent, error=message or None))

    # -- steps -------------------------------------------------------------
    def _start_step(self, replica: Replica) -> None:
        now = replica.clock.now_s
        if replica.admission is not None:
            self._expire(replica)
            limits = replica.admission.step_limits(len(replica.scheduler.running))
            replica.scheduler.set_step_limits(*limits)
        if self.config.fast_forward and self._start_run(replica):
            return
        out = replica.scheduler.schedule()
        for request in out.finished:  # outgrew the whole cache: ends with what it has
            self._end(request.request_id, "success", 200, None)
        if out.is_empty:
            replica.in_flight = None
            return
        if replica.trace is not None:
            sched = replica.scheduler
            limits = (sched.max_running, sched.max_batched_tokens, sched.cap_idle_steps)
            replica.trace.append(("schedule", now, limits,
                                  [(c.request.request_id, c.start, c.num_new_tokens, c.samples)
                                   for c in out.chunks], list(out.preempted_ids)))
        self._report_started(replica, out.chunks)
        shape = chunk_shape(out.chunks)
        step_s = self.cost_model.step_time_s(shape)
        replica.in_flight, replica.in_flight_shape = out, shape
        replica.step_started_s = now
        self._push_step_done(replica, now + step_s)

    @staticmethod
    def _report_started(replica: Replica, chunks) -> None:
        """Tell admission which requests a step scheduled for the first time."""
        if replica.admission is None:
            return
        for chunk in chunks:
            rid = chunk.request.request_id
            if rid not in replica.started_ids:
                replica.started_ids.add(rid)
                replica.admission.on_start(rid)

    def _finish_step(self, replica: Replica) -> None:
        now = replica.clock.now_s
        out, shape = replica.in_flight, replica.in_flight_shape
        assert out is not None and shape is not None
        sampled = {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples}
        if replica.trace is not None:
            replica.trace.append(("update", now))
        progressed = replica.scheduler.update(out, sampled)
        step_s = now - replica.step_started_s
        replica.num_steps += 1
        replica.busy_s += step_s
        if replica.admission is not None:
            # The step's decode sequences and prefill tokens, by the one
            # rule (ScheduledChunk.is_decode) chunk_shape counts them with.
            replica.admission.observe_step(shape.num_decode_seqs, shape.num_prefill_tokens, step_s)
        for request in progressed:
            if request.is_finished:
                self._end(request.request_id, "success", 200, None)
        replica.in_flight = None
        self._start_step(replica)

    # -- decode runs (multi-step fast forward) --------------------------------
    def _start_run(self, replica: Replica) -> bool:
        """Start a decode run of at least two steps, if the batch is steady.
        Valid with admission on because, with nothing waiting, no admitted
        request is unstarted (expired() stays empty), and step_limits gives
        every running request its decode token (the budget only grows as
        the batch shrinks), so the steps skip neither call's effect."""
        if replica.run is not None and self._continue_run(replica):
            return True
        scheduler = replica.scheduler
        run = plan_decode_run(scheduler, replica.run_steps_planned, SIM_TOKEN_ID)
        if run is None or run.num_steps < 2:
            return False
        replica.num_decode_runs += 1
        end_times = decode_step_ends_s(self.cost_model, replica.clock.now_s,
                                       run.step_shapes(0, replica.run_steps_timed))
        replica.run, replica.run_end_times, replica.run_next_update = run, end_times, 0
        replica.run_last_step, replica.run_first_step = run.num_steps - 1, 0
        replica.run_started_s = replica.clock.now_s
        self._schedule_run_step(replica, 0)
        self._push_step_done(replica, end_times[-1])
        return True

    def _continue_run(self, replica: Replica) -> bool:
        """After a joined step (_finish_joined_step): the run goes on with the
        requests it started (DecodeRun.extend), instead of a new plan of the
        whole batch, when the batch is steady and at least two planned steps
        are left. Otherwise the run closes (False)."""
        run, step = replica.run, replica.run_next_update
        assert run is not None
        if run.extend(step) and run.num_steps - step >= 2:
            end_times = replica.run_end_times
            del end_times[step:]
            end_times += decode_step_ends_s(self.cost_model, end_times[-1],
                                            run.step_shapes(step, step + replica.run_steps_timed))
            replica.run_last_step, replica.run_first_step = run.num_steps - 1, step
            self._schedule_run_step(replica, step)
            self._push_step_done(replica, end_times[-1])
            return True
        run.close()
        replica.run = None
        return False

    def _schedule_run_step(self, replica: Replica, step: int) -> None:
        run = replica.run
        assert run is not None
        run.schedule_step(step)
        if replica.trace is not None:
            sched = replica.scheduler
            limits = (sched.max_running, sched.max_batched_tokens, sched.cap_idle_steps)
            replica.trace.append(("schedule", replica.clock.now_s, limits,
                                  [(r.request_id, start, 1, True) for r, start in run.batch_at(step)],
                                  []))

    def _update_run_steps(self, replica: Replica, last: int) -> None:
        """Apply the run's updates up to step `last`, each at its own time, as
        _finish_step would, then schedule the next step. Untraced (the hot
        loop of an hour-long simulation) the run applies them in one call;
        traced, step by step, logging the single steps the run stands for."""
        if replica.trace is None:
            self._apply_run_steps(replica, last)
            return
        run, end_times, clock = replica.run, replica.run_end_times, replica.clock
        admission, trace = replica.admission, replica.trace
        assert run is not None
        step = replica.run_next_update
        started_s = end_times[step - 1] if step else replica.run_started_s
        for step in range(step, last + 1):
            now = end_times[step]
            clock.advance_to(now)
            trace.append(("update", now))
            finished = run.update_step(step, now)
            replica.run_next_update = step + 1
            step_s = now - started_s
            started_s = now
            replica.num_steps += 1
            replica.busy_s += step_s
            if admission is not None:
                admission.observe_step(run.num_seqs[step], 0, step_s)
            for request in finished:
                self._end(request.request_id, "success", 200, None)
            if step < replica.run_last_step:
                self._schedule_run_step(replica, step + 1)

    def _apply_run_steps(self, replica: Replica, last: int) -> None:
        """_update_run_steps without a trace: the run applies its steps with
        events in one call, the step accounting and the admission
        controller's step measurements take the stretch's step times at
        once (the same sums, in step order), and each finish is reported at
        its step's end as a single step would."""
        run, end_times, admission = replica.run, replica.run_end_times, replica.admission
        assert run is not None
        first = replica.run_next_update
        finished = run.apply_steps(last, end_times, replica.run_last_step)
        replica.run_next_update = last + 1
        starts = end_times[first - 1:last] if first else [replica.run_started_s, *end_times[:last]]
        steps_s = list(map(operator.sub, end_times[first:last + 1], starts))
        replica.busy_s = functools.reduce(operator.add, steps_s, replica.busy_s)
        replica.num_steps += last + 1 - first
        if admission is not None:
            admission.observe_steps(zip(run.num_seqs[first:last + 1], itertools.repeat(0), steps_s))
        for step, request in finished:
            replica.clock.advance_to(end_times[step])
            self._end(request.request_id, "success", 200, None)
        replica.clock.advance_to(end_times[last])

    def _catch_up(self, replica: Replica) -> None:
        """Apply the run's steps that ended before now (an event at the same
        time as a step's end comes first, as it would with single steps)."""
        if replica.run is None:
            return
        last = replica._last_step_before(self.clock.now_s)
        if last >= replica.run_next_update:
            self._update_run_steps(replica, last)

    def _end_run_after_in_flight(self, replica: Replica) -> None:
        """Before a request is added: the run ends with the step in flight
        (adding only queues the request; the step after sees it)."""
        if replica.run is None or replica.run_last_step == replica.run_next_update:
            return
        step = replica.run_last_step = replica.run_next_update
        _plan_next_run(replica, step + 1 - replica.run_first_step, True)
        self._push_step_done(replica, replica.run_end_times[step])

    def _end_run_early(self, replica: Replica) -> None:
        """Before an abort changes the replica's batch: its run's in-flight
        step becomes an ordinary in-flight step."""
        run = replica.run
        if run is None:
            return
        step = replica.run_next_update
        out = run.in_flight_output(step)
        if replica.in_flight is None:
            _plan_next_run(replica, step + 1 - replica.run_first_step, True)
        else:  # a joined step (_join_waiting): the started requests' chunks follow the decodes
            out.chunks += replica.in_flight.chunks
            out.num_batched_tokens += replica.in_flight.num_batched_tokens
        replica.in_flight = out
        replica.in_flight_shape = chunk_shape(out.chunks)
        replica.step_started_s = replica.run_end_times[step - 1] if step else replica.run_started_s
        replica.run = None
        self._push_step_done(replica, replica.run_end_times[step])

    def _finish_run(self, replica: Replica) -> None:
        if replica.in_flight is not None:
            self._finish_joined_step(replica)
            return
        if replica.run_last_step >= len(replica.run_end_times):
            self._time_more_run_steps(replica)
            return
        run = replica.run
        assert run is not None
        if replica.run_last_step == run.num_steps - 1:
            _plan_next_run(replica, run.num_steps - replica.run_first_step, False)
        if replica.run_next_update <= replica.run_last_step:
            self._update_run_steps(replica, replica.run_last_step)
        if self._join_waiting(replica):
            return
        run.close()
        replica.run = None
        self._start_step(replica)

    def _time_more_run_steps(self, replica: Replica) -> None:
        """The end of the last step whose end time is known, inside the run:
        the next stretch of end times. A run's steps are timed a stretch at
        a time (a cost-model call per step), as most runs end early, at the
        next arrival. The end times are those of timing all steps at once
        (each adds its step time to the previous end)."""
        known, end_times, run = len(replica.run_end_times), replica.run_end_times, replica.run
        assert run is not None
        end_times += decode_step_ends_s(self.cost_model, end_times[-1],
                                        run.step_shapes(known, known + replica.run_steps_timed))
        self._push_step_done(replica, end_times[-1])

    def _join_waiting(self, replica: Replica) -> bool:
        """After a run step that requests arrived during: the next step is
        the ordinary step that starts them beside the decodes (schedule()
        gives every decode its token first), run as one more step of the
        run with the started requests' chunks beside it, so that the
        decodes need no schedule() / update() of their own. What single
        steps do at that step's start happens here too (expiry, step
        limits, on_start). False, with no change but those, when the step
        is not one the run can take: untraced runs only (a trace logs the
        single steps), the step must lie inside the run, someone must be
        waiting, and the token budget must hold every decode."""
        run, step, scheduler = replica.run, replica.run_last_step + 1, replica.scheduler
        assert run is not None
        if replica.trace is not None or step >= run.num_steps or not len(scheduler.waiting):
            return False
        now = replica.clock.now_s
        if replica.admission is not None:
            self._expire(replica)
            scheduler.set_step_limits(*replica.admission.step_limits(len(scheduler.running)))
        out = run.schedule_step_with_waiting(step)
        if out is None:
            return False
        replica.num_joined_steps += bool(out.chunks)
        self._report_started(replica, out.chunks)
        # chunk_shape of the whole step: the run's decodes (each reads its
        # context + 1 tokens and, computing one query, attends as many
        # pairs) beside the started requests' chunks.
        (num_seqs, kv_tokens), = run.step_shapes(step, step + 1)
        started = chunk_shape(out.chunks)
        shape = StepShape(started.num_prefill_tokens, started.num_decode_seqs + num_seqs,
                          started.kv_tokens_read + kv_tokens, started.attention_pairs + kv_tokens)
        end_s = now + self.cost_model.step_time_s(shape)
        replica.in_flight, replica.in_flight_shape = out, shape
        replica.step_started_s = now
        replica.run_last_step = step
        del replica.run_end_times[step:]
        replica.run_end_times.append(end_s)
        self._push_step_done(replica, end_s)
        return True

    def _finish_joined_step(self, replica: Replica) -> None:
        """The end of a step _join_waiting started: what _finish_step does
        for it, the decodes' part applied by the run."""
        run, step, out, shape = replica.run, replica.run_last_step, replica.in_flight, replica.in_flight_shape
        assert run is not None and out is not None and shape is not None
        now = replica.run_end_times[step]
        finished = run.apply_steps(step, replica.run_end_times, step)  # the decodes' updates first
        replica.run_next_update = step + 1
        replica.clock.advance_to(now)
        progressed = replica.scheduler.update(out, {c.request.request_id: SIM_TOKEN_ID
                                                    for c in out.chunks if c.samples})
        step_s = now - replica.step_started_s
        replica.num_steps += 1
        replica.busy_s += step_s
        if replica.admission is not None:
            replica.admission.observe_step(shape.num_decode_seqs, shape.num_prefill_tokens, step_s)
        for _, request in finished:
            self._end(request.request_id, "success", 200, None)
        for request in progressed:
            if request.is_finished:
                self._end(request.request_id, "success", 200, None)
        replica.in_flight = None
        self._start_step(replica)  # continues the run, or closes it (_start_run)

    def _expire(self, replica: Replica) -> None:
        """Admitted requests that did not start in time: the server answers 503."""
        for rid, reason in replica.admission.expired():
            self._log(replica, ("abort", replica.clock.now_s, rid))
            replica.scheduler.abort(rid)
            self._end(rid, "timed_out", 503, reason)

    def _cancel(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is None:
            return  # already ended
        self._catch_up(live.replica)
        if rid not in self._live:
            return  # it finished in a step of the run before now
        self._end_run_early(live.replica)
        live.replica.clock.advance_to(self.clock.now_s)
        self._log(live.replica, ("abort", self.clock.now_s, rid))
        live.replica.scheduler.abort(rid)
        self._end(rid, "cancelled", None, None)

    def _end(self, rid: str, outcome: str, status: int | None, reason: str | None) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        replica, request, spec = live.replica, live.request, live.spec
        if replica.admission is not None:
            replica.admission.on_finish(rid, request.num_tokens)
            replica.started_ids.discard(rid)
        stamps = request.timestamps
        queue_s = None if stamps.scheduled is None else stamps.scheduled - stamps.arrival
        sent = stamps.arrival - self.config.frontend_latency_s
        self._records.append(RequestRecord(
            index=spec.index, outcome=outcome, scheduled_s=sent, sent_s=sent,
            headers_s=stamps.arrival, token_events=self._token_events(stamps.token_times),
            end_s=replica.clock.now_s, status_code=status, reject_reason=reason, tenant=spec.tenant,
            priority=spec.priority, prompt_tokens=spec.prompt_tokens,
            output_tokens=request.num_output_tokens, expected_output_tokens=spec.output_tokens,
            last_sent_s=sent, queue_s=queue_s))

    def _token_events(self, token_times: list[float]) -> tuple[tuple[float, int], ...]:
        if self.config.exact_token_events or len(token_times) < 3:
            return tuple((t, 1) for t in token_times)
        return ((token_times[0], 1), (token_times[-1], len(token_times) - 1))

    def _log(self, replica: Replica, entry: tuple) -> None:
        if replica.trace is not None:
            replica.trace.append(entry)

    # -- scale-out ---------------------------------------------------------
    def _autoscale(self, more_arrivals: bool) -> None:
        rule = self.config.autoscale
        assert rule is not None  # the event is pushed only with autoscaling on
        now = self.clock.now_s
        ready = [r for r in self.replicas if r.ready_s <= now]
        for r in ready:
            self._catch_up(r)
        starting = len(self.replicas) - len(ready)
        stats = [r.scheduler.stats() for r in ready]
        mean_kv = sum(s.kv_usage for s in stats) / max(1, len(stats))
        mean_waiting = sum(s.num_waiting for s in stats) / max(1, len(stats))
        pressed = (mean_kv > rule.scale_up_kv_usage or self._rejections_since_check > 0
                   or mean_waiting > rule.scale_up_waiting_per_replica)
        self._rejections_since_check = 0
        # One replica per check, and none while another is still starting:
        # a cold start is slow, and piling more on does not make it faster.
        if pressed and starting == 0 and len(self.replicas) < rule.max_replicas:
            delay_s = rule.cold_start_s
            if self._warm_left > 0:
                self._warm_left -= 1
                delay_s = rule.warm_start_s
            self.replicas.append(Replica(len(self.replicas), self.config, VirtualClock(now), now + delay_s,
                                         self.clock))
            self._all_ready_s = max(self._all_ready_s, now + delay_s)
            self.timeline.append((now, len(self.replicas)))
        if more_arrivals or self._live:
            self._push(now + rule.interval_s, _AUTOSCALE, None)
