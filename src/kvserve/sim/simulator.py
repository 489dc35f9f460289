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
request added to the replica ends the run after its in-flight step; a
cancel ends it at once, handing the in-flight step to the ordinary
update(). Each replica reads its own clock, so a step applied late still
sees its own time. Timestamps, outcomes, preemptions and admission
decisions are those of single steps (tests/test_sim_fast_forward.py).

Sampled tokens are a fixed non-EOS id and requests run with ignore_eos and
max_tokens = the workload's output length, so output lengths follow the
workload exactly. Every request ends as a `bench.report.RequestRecord`, so
`kvserve simulate` writes the same report.json as `kvserve bench`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from kvserve.bench.report import RequestRecord
from kvserve.bench.workload import RequestSpec
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.kv_cache.hashing import hash_prefix_blocks
from kvserve.scheduler.admission import AdmissionController, AdmissionRequest
from kvserve.scheduler.scheduler import DecodeRun, Scheduler, SchedulerOutput
from kvserve.sim.cost_model import CostModel, chunk_shape, decode_step_ends_s
from kvserve.sim.router import Router

# The token every simulated step "samples": any id that is not EOS works,
# since requests run with ignore_eos.
SIM_TOKEN_ID = 1
SIM_EOS_TOKEN_ID = 0
_STEP_DONE, _CANCEL, _AUTOSCALE = 0, 1, 2
# Decode run lengths planned: a run ended early (the next arrival at its
# replica) wastes the planning of its remaining steps, so each replica plans
# about 1.5x the steps its last run used, within these bounds.
MIN_RUN_STEPS, MAX_RUN_STEPS = 8, 512


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
        self.admission = None if config.admission is None else AdmissionController(
            config.admission, config.cache.num_blocks, config.cache.block_size,
            config.scheduler.max_num_seqs, clock)
        if self.admission is not None and self.trace is not None:
            self.admission = _Recorded(self.admission, clock, self.trace)
        self.in_flight: SchedulerOutput | None = None
        self.step_started_s = 0.0
        self.run: DecodeRun | None = None  # while a decode run is in flight
        self.run_started_s = 0.0
        self.run_end_times: list[float] = []
        self.run_next_update = 0  # steps of the run updated so far
        self.run_last_step = 0  # the run ends after updating this step
        self.run_steps_planned = MIN_RUN_STEPS
        # Bumped per step event pushed, so the event of a run ended early is ignored.
        self.step_event_id = 0
        self.started_ids: set[str] = set()
        self.num_steps = 0
        self.busy_s = 0.0

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
        return bisect.bisect_left(self.run_end_times, now_s, hi=self.run_last_step) - 1

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


def _next_run_length(steps_used: int) -> int:
    return max(MIN_RUN_STEPS, min(MAX_RUN_STEPS, steps_used + steps_used // 2 + 4))


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
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._live: dict[str, _Live] = {}
        self._records: list[RequestRecord] = []
        self._rejections_since_check = 0
        self._warm_left = config.autoscale.warm_pool if config.autoscale else 0

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
        return SimResult(sorted(self._records, key=lambda r: r.index), self.clock.now_s,
                         [r.stats() for r in self.replicas], self.timeline,
                         sum(r.num_steps for r in self.replicas),
                         [r.trace for r in self.replicas] if self.config.record_trace else None)

    def _push_step_done(self, replica: Replica, t_s: float) -> None:
        replica.step_event_id += 1
        self._push(t_s, _STEP_DONE, (replica, replica.step_event_id))

    def _push(self, t_s: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t_s, self._seq, kind, payload))

    def _handle(self, kind: int, payload: object, more_arrivals: bool) -> None:
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
        ready = [r for r in self.replicas if r.ready_s <= now]
        group = spec.prefix_group.group_id if spec.prefix_group else None
        replica = ready[self.router.pick(ready, group)]
        self._catch_up(replica)
        replica.clock.advance_to(now)
        rid = f"r{spec.index}"
        prompt = synth_prompt(spec)
        # The prompt's block hashes, computed once: the admission's prefix-hit
        # estimate reads them and the request keeps them for the KV cache.
        kv_cache = replica.scheduler.kv_cache
        block_hashes = hash_prefix_blocks(prompt[:-1], kv_cache.block_size, self._namespace(spec)) \
            if kv_cache.enable_prefix_caching else []
        max_tokens = spec.output_tokens
        if replica.admission is not None:
            admitted_tokens = self._admit(replica, spec, rid, prompt, block_hashes)
            if admitted_tokens is None:
                return
            max_tokens = admitted_tokens
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival_time=now, eos_token_ids=(SIM_EOS_TOKEN_ID,), priority=spec.priority,
                          tenant=spec.tenant, cache_namespace=self._namespace(spec), block_hashes=block_hashes)
        self._end_run_after_in_flight(replica)
        try:
            replica.scheduler.add_request(request)
        except ValueError as exc:
            if replica.admission is not None:
                replica.admission.on_finish(rid)
            self._reject(spec, 400, "never_fits", str(exc))
            return
        self._log(replica, ("add", now, rid, list(prompt), max_tokens, spec.priority, spec.tenant,
                            request.cache_namespace))
        self._live[rid] = _Live(spec, replica, request)
        if spec.cancel_after_s is not None:
            self._push(now + spec.cancel_after_s, _CANCEL, rid)
        if not replica.busy:
            self._start_step(replica)

    def _namespace(self, spec: RequestSpec) -> str:
        # As the server does: tenants never share cached KV.
        return f"{self.config.cache_namespace}:{spec.tenant}"

    def _admit(self, replica: Replica, spec: RequestSpec, rid: str, prompt: list[int],
               block_hashes: list[bytes]) -> int | None:
        """max_tokens to run with, or None when refused (recorded)."""
        cached = replica.scheduler.kv_cache.count_cached_tokens_of(block_hashes)
        ask = AdmissionRequest(rid, len(prompt), spec.output_tokens, num_cached_tokens=cached,
                               priority=spec.priority, tenant=spec.tenant)
        decision = replica.admission.check(ask)
        if not decision.admitted:
            self._reject(spec, decision.status, decision.reason, decision.message)
            return None
        replica.admission.admit(ask, decision)
        return decision.max_tokens or spec.output_tokens

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
            replica.trace.append(("schedule", now, (sched.max_running, sched.max_batched_tokens),
                                  [(c.request.request_id, c.start, c.num_new_tokens, c.samples)
                                   for c in out.chunks], list(out.preempted_ids)))
        if replica.admission is not None:
            for chunk in out.chunks:
                rid = chunk.request.request_id
                if rid not in replica.started_ids:
                    replica.started_ids.add(rid)
                    replica.admission.on_start(rid)
        step_s = self.cost_model.step_time_s(chunk_shape(out.chunks))
        replica.in_flight = out
        replica.step_started_s = now
        self._push_step_done(replica, now + step_s)

    def _finish_step(self, replica: Replica) -> None:
        now = replica.clock.now_s
        out = replica.in_flight
        sampled = {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples}
        self._log(replica, ("update", now))
        progressed = replica.scheduler.update(out, sampled)
        step_s = now - replica.step_started_s
        replica.num_steps += 1
        replica.busy_s += step_s
        if replica.admission is not None:
            replica.admission.observe_step(out.num_decode_seqs, out.num_prefill_tokens, step_s)
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
        scheduler = replica.scheduler
        run = scheduler.plan_decode_run(replica.run_steps_planned, SIM_TOKEN_ID)
        if run is None or run.num_steps < 2:
            return False
        end_times = decode_step_ends_s(self.cost_model, replica.clock.now_s, run.shapes)
        replica.run, replica.run_end_times, replica.run_next_update = run, end_times, 0
        replica.run_last_step = run.num_steps - 1
        replica.run_started_s = replica.clock.now_s
        self._schedule_run_step(replica, 0)
        self._push_step_done(replica, end_times[-1])
        return True

    def _schedule_run_step(self, replica: Replica, step: int) -> None:
        replica.run.schedule_step(step)
        if replica.trace is not None:
            sched = replica.scheduler
            replica.trace.append(("schedule", replica.clock.now_s, (sched.max_running, sched.max_batched_tokens),
                                  [(r.request_id, start, 1, True) for r, start in replica.run.batch_at(step)],
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
                admission.observe_step(run.shapes[step][0], 0, step_s)
            for request in finished:
                self._end(request.request_id, "success", 200, None)
            if step < replica.run_last_step:
                self._schedule_run_step(replica, step + 1)

    def _apply_run_steps(self, replica: Replica, last: int) -> None:
        """_update_run_steps without a trace: the run applies its steps with
        events in one call; per step only the step accounting and the
        admission controller's step measurement remain, and each finish is
        reported at its step's end as a single step would."""
        run, end_times, admission = replica.run, replica.run_end_times, replica.admission
        first = replica.run_next_update
        finished = run.apply_steps(last, end_times, replica.run_last_step)
        replica.run_next_update = last + 1
        next_finish = 0
        started_s = end_times[first - 1] if first else replica.run_started_s
        busy_s, shapes = replica.busy_s, run.shapes
        for step in range(first, last + 1):
            now = end_times[step]
            step_s = now - started_s
            started_s = now
            busy_s += step_s
            if admission is not None:
                admission.observe_step(shapes[step][0], 0, step_s)
            while next_finish < len(finished) and finished[next_finish][0] == step:
                replica.clock.advance_to(now)
                self._end(finished[next_finish][1].request_id, "success", 200, None)
                next_finish += 1
        replica.busy_s = busy_s
        replica.num_steps += last + 1 - first
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
        replica.run_steps_planned = _next_run_length(step + 1)
        self._push_step_done(replica, replica.run_end_times[step])

    def _end_run_early(self, replica: Replica) -> None:
        """Before an abort changes the replica's batch: its run's in-flight
        step becomes an ordinary in-flight step."""
        if replica.run is None:
            return
        step = replica.run_next_update
        replica.run_steps_planned = _next_run_length(step + 1)
        replica.in_flight = replica.run.in_flight_output(step)
        replica.step_started_s = replica.run_end_times[step - 1] if step else replica.run_started_s
        replica.run = None
        self._push_step_done(replica, replica.run_end_times[step])

    def _finish_run(self, replica: Replica) -> None:
        if replica.run_last_step == replica.run.num_steps - 1:
            replica.run_steps_planned = _next_run_length(replica.run.num_steps)
        if replica.run_next_update <= replica.run_last_step:
            self._update_run_steps(replica, replica.run_last_step)
        replica.run.close()
        replica.run = None
        self._start_step(replica)

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
            self.timeline.append((now, len(self.replicas)))
        if more_arrivals or self._live:
            self._push(now + rule.interval_s, _AUTOSCALE, None)
