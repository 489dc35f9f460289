"""Iteration-level (continuous) batching with chunked prefill and preemption
by recompute.

Each step builds one forward pass under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`), both
lowered at run time by `set_step_limits` (the lowered token budget can be
limited to steps that decode someone, decided as the step is built):
1. running requests that decode get their one token first, most urgent first;
2. running requests part-way through their prompt continue their chunk;
3. waiting requests start in policy order (scheduler/policy.py), their
   prompt chunked to what budget is left, so a long prompt never stalls decode.

When the KV cache has no room for a running request, the scheduler preempts
the lowest-priority, latest-arrived running request not yet scheduled this
step (possibly the one asking): its blocks are freed and it returns to the
front of its class's waiting queue; prefix-cache hits may restore part of its
work when it resumes. Waiting requests never preempt running ones.

Multi-step decode (`plan_decode_run` -> `DecodeRun`): a steady pure-decode
batch advances several steps with Python work per block boundary and per
finish instead of per sequence per step, leaving the same state as single
steps. The simulator uses it (every step samples one known token); the
engine keeps schedule() / update().

Pure Python: the clock is injected, no torch.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.contract import Request, RequestStatus
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.scheduler.policy import WaitingQueue


class ScheduledChunk(NamedTuple):
    """Tokens of one request to run in this step (a NamedTuple: built for
    every running request every step, so construction must be cheap)."""

    request: Request
    start: int  # position of the first token run (= num_computed_tokens before the step)
    num_new_tokens: int
    # The request's block table: position p lives in slot
    # block_ids[p // block_size] * block_size + p % block_size. Read-only.
    block_ids: list[int]
    # The chunk reaches the request's last known token, so the model's output
    # at its last position is sampled (False mid-prefill). Fixed at schedule
    # time: update() appends a token and changes the request's length.
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token on top of computed context. Defined by the step's
        cost shape, not by why the token runs: the last token of a prompt or
        of a recompute costs what a generated token's step does. Everything
        else (prefill, chunks of it, recompute after preemption) is prefill.
        The server, the simulator and the cost model all use this one rule."""
        return self.num_new_tokens == 1 and self.start > 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished while scheduling (one that outgrew the whole KV cache);
    # the engine reports them like any other finish.
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if not c.is_decode)


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens


# Sort key of running requests: most urgent first; the last is the
# preemption victim. (A C-level getter: it runs for every running request
# at every step.)
_urgency = operator.attrgetter("priority", "arrival_time")
# Final: the compiled core (kvserve/compiled) reads it without a module dict lookup.
_RUNNING: Final = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = scheduler_config
        self.clock = clock
        self.kv_cache = KVCacheManager(cache_config)
        self.waiting = WaitingQueue(scheduler_config.aging_s_per_priority)
        self.running: dict[str, Request] = {}  # insertion-ordered
        self._requests: dict[str, Request] = {}  # every unfinished request
        self.max_running = scheduler_config.max_num_seqs
        self.max_batched_tokens = scheduler_config.max_num_batched_tokens
        self.cap_idle_steps = True
        self.num_preemptions = 0

    # -- requests in and out ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it can never run here."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; this model's context is "
                f"{self.config.max_model_len} tokens including at least one output token")
        if self.kv_cache.blocks_for_tokens(request.num_tokens + 1) > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens cannot fit the KV cache "
                f"({self.kv_cache.num_blocks} blocks of {self.kv_cache.block_size} tokens)")
        request.status = RequestStatus.WAITING
        request.timestamps.queued = self.clock()
        self._requests[request.request_id] = request
        self.waiting.add(request)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def set_step_limits(self, max_running: int, max_batched_tokens: int | None,
                        cap_idle_steps: bool = True) -> None:
        """Cap the running batch below max_num_seqs and the tokens of one step
        below max_num_batched_tokens (None: the config's); admission uses this
        to keep step time inside the TPOT target. Running requests above a
        lowered cap are not evicted; no new ones start until below it. The
        token cap covers the whole step, decodes first.

        cap_idle_steps False: the token cap binds only a step that decodes
        some request; a step with none (nothing runs, or every running
        request is part-way through its prompt) delays no one's next token
        and takes the config's budget, so a lone prompt is not chunked.
        Decided here, as the step is built: limits set from the previous
        step's report arrive a step late, and an idle budget still in force
        when the first decode appears would stretch that decode's step."""
        self.max_running = max(1, min(max_running, self.config.max_num_seqs))
        limit = self.config.max_num_batched_tokens
        self.max_batched_tokens = limit if max_batched_tokens is None else max(1, min(max_batched_tokens, limit))
        self.cap_idle_steps = cap_idle_steps

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (abort, stop string): its KV is freed at
        once, in any state. None if unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.request_id not in self.running:
            self.waiting.remove(request)
        self._finish(request, status, self.clock())
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              kv.usage(), kv.prefix_cache_queries, kv.prefix_cache_hits)

    # -- the step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch; allocates KV for every scheduled token."""
        now = self.clock()
        out = SchedulerOutput()
        budget = self._schedule_running(out, now)
        self._schedule_waiting(out, budget, now)
        out.num_batched_tokens = sum(c.num_new_tokens for c in out.chunks)
        return out

    def _schedule_running(self, out: SchedulerOutput, now: float) -> int:
        # Runs over every running request at every step (the server's hot
        # path): len()s instead of the num_tokens property, locals.
        running, kv, chunks = self.running, self.kv_cache, out.chunks
        by_urgency = sorted(running.values(), key=_urgency)
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for request in by_urgency:
            remaining = len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens
            (decodes if remaining == 1 else prefills).append((request, remaining))
        budget = self.max_batched_tokens if decodes or self.cap_idle_steps else self.config.max_num_batched_tokens
        unscheduled = list(by_urgency)  # victims come from its tail
        done: set[str] = set()
        for request, remaining in itertools.chain(decodes, prefills):
            if budget == 0:
                break
            rid = request.request_id
            if rid not in running:
                continue  # preempted earlier in this step
            num_new = remaining if remaining < budget else budget
            if kv.allocate_slots(request, num_new) is None and \
                    not self._preempt_until_allocated(request, num_new, unscheduled, done, out, now):
                continue
            done.add(rid)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new, kv.block_ids(rid),
                                         num_new == remaining))
            budget -= num_new
        return budget

    def _preempt_until_allocated(self, request: Request, num_new: int, unscheduled: list[Request],
                                 done: set[str], out: SchedulerOutput, now: float) -> bool:
        """After `request` found no room for `num_new` tokens: preempt
        victims until its allocation fits. False if the request itself had
        to go."""
        while True:
            victim = self._pick_victim(unscheduled, done)
            if victim is request and len(self.running) == 1:
                # Alone and still out of room: it has outgrown the whole cache.
                self._finish(request, RequestStatus.FINISHED_LENGTH, now)
                out.finished.append(request)
                return False
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
            if self.kv_cache.allocate_slots(request, num_new) is not None:
                return True

    def _pick_victim(self, by_urgency: list[Request], done: set[str]) -> Request:
        """Lowest-priority, latest-arrived running request not scheduled this step."""
        while by_urgency:
            candidate = by_urgency.pop()
            if candidate.request_id in self.running and candidate.request_id not in done:
                return candidate
        raise AssertionError("no preemption victim: the asking request is always a candidate")

    def _preempt(self, request: Request) -> None:
        del self.running[request.request_id]
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while budget > 0 and len(self.running) < self.max_running:
            request = self.waiting.peek(now)
            if request is None:
                break
            computed = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, computed) is None:
                break  # head-of-line waits: skipping it for smaller requests would starve it
            self.waiting.pop(request)
            self._start(request, computed.num_tokens, now)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, num_new, self.kv_cache.block_ids(request.request_id),
                              samples=start + num_new == request.num_tokens)

    def _start(self, request: Request, num_cached_tokens: int, now: float) -> None:
        request.num_computed_tokens = num_cached_tokens
        if request.timestamps.scheduled is None:
            request.timestamps.scheduled = now
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request

    def plan_decode_run(self, max_steps: int, token_id: int) -> DecodeRun | None:
        """Up to `max_steps` decode steps of the running batch as one
        `DecodeRun`, when every step samples `token_id` and nothing inside
        the scheduler can change those steps' decisions: no request waits
        (none could start), every running request decodes (no prefill
        left), the token budget holds the whole batch, and each step's new
        blocks surely fit (the run stops before the first step that might
        preempt). The caller must keep each step's token budget >= the
        running batch, must not abort a request or change limits during the
        run (end it first with `in_flight_output`), and after adding a
        request must end the run with the step in flight (`update_step`,
        then `close`): adding only queues it. None when not steady. No
        state change."""
        if max_steps < 1 or not self.running or len(self.waiting) \
                or len(self.running) > self.max_batched_tokens:
            return None
        batch = sorted(self.running.values(), key=_urgency)
        starts = [r.num_computed_tokens for r in batch]
        # Steady: each request has only its last sampled token left to run
        # (list comparisons in C: this runs at every step start).
        if [len(r.prompt_token_ids) + len(r.output_token_ids) for r in batch] != [s + 1 for s in starts]:
            return None
        run = DecodeRun(self, batch, starts, token_id, max_steps)
        return run if run.num_steps > 0 else None

    def _steps_until_stop(self, request: Request, token_id: int) -> int:
        """Decode steps until `request` stops when every step samples
        `token_id`: the first count at which `_stop_status` (the same three
        rules, in closed form) returns a status."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        steps = min(params.max_tokens - num_output,
                    self.config.max_model_len - len(request.prompt_token_ids) - num_output)
        if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            steps = min(steps, params.min_tokens - num_output)
        return max(1, steps)

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]) -> list[Request]:
        """Apply a step's results: advance progress, append sampled tokens, finish
        and free requests that stop. Returns the requests that received a token."""
        now = self.clock()
        progressed = []
        kv_cache = self.kv_cache
        for chunk in output.chunks:  # every running request, every step: locals, no properties
            request = chunk.request
            if request.status != _RUNNING:
                continue  # finished from outside between schedule and update
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            kv_cache.cache_computed_blocks(request)  # a direct call when compiled (kvserve/compiled)
            if not chunk.samples:
                continue
            token_id = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token_id)
            stamps = request.timestamps
            if stamps.first_token is None:
                stamps.first_token = now
            stamps.token_times.append(now)
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status, now)
            progressed.append(request)
        return progressed

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        # Runs for every decoding request every step: plain len() calls, no properties.
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.prompt_token_ids) + num_output >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.timestamps.finished = now
        self.running.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self.kv_cache.free(request)


def _key_stride(num_requests: int) -> int:
    """The N of a decode run's event keys for `num_requests` requests: room
    for as many newcomers again, so `extend` appends the keys of requests
    joining the run and renumbers the others only when the run's requests
    outgrow it (a Python pass over every key)."""
    return 2 * num_requests


class DecodeRun:
    """Several consecutive steps of an unchanging pure-decode batch, applied
    with Python work per event (a block boundary, a finish) instead of per
    running request per step: vLLM's multi-step scheduling, for callers that
    know every step samples the same token (the simulator).

    Made only by `Scheduler.plan_decode_run`, when nothing can change the
    next `num_steps` decisions. Drive it as the engine drives a step, in
    order, for i = 0, 1, ...: `schedule_step(i)` when step i starts, then
    `update_step(i, now)` when it ends. After each call the KV cache (block
    tables, prefix-cache registrations, free and evictable blocks), the
    running set and every finished request are exactly what schedule() /
    update() would have left. `apply_steps` does the same for a stretch of
    steps whose end times are known, visiting only the steps with events.
    The progress of a request with no finish in a step (num_computed_tokens,
    output tokens, token timestamps) lags until `in_flight_output` or
    `close` brings every request up to date; a block it completes is
    registered without it, since the block's tokens past the request's
    known ones are all the run's token.

    Requests that arrive end the batch's steadiness, not the run: the step
    after their arrival can start them beside the run's decodes
    (`schedule_step_with_waiting`, then the ordinary update() for their
    chunks), and once they decode `extend` takes them into the run, which
    goes on without a new plan of the whole batch.

    The events are one sorted list of integer keys, built from ranges (no
    Python loop per event while planning): with N above every request's
    index, request i's allocation for step s is key (2s - 1) * N + i, its
    update at step s (a completed block, a finish) key 2s * N + i.
    Ascending keys are the order single steps run them in: schedule(s)
    allocates in batch order, update(s) registers and finishes in batch
    order, then schedule(s + 1).
    """

    def __init__(self, scheduler: Scheduler, batch: list[Request], starts: list[int], token_id: int,
                 max_steps: int) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv_cache
        self._token_id = token_id
        self.requests = batch  # schedule()'s chunk order: most urgent first
        self._start = starts  # each request's num_computed_tokens when the run starts
        self._synced = [0] * len(batch)  # steps applied to each request's fields
        self.end_times: list[float] = []  # of the steps updated so far
        # Per request: the step that ends it (may lie past the run).
        self._last_step = [scheduler._steps_until_stop(r, token_id) - 1 for r in batch]
        self._events: list[int] = []  # ascending keys (see the class docstring)
        self._n = _key_stride(len(batch))  # the N of the keys
        # Blocks each request finishing inside the run surely frees: only its
        # blocks from this run are surely its alone (shared prefix blocks
        # may stay held), a lower bound.
        self._freed = [0] * len(batch)
        self._num_allocations = 0  # allocation events planned (at least those left)
        max_steps = min(max_steps, max(self._last_step) + 1)  # no step after the batch is done
        self._add_events(range(len(batch)), 0, max_steps)
        self._events.sort()
        self.num_steps = self._steps_that_fit(max_steps)
        self._finish_steps = sorted(last for last in self._last_step if last < self.num_steps)
        # Per step: decoding sequences (step_shapes adds the KV tokens read).
        self.num_seqs: list[int] = []
        self._stretches: list[tuple[int, int, int, int]] = []  # (first, last step, sequences, context)
        self._describe_steps(0)

    def _add_events(self, indexes: range, first_step: int, max_steps: int) -> None:
        """Append the events of requests `indexes` from step `first_step` to
        the run's last (max_steps - 1), unsorted: C-level ranges of keys."""
        kv, n, events = self._kv, self._n, self._events
        block_size, caching = kv.block_size, kv.enable_prefix_caching
        stride = 2 * n * block_size  # between one request's events block_size steps apart
        for index in indexes:
            start, last_step = self._start[index], self._last_step[index]
            last = min(last_step, max_steps - 1)
            # Step i runs position start + i: it needs a new block when that
            # position passes the blocks held, then every block_size steps.
            first = max(first_step, kv.num_held_blocks(self.requests[index].request_id) * block_size - start)
            allocations = range((2 * first - 1) * n + index, (2 * last - 1) * n + index + 1, stride)
            events += allocations
            self._num_allocations += len(allocations)
            last_update = 2 * last * n + index
            completes_last = False
            if caching:  # step i completes a block when start + i + 1 is a multiple
                first_completion = first_step + (-(start + first_step + 1)) % block_size
                completions = range(2 * first_completion * n + index, last_update + 1, stride)
                events += completions
                completes_last = bool(completions) and completions[-1] == last_update
            if last_step < max_steps:
                if not completes_last:
                    events.append(last_update)
                self._freed[index] = len(allocations)

    def _steps_that_fit(self, max_steps: int) -> int:
        """How many steps surely fit the KV cache, cutting the events past
        them: the run stops before the first step whose new blocks might
        not fit, so a preemption still happens in an ordinary step."""
        available = self._kv.num_free_blocks
        if self._num_allocations <= available:
            return max_steps  # frees only add: every step fits
        events, n, last_steps = self._events, self._n, self._last_step
        for key in events:
            step2 = key // n  # divmod(), without its tuple (native ints when compiled)
            index = key - step2 * n
            if step2 & 1:  # an allocation for step (step2 + 1) / 2
                if available == 0:
                    num_steps = (step2 + 1) >> 1
                    del events[bisect.bisect_left(events, (2 * num_steps - 1) * n):]
                    return num_steps
                available -= 1
            elif last_steps[index] == step2 >> 1:  # a finish frees its blocks after the step
                available += self._freed[index]
        return max_steps

    def _describe_steps(self, first_step: int) -> None:
        """num_seqs and the stretches of steps with an unchanged batch (from
        which step_shapes derives each step's KV read), from `first_step`."""
        num_steps = self.num_steps
        active = [(last, start) for last, start in zip(self._last_step, self._start) if last >= first_step]
        num_active, context = len(active), sum(start for _, start in active)
        ending = sorted(pair for pair in active if pair[0] < num_steps)
        del self.num_seqs[first_step:]
        self._stretches = []
        first = first_step  # the first step not yet described
        for last, start in ending + [(num_steps - 1, 0)]:
            if last >= first:  # steps first..last run `num_active` sequences
                self.num_seqs += [num_active] * (last + 1 - first)
                self._stretches.append((first, last, num_active, context))
                first = last + 1
            num_active -= 1
            context -= start

    def extend(self, step: int) -> bool:
        """Continue the run at step `step` (the steps before it updated) with
        the running batch, as plan_decode_run would plan it at that step,
        keeping the events planned for the run's own requests: requests
        started beside the step before (schedule_step_with_waiting) that
        now decode join the run. Their events stop at the run's last step;
        the run may end sooner, before a step whose blocks might not fit.
        False, with no change, when plan_decode_run would not plan the
        batch, or the newcomers are not the least urgent (they join at the
        end of the run's order)."""
        scheduler = self._scheduler
        if step >= self.num_steps or len(scheduler.waiting) or \
                len(scheduler.running) > scheduler.max_batched_tokens:
            return False
        batch = sorted(scheduler.running.values(), key=_urgency)
        staying = [r for r, last in zip(self.requests, self._last_step) if last >= step]
        new = batch[len(staying):]
        if batch[:len(staying)] != staying or any(
                len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens != 1 for r in new):
            return False
        events, n = self._events, self._n
        del events[:bisect.bisect_left(events, (2 * step - 1) * n)]  # applied already
        if len(self.requests) + len(new) > n:  # out of indexes: each key q * N + i becomes q * N' + i
            stride = _key_stride(len(self.requests) + len(new))
            events[:] = [key + (key // n) * (stride - n) for key in events]
            self._n = stride
        first_new = len(self.requests)
        self.requests += new
        self._start += [r.num_computed_tokens - step for r in new]  # position at step s = start + s
        self._synced += [step] * len(new)  # up to date: update() ran their last step
        self._last_step += [step + scheduler._steps_until_stop(r, self._token_id) - 1 for r in new]
        self._freed += [0] * len(new)
        self._add_events(range(first_new, len(self.requests)), step, self.num_steps)
        events.sort()
        self.num_steps = self._steps_that_fit(self.num_steps)
        self._finish_steps = sorted(last for last in self._last_step if step <= last < self.num_steps)
        self._describe_steps(step)
        return True

    def step_shapes(self, first: int, stop: int) -> list[tuple[int, int]]:
        """(decoding sequences, KV tokens read) of steps first..stop - 1 (up
        to the run's last): a request at context c reads c + 1 tokens and
        computes one query over them. Built on demand: a run is planned
        longer than most runs last."""
        shapes: list[tuple[int, int]] = []
        stretches = self._stretches
        # The stretch holding step `first` (stretches start at 0 and follow each other).
        index = bisect.bisect_right(stretches, (first, self.num_steps)) - 1
        while first < stop and index < len(stretches):
            _, stretch_last, active, context = stretches[index]
            end = min(stop, stretch_last + 1)
            shapes += zip([active] * (end - first),
                          range(context + active * (first + 1), context + active * end + 1, active))
            first, index = end, index + 1
        return shapes

    def num_finishing(self, first: int, last: int) -> int:
        """How many requests steps first..last finish (no state change): a
        caller can know the running count after those steps without
        applying them."""
        return bisect.bisect_right(self._finish_steps, last) - bisect.bisect_left(self._finish_steps, first)

    def batch_at(self, step: int) -> list[tuple[Request, int]]:
        """(request, first position run) of every request in step `step`."""
        return [(r, self._start[i] + step) for i, r in enumerate(self.requests) if self._last_step[i] >= step]

    def schedule_step(self, step: int) -> None:
        """Allocate the blocks step `step` needs (what schedule() does for it)."""
        events, n = self._events, self._n
        base = (2 * step - 1) * n
        for position in range(bisect.bisect_left(events, base), bisect.bisect_left(events, base + n)):
            self._allocate(events[position] - base)

    def schedule_step_with_waiting(self, step: int) -> SchedulerOutput | None:
        """Step `step` as schedule() builds it while requests wait: the
        run's decodes take their tokens first (schedule_step), then waiting
        requests start, in policy order, in the token budget the decodes
        leave. Returns the chunks of the requests started; the decodes stay
        in the run, which ends with this step: update it (update_step or
        apply_steps), pass the returned output to the ordinary update(),
        then close. None, with no change, when the budget cannot hold every
        decode (schedule() would leave some out) or the step lies past the
        run. The caller sets the step's limits first, as for schedule()."""
        scheduler = self._scheduler
        if step >= self.num_steps or scheduler.max_batched_tokens < self.num_seqs[step]:
            return None
        self.schedule_step(step)
        out = SchedulerOutput()
        scheduler._schedule_waiting(out, scheduler.max_batched_tokens - self.num_seqs[step], scheduler.clock())
        out.num_batched_tokens = sum(c.num_new_tokens for c in out.chunks)
        return out

    def update_step(self, step: int, now: float) -> list[Request]:
        """Apply step `step`'s results at `now` (what update() does for it):
        register completed blocks, finish requests that stop. Returns the
        requests finished, in batch order."""
        if len(self.end_times) != step:
            raise ValueError(f"update_step({step}) after {len(self.end_times)} updated steps")
        self.end_times.append(now)
        events, n = self._events, self._n
        base = 2 * step * n
        finished = []
        for position in range(bisect.bisect_left(events, base), bisect.bisect_left(events, base + n)):
            request = self._update(events[position] - base, step, now)
            if request is not None:
                finished.append(request)
        return finished

    def apply_steps(self, last: int, end_times: list[float], last_scheduled: int) -> list[tuple[int, Request]]:
        """Update the steps after those updated so far through `last`, step i
        ending at end_times[i], scheduling step i + 1 after each update while
        i < `last_scheduled`: the same as update_step(i, end_times[i]) then
        schedule_step(i + 1) for each i, with Python work only for the
        events. The caller has called schedule_step for the first of them.
        Returns (step, request) of the requests finished, in order."""
        first = len(self.end_times)
        if last < first:
            return []
        self.end_times.extend(end_times[first:last + 1])
        events, n = self._events, self._n
        # Step first's allocations are done; the next step's only if scheduled.
        lo = bisect.bisect_left(events, 2 * first * n)
        hi = bisect.bisect_left(events, (2 * last + (2 if last < last_scheduled else 1)) * n, lo)
        finished = []
        # _allocate and _update inline (the hot loop of a simulated hour).
        requests, starts, last_steps = self.requests, self._start, self._last_step
        kv = self._kv  # its methods called through it: direct calls when compiled (kvserve/compiled)
        token_id = self._token_id
        for key in events[lo:hi]:
            step2 = key // n  # divmod(), without its tuple (native ints when compiled)
            index = key - step2 * n
            if step2 & 1:  # the allocation for step (step2 + 1) / 2: one new block
                if kv.append_block(requests[index].request_id) is None:
                    raise AssertionError("a planned decode step ran out of KV blocks")
            elif last_steps[index] != step2 >> 1:  # a completed block
                kv.cache_next_block(requests[index], starts[index] + (step2 >> 1) + 1, token_id)
            else:
                step = step2 >> 1
                finished.append((step, self._finish_request(index, step, end_times[step])))
        return finished

    def _allocate(self, index: int) -> None:
        # Planned where the step's position enters a new block: one block
        # (what allocate_slots gives, without reading the lagging request).
        if self._kv.append_block(self.requests[index].request_id) is None:
            raise AssertionError("a planned decode step ran out of KV blocks")

    def _update(self, index: int, step: int, now: float) -> Request | None:
        """Request `index`'s event at the end of step `step`: register its
        completed block (its tokens past the request's known ones are all
        the run's token), or bring it up to date and finish it. Returns it
        when it finished."""
        if self._last_step[index] != step:
            self._kv.cache_next_block(self.requests[index], self._start[index] + step + 1, self._token_id)
            return None
        return self._finish_request(index, step, now)

    def _finish_request(self, index: int, step: int, now: float) -> Request:
        """Request `index` stops at the end of step `step`, its last."""
        request = self.requests[index]
        self._sync(index, step + 1)
        self._kv.cache_computed_blocks(request)
        status = self._scheduler._stop_status(request, self._token_id)
        if status is None:
            raise AssertionError(f"{request.request_id} planned to stop at step {step} but does not")
        self._scheduler._finish(request, status, now)
        return request

    def in_flight_output(self, step: int) -> SchedulerOutput:
        """End the run early after schedule_step(step): bring every request up
        to date and return the step's output for the ordinary update()."""
        out = SchedulerOutput()
        for index, request in enumerate(self.requests):
            if request.status == RequestStatus.RUNNING:
                self._sync(index, step)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1,
                                                 self._kv.block_ids(request.request_id), True))
        out.num_batched_tokens = len(out.chunks)
        return out

    def close(self) -> None:
        """After the last update_step: bring every request up to date."""
        # _sync of every running request, inline: once per run and request.
        end_times, synced, token_id = self.end_times, self._synced, self._token_id
        num_steps = len(end_times)
        for index, request in enumerate(self.requests):
            done = synced[index]
            if done == num_steps or request.status != _RUNNING:
                continue
            times = end_times[done:]
            request.num_computed_tokens += num_steps - done
            request.output_token_ids += [token_id] * (num_steps - done)
            stamps = request.timestamps
            if stamps.first_token is None:
                stamps.first_token = times[0]
            stamps.token_times += times
            synced[index] = num_steps

    def _sync(self, index: int, num_steps: int) -> None:
        """Apply the first `num_steps` steps' tokens to request `index`."""
        done = self._synced[index]
        if num_steps <= done:
            return
        request = self.requests[index]
        times = self.end_times[done:num_steps]
        request.num_computed_tokens += num_steps - done
        request.output_token_ids += [self._token_id] * (num_steps - done)
        stamps = request.timestamps
        if stamps.first_token is None:
            stamps.first_token = times[0]
        stamps.token_times += times
        self._synced[index] = num_steps
