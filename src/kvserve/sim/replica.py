"""One simulated replica: the real scheduler and the admission loop on a
virtual clock, with a cost model standing in for the torch runner.

A step is the engine's (schedule -> execute -> update) with "execute"
replaced by the cost model's step time: the replica schedules at its
clock's now, asks the simulation for an event at the step's end
(`ReplicaHost.push_step_done`), and applies the step's results when it
comes, sampling one fixed token. Around every step it drives admission
through `AdmissionLoop` exactly as the server's engine thread does.

Fast forward (multi-step decode): when the batch is a steady pure decode,
the replica plans a `DecodeRun` (sim/fast_forward.py) and applies its steps
lazily, each at the time it would have run, whenever the simulation next
changes or inspects the replica (an arrival routed to it, a cancel, an
autoscale check, the run's end); `load` counts the run's finishes before
now without applying its steps. A request added cuts the run after its
in-flight step; the step after starts it beside the run's decodes as one
more step of the run (its chunk through the ordinary update()), and the
run then goes on with it when the batch is steady again, else ends. A
cancel ends the run at once, handing the in-flight step to the ordinary
update(). Step end times are computed a stretch at a time, as most runs are
cut early. The replica reads its own clock, so a step applied late still
sees its own time. Timestamps, outcomes, preemptions and admission calls
are those of single steps (tests/test_sim_fast_forward.py).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from typing import Final, NamedTuple

from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionDecision, Reason, reject
from kvserve.admission.loop import AdmissionLoop
from kvserve.admission.warm_up import WARM_UP_MIN_STEPS, warm_up
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request
from kvserve.fleet.autoscale import QueueWaitWindow
from kvserve.fleet.backend_state import DrainMeter
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput
from kvserve.sim.clock import VirtualClock
from kvserve.sim.cost_model import (CostModel, SlowedCostModel, StepShape, chunk_shape, decode_step_ends_s,
                                    step_time_at_s)
from kvserve.sim.fast_forward import ActiveRun, RunLengths, plan_decode_run
from kvserve.sim.speculation import SimSpeculation, SimulatedDrafts

# The token every simulated step "samples": any id that is not EOS works,
# since requests run with ignore_eos.
SIM_TOKEN_ID: Final = 1
SIM_EOS_TOKEN_ID: Final = 0
# The warm-up's prompts need token ids; the simulation samples none of them.
SIM_VOCAB_SIZE: Final = 32_000


class ReplicaHost:
    """What a replica needs of the simulation around it (the Simulator):
    an event when a step ends, and the record of a request that ended."""

    def push_step_done(self, replica: Replica, t_s: float) -> None:
        raise NotImplementedError

    def end(self, request_id: str, outcome: str, status: int | None, reason: Reason | None) -> None:
        """The request ended at its replica's now (success, timed_out, cancelled)."""
        raise NotImplementedError


class Recorded:
    """Forwards every method call to the admission controller and logs
    ("admission", time, method, args, result), so a test can replay the same
    calls into a fresh controller, or compare them with another driver's
    (the server's engine loop), answer by answer."""

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


class _WarmUpStep(NamedTuple):
    num_decode_seqs: int
    num_prefill_tokens: int
    captured_graph: bool


class SimulatedWarmUpCore:
    """A replica's scheduler as admission/warm_up.py drives an EngineCore
    (its WarmUpCore): each step scheduled, priced by the cost model on a
    timer of its own (`elapsed_s`) and updated with SIM_TOKEN_ID."""

    def __init__(self, scheduler: Scheduler, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: CostModel, clock: VirtualClock) -> None:
        self.scheduler = scheduler
        self.cost_model = cost_model
        self.clock = clock
        self.block_size = cache_config.block_size
        self.num_kv_blocks = cache_config.num_blocks
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.vocab_size = SIM_VOCAB_SIZE
        self.eos_token_ids: tuple[int, ...] = (SIM_EOS_TOKEN_ID,)
        self._elapsed_s = 0.0

    def elapsed_s(self) -> float:
        return self._elapsed_s

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> _WarmUpStep:
        out = self.scheduler.schedule()
        self._elapsed_s += step_time_at_s(self.cost_model, chunk_shape(out.chunks), self.clock.now_s)
        self.scheduler.update(out, {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples})
        return _WarmUpStep(out.num_decode_seqs, out.num_prefill_tokens, False)

    def abort(self, request_id: str) -> object:
        return self.scheduler.abort(request_id)

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()


class Replica:
    """One simulated server: the real scheduler and the admission loop."""

    def __init__(self, index: int, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 admission_config: AdmissionConfig | None, cost_model: CostModel, host: ReplicaHost,
                 clock: VirtualClock, ready_s: float, sim_clock: VirtualClock, *,
                 fast_forward: bool = True, record_trace: bool = False, look_back_s: float = 10.0,
                 speculation: SimSpeculation | None = None, warm_up: bool = True) -> None:
        self.index = index
        self.name = f"replica-{index}"  # its identity on the router's hash ring
        self.started_s = clock.now_s  # when it was asked for
        self.ready_s = ready_s
        # Its own clock: a decode run's steps are applied when the simulation
        # next looks at this replica, each at its own (earlier) time.
        self.clock = clock
        self.sim_clock = sim_clock  # the simulation's now, which `load` answers for
        self.cost_model = cost_model
        self.host = host
        # Speculation: single steps only (a decode run assumes one token per step).
        self.drafts = None if speculation is None else SimulatedDrafts(speculation, SIM_TOKEN_ID)
        self.fast_forward = fast_forward and speculation is None
        self.proposer_s = 0.0  # the proposer's time before the next step
        self.scheduler = Scheduler(scheduler_config, cache_config, clock)
        self.trace: list[tuple] | None = [] if record_trace else None
        self.admission: AdmissionLoop | None = None
        # The controller itself, for what the router reads of it (not a call
        # of the replica's own to record in its trace).
        self._controller: AdmissionController | None = None
        if admission_config is not None:
            controller = AdmissionController(admission_config, cache_config.num_blocks, cache_config.block_size,
                                             scheduler_config.max_num_seqs, clock,
                                             max_num_batched_tokens=scheduler_config.max_num_batched_tokens)
            self._controller = controller
            self.admission = AdmissionLoop(controller if self.trace is None else
                                           Recorded(controller, clock, self.trace))
            if warm_up:
                self._warm_up(scheduler_config, cache_config)
        self.in_flight: SchedulerOutput | None = None
        self.in_flight_shape: StepShape | None = None  # chunk_shape of in_flight
        self.step_started_s = 0.0
        self.run: ActiveRun | None = None
        self.run_lengths = RunLengths()
        # Bumped per step event pushed, so the event of a run ended early is ignored.
        self.step_event_id = 0
        # What a gateway measures of it: requests finished per busy second
        # (the simulation observes it at arrivals and ends).
        self.drain = DrainMeter()
        self.num_finished = 0
        # What it would record for the autoscaler (queue waits, observed at
        # each finish), and whether it serves.
        self.queue_waits = QueueWaitWindow(look_back_s)
        self.sleeping = False  # a warm-pool replica asleep: routed nothing
        self.retired = False  # let go by the autoscaler: routed nothing, finishes what it has
        # Failure scenarios (sim/failures.py): gone (routed nothing, runs nothing), or slowed.
        self.lost_at_s: float | None = None
        self.slowed_by: float | None = None
        self.num_routed = 0  # routing decisions that chose it (an arrival, or one rerouted here)
        self.num_steps = 0
        self.busy_s = 0.0
        # How much of the work the fast path took (results never depend on it).
        self.num_decode_runs = 0  # multi-step runs planned
        self.num_joined_steps = 0  # run steps that also started waiting requests

    def _warm_up(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        """The server's warm-up (admission/warm_up.py) through this replica's
        scheduler, its steps priced by the cost model, fed to admission as
        the server feeds its measured ones. Takes no simulated time: a live
        server warms up before it is ready. Leaves no request, cached block
        or preemption behind, as the live one."""
        core = SimulatedWarmUpCore(self.scheduler, scheduler_config, cache_config, self.cost_model, self.clock)
        steps = warm_up(core, WARM_UP_MIN_STEPS, timer=core.elapsed_s)
        assert self.admission is not None
        self.admission.on_steps_end(steps)

    # -- what the simulation reads -------------------------------------------
    @property
    def busy(self) -> bool:
        return self.in_flight is not None or self.run is not None

    @property
    def load(self) -> int:
        # What stats() reports as num_running + num_waiting, without building
        # the whole stats (the router asks every replica at every arrival),
        # as of the simulation's now: requests a decode run finishes in
        # steps that ended before now count as gone, as catch_up would
        # leave them, without applying those steps yet.
        load = len(self.scheduler.running) + len(self.scheduler.waiting)
        active = self.run
        if active is None:
            return load
        last = self._last_step_before(self.sim_clock.now_s)
        if last < active.next_update:
            return load
        return load - active.run.num_finishing(active.next_update, last)

    # -- what the router reads (fleet.backend_state.BackendLoad) --------------
    @property
    def num_running(self) -> int:
        return self.load - len(self.scheduler.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv_cache.usage()

    @property
    def num_kv_blocks(self) -> int | None:
        return self.scheduler.kv_cache.num_blocks

    @property
    def block_size(self) -> int | None:
        return self.scheduler.kv_cache.block_size

    @property
    def running_cap(self) -> int | None:
        # What the server exports as kvserve_running_cap: admission's cap from
        # the steps measured so far (a decode run skips setting it per step).
        if self._controller is None:
            return self.scheduler.config.max_num_seqs
        return self._controller.running_cap()

    @property
    def drain_rps(self) -> float | None:
        return self.drain.rate_rps(self.sim_clock.now_s)

    def _last_step_before(self, now_s: float) -> int:
        """The last step of the run that ended before `now_s`, never the run's
        last (its own event applies it); -1 when none."""
        active = self.run
        assert active is not None
        return bisect.bisect_left(active.end_times, now_s, hi=min(active.last_step, len(active.end_times))) - 1

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {"index": self.index, "started_s": self.started_s, "ready_s": self.ready_s,
                "lost_at_s": self.lost_at_s, "slowed_by": self.slowed_by, "num_routed": self.num_routed,
                "num_steps": self.num_steps, "busy_s": self.busy_s, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                **({} if self.drafts is None else {"spec_decode_num_draft_tokens": self.drafts.num_draft_tokens,
                                                   "spec_decode_num_accepted_tokens": self.drafts.num_accepted_tokens})}

    # -- what the simulation does to it --------------------------------------
    def add(self, request: Request) -> AdmissionDecision | None:
        """An arrival at the replica's now: admission's one decision (on the
        prefix hit its own cache would give), then the scheduler. Returns
        the refusal, or None once the request is queued (start_if_idle
        then runs it)."""
        if self.admission is not None:
            decision = self.admission.decide(request, self.scheduler.prefix_hit_tokens(request),
                                             num_evicted_blocks=self.scheduler.num_evicted_blocks)
            if not decision.admitted:
                return decision
        self._end_run_after_in_flight()
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            if self.admission is not None:
                self.admission.on_finished(request.request_id)
            return reject(400, Reason.NEVER_FITS, None, str(exc))
        if self.trace is not None:  # not built untraced: it copies the prompt
            self.trace.append(("add", self.clock.now_s, request.request_id, list(request.prompt_token_ids),
                               request.sampling_params.max_tokens, request.priority, request.tenant,
                               request.cache_namespace))
        return None

    def start_if_idle(self) -> None:
        """After an arrival: an idle replica starts its next step at once."""
        if not self.busy:
            self._start_step()

    def abort(self, request_id: str) -> None:
        """Abort a request (a client's cancel) at the simulation's now."""
        self._end_run_early()
        self.clock.advance_to(self.sim_clock.now_s)
        self._log(("abort", self.clock.now_s, request_id))
        self.scheduler.abort(request_id)

    def lose(self) -> None:
        """The replica goes away at the simulation's now, after catch_up: the
        step in flight never ends and nothing runs there again (its pending
        step event is ignored). What becomes of its requests is the
        simulation's (Simulator._lose)."""
        self.lost_at_s = self.sim_clock.now_s
        self.run = None
        self.in_flight = None
        self.step_event_id += 1

    def slow_down(self, factor: float) -> None:
        """From the simulation's now, its steps take `factor` x as long. The
        step in flight keeps its time; a decode run ends after it (its later
        steps were timed at the old pace) and the next step is planned at
        the new one."""
        self.catch_up()
        self._end_run_after_in_flight()
        self.cost_model = SlowedCostModel(self.cost_model, factor)
        self.slowed_by = factor * (self.slowed_by or 1.0)

    def catch_up(self) -> None:
        """Apply the run's steps that ended before the simulation's now (an
        event at the same time as a step's end comes first, as it would
        with single steps)."""
        if self.run is None:
            return
        last = self._last_step_before(self.sim_clock.now_s)
        if last >= self.run.next_update:
            self._update_run_steps(last)

    def on_step_done(self) -> None:
        """The event of the step in flight (or of the run's) came."""
        if self.run is not None:
            self._finish_run()  # moves the clock step by step
            return
        self.clock.advance_to(self.sim_clock.now_s)
        self._finish_step()

    def _log(self, entry: tuple) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def _log_schedule(self, chunks: list[tuple[str, int, int, bool]], preempted_ids: list[str]) -> None:
        if self.trace is not None:
            sched = self.scheduler
            limits = (sched.max_running, sched.max_batched_tokens, sched.cap_idle_steps)
            self.trace.append(("schedule", self.clock.now_s, limits, chunks, preempted_ids))

    # -- single steps ----------------------------------------------------------
    def _start_step(self) -> None:
        now = self.clock.now_s
        if self.admission is not None:
            limits = self.admission.before_step(len(self.scheduler.running), self._expire, self.scheduler)
            self.scheduler.set_step_limits(*limits)
        if self.fast_forward and self._start_run():
            return
        out = self.scheduler.schedule()
        for request in out.finished:  # outgrew the whole cache: ends with what it has
            self.host.end(request.request_id, "success", 200, None)
        if out.is_empty:
            self.in_flight = None
            return
        if self.trace is not None:
            self._log_schedule([(c.request.request_id, c.start, c.num_new_tokens, c.samples) for c in out.chunks],
                               list(out.preempted_ids))
        if self.admission is not None:
            self.admission.on_scheduled(out.started_ids, out.scheduled_at)
        shape = chunk_shape(out.chunks)
        self.in_flight, self.in_flight_shape = out, shape
        self.step_started_s = now
        self.host.push_step_done(self, now + step_time_at_s(self.cost_model, shape, now) + self.proposer_s)

    def _expire(self, request_id: str, reason: Reason) -> None:
        """An admitted request that did not start in time: the server answers 503."""
        self._log(("abort", self.clock.now_s, request_id))
        self.scheduler.abort(request_id)
        self.host.end(request_id, "timed_out", 503, reason)

    def _finish_step(self) -> None:
        now = self.clock.now_s
        out, shape = self.in_flight, self.in_flight_shape
        assert out is not None and shape is not None
        sampled = {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples}
        if self.trace is not None:
            self.trace.append(("update", now))
        accepted = None if self.drafts is None else self.drafts.judge(out)
        progressed = self.scheduler.update(out, sampled, accepted)
        step_s = now - self.step_started_s
        self.num_steps += 1
        self.busy_s += step_s
        if self.admission is not None:
            # The step's decode sequences and prefill tokens, by the one
            # rule (ScheduledChunk.is_decode) chunk_shape counts them with.
            self.admission.on_step_end(shape.num_decode_seqs, shape.num_prefill_tokens, step_s)
        for request in progressed:
            if request.is_finished:
                self.host.end(request.request_id, "success", 200, None)
                if self.drafts is not None:
                    self.drafts.forget(request.request_id)
        if self.drafts is not None:
            self.proposer_s = self.drafts.propose(self.scheduler)
        self.in_flight = None
        self._start_step()

    # -- decode runs (multi-step fast forward) --------------------------------
    def _start_run(self) -> bool:
        """Start a decode run of at least two steps, if the batch is steady.
        Valid with admission on because, with nothing waiting, no admitted
        request is unstarted (nothing expires, no queued prefix hit needs
        re-reading after an eviction), and the step limits give
        every running request its decode token (the budget only grows as
        the batch shrinks), so the steps skip no before_step's effect."""
        if self.run is not None and self._continue_run():
            return True
        run = plan_decode_run(self.scheduler, self.run_lengths.steps_planned, SIM_TOKEN_ID)
        if run is None or run.num_steps < 2:
            return False
        self.num_decode_runs += 1
        now = self.clock.now_s
        self.run = ActiveRun(run, now, decode_step_ends_s(self.cost_model, now,
                                                          run.step_shapes(0, self.run_lengths.steps_timed)))
        self._schedule_run_step(0)
        self.host.push_step_done(self, self.run.end_times[-1])
        return True

    def _continue_run(self) -> bool:
        """After a joined step (_finish_joined_step): the run goes on with the
        requests it started (DecodeRun.extend), instead of a new plan of the
        whole batch, when the batch is steady and at least two planned steps
        are left. Otherwise the run closes (False)."""
        active = self.run
        assert active is not None
        run, step = active.run, active.next_update
        if run.extend(step) and run.num_steps - step >= 2:
            end_times = active.end_times
            del end_times[step:]
            end_times += decode_step_ends_s(self.cost_model, end_times[-1],
                                            run.step_shapes(step, step + self.run_lengths.steps_timed))
            active.last_step, active.first_step = run.num_steps - 1, step
            self._schedule_run_step(step)
            self.host.push_step_done(self, end_times[-1])
            return True
        run.close()
        self.run = None
        return False

    def _schedule_run_step(self, step: int) -> None:
        assert self.run is not None
        run = self.run.run
        run.schedule_step(step)
        if self.trace is not None:
            self._log_schedule([(r.request_id, start, 1, True) for r, start in run.batch_at(step)], [])

    def _update_run_steps(self, last: int) -> None:
        """Apply the run's updates up to step `last`, each at its own time, as
        _finish_step would, then schedule the next step. Untraced (the hot
        loop of an hour-long simulation) the run applies them in one call;
        traced, step by step, logging the single steps the run stands for."""
        if self.trace is None:
            self._apply_run_steps(last)
            return
        active, clock, admission, trace = self.run, self.clock, self.admission, self.trace
        assert active is not None
        run, end_times = active.run, active.end_times
        step = active.next_update
        started_s = active.step_started_s(step)
        for step in range(step, last + 1):
            now = end_times[step]
            clock.advance_to(now)
            trace.append(("update", now))
            finished = run.update_step(step, now)
            active.next_update = step + 1
            step_s = now - started_s
            started_s = now
            self.num_steps += 1
            self.busy_s += step_s
            if admission is not None:
                admission.on_step_end(run.num_seqs[step], 0, step_s)
            for request in finished:
                self.host.end(request.request_id, "success", 200, None)
            if step < active.last_step:
                self._schedule_run_step(step + 1)

    def _apply_run_steps(self, last: int) -> None:
        """_update_run_steps without a trace: the run applies its steps with
        events in one call, the step accounting and the admission loop's
        step measurements take the stretch's step times at once (the same
        sums, in step order), and each finish is reported at its step's end
        as a single step would."""
        active, admission = self.run, self.admission
        assert active is not None
        run, end_times = active.run, active.end_times
        first = active.next_update
        finished = run.apply_steps(last, end_times, active.last_step)
        active.next_update = last + 1
        starts = end_times[first - 1:last] if first else [active.started_s, *end_times[:last]]
        steps_s = list(map(operator.sub, end_times[first:last + 1], starts))
        self.busy_s = functools.reduce(operator.add, steps_s, self.busy_s)
        self.num_steps += last + 1 - first
        if admission is not None:
            admission.on_steps_end(zip(run.num_seqs[first:last + 1], itertools.repeat(0), steps_s))
        for step, request in finished:
            self.clock.advance_to(end_times[step])
            self.host.end(request.request_id, "success", 200, None)
        self.clock.advance_to(end_times[last])

    def _end_run_after_in_flight(self) -> None:
        """Before a request is added: the run ends with the step in flight
        (adding only queues the request; the step after sees it)."""
        active = self.run
        if active is None or active.last_step == active.next_update:
            return
        step = active.last_step = active.next_update
        self.run_lengths.record(step + 1 - active.first_step, True)
        self.host.push_step_done(self, active.end_times[step])

    def _end_run_early(self) -> None:
        """Before an abort changes the replica's batch: its run's in-flight
        step becomes an ordinary in-flight step."""
        active = self.run
        if active is None:
            return
        step = active.next_update
        out = active.run.in_flight_output(step)
        if self.in_flight is None:
            self.run_lengths.record(step + 1 - active.first_step, True)
        else:  # a joined step (_join_waiting): the started requests' chunks follow the decodes
            out.chunks += self.in_flight.chunks
            out.num_batched_tokens += self.in_flight.num_batched_tokens
        self.in_flight = out
        self.in_flight_shape = chunk_shape(out.chunks)
        self.step_started_s = active.step_started_s(step)
        self.run = None
        self.host.push_step_done(self, active.end_times[step])

    def _finish_run(self) -> None:
        if self.in_flight is not None:
            self._finish_joined_step()
            return
        active = self.run
        assert active is not None
        if active.last_step >= len(active.end_times):
            self._time_more_run_steps()
            return
        run = active.run
        if active.last_step == run.num_steps - 1:
            self.run_lengths.record(run.num_steps - active.first_step, False)
        if active.next_update <= active.last_step:
            self._update_run_steps(active.last_step)
        if self._join_waiting():
            return
        run.close()
        self.run = None
        self._start_step()

    def _time_more_run_steps(self) -> None:
        """The end of the last step whose end time is known, inside the run:
        the next stretch of end times. A run's steps are timed a stretch at
        a time (a cost-model call per step), as most runs end early, at the
        next arrival. The end times are those of timing all steps at once
        (each adds its step time to the previous end)."""
        active = self.run
        assert active is not None
        end_times = active.end_times
        known = len(end_times)
        end_times += decode_step_ends_s(self.cost_model, end_times[-1],
                                        active.run.step_shapes(known, known + self.run_lengths.steps_timed))
        self.host.push_step_done(self, end_times[-1])

    def _join_waiting(self) -> bool:
        """After a run step that requests arrived during: the next step is
        the ordinary step that starts them beside the decodes (schedule()
        gives every decode its token first), run as one more step of the
        run with the started requests' chunks beside it, so that the
        decodes need no schedule() / update() of their own. What single
        steps do at that step's start happens here too (before_step,
        on_scheduled). False, with no change but those, when the step is
        not one the run can take: untraced runs only (a trace logs the
        single steps), the step must lie inside the run, someone must be
        waiting, and the token budget must hold every decode."""
        active, scheduler = self.run, self.scheduler
        assert active is not None
        run, step = active.run, active.last_step + 1
        if self.trace is not None or step >= run.num_steps or not len(scheduler.waiting):
            return False
        now = self.clock.now_s
        if self.admission is not None:
            scheduler.set_step_limits(*self.admission.before_step(len(scheduler.running), self._expire, scheduler))
        out = run.schedule_step_with_waiting(step)
        if out is None:
            return False
        self.num_joined_steps += bool(out.chunks)
        if self.admission is not None:
            self.admission.on_scheduled(out.started_ids, out.scheduled_at)
        # chunk_shape of the whole step: the run's decodes (each reads its
        # context + 1 tokens and, computing one query, attends as many
        # pairs) beside the started requests' chunks.
        (num_seqs, kv_tokens), = run.step_shapes(step, step + 1)
        started = chunk_shape(out.chunks)
        shape = StepShape(started.num_prefill_tokens, started.num_decode_seqs + num_seqs,
                          started.kv_tokens_read + kv_tokens, started.attention_pairs + kv_tokens)
        end_s = now + step_time_at_s(self.cost_model, shape, now)
        self.in_flight, self.in_flight_shape = out, shape
        self.step_started_s = now
        active.last_step = step
        del active.end_times[step:]
        active.end_times.append(end_s)
        self.host.push_step_done(self, end_s)
        return True

    def _finish_joined_step(self) -> None:
        """The end of a step _join_waiting started: what _finish_step does
        for it, the decodes' part applied by the run."""
        active, out, shape = self.run, self.in_flight, self.in_flight_shape
        assert active is not None and out is not None and shape is not None
        step = active.last_step
        now = active.end_times[step]
        finished = active.run.apply_steps(step, active.end_times, step)  # the decodes' updates first
        active.next_update = step + 1
        self.clock.advance_to(now)
        progressed = self.scheduler.update(out, {c.request.request_id: SIM_TOKEN_ID
                                                 for c in out.chunks if c.samples})
        step_s = now - self.step_started_s
        self.num_steps += 1
        self.busy_s += step_s
        if self.admission is not None:
            self.admission.on_step_end(shape.num_decode_seqs, shape.num_prefill_tokens, step_s)
        for _, request in finished:
            self.host.end(request.request_id, "success", 200, None)
        for request in progressed:
            if request.is_finished:
                self.host.end(request.request_id, "success", 200, None)
        self.in_flight = None
        self._start_step()  # continues the run, or closes it (_start_run)
