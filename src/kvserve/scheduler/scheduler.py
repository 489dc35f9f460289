"""Iteration-level (continuous) batching with chunked prefill and preemption
by recompute.

Each step builds one forward pass under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`), both
lowered at run time by `set_step_limits`:
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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

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


def _urgency(request: Request) -> tuple[int, float]:
    """Sort key of running requests: most urgent first; the last is the preemption victim."""
    return (request.priority, request.arrival_time)


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

    def set_step_limits(self, max_running: int, max_batched_tokens: int | None) -> None:
        """Cap the running batch below max_num_seqs and the tokens of one step
        below max_num_batched_tokens (None: the config's); admission uses this
        to keep step time inside the TPOT target. Running requests above a
        lowered cap are not evicted; no new ones start until below it. The
        token cap covers the whole step, decodes first."""
        self.max_running = max(1, min(max_running, self.config.max_num_seqs))
        limit = self.config.max_num_batched_tokens
        self.max_batched_tokens = limit if max_batched_tokens is None else max(1, min(max_batched_tokens, limit))

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
        budget = self.max_batched_tokens
        by_urgency = sorted(self.running.values(), key=_urgency)
        decodes, prefills = [], []
        for request in by_urgency:
            remaining = request.num_tokens - request.num_computed_tokens
            (decodes if remaining == 1 else prefills).append((request, remaining))
        unscheduled = list(by_urgency)  # victims come from its tail
        done: set[str] = set()
        for request, remaining in decodes + prefills:
            if budget == 0:
                break
            if request.request_id not in self.running:
                continue  # preempted earlier in this step
            num_new = min(remaining, budget)
            if not self._allocate_or_preempt(request, num_new, unscheduled, done, out, now):
                continue
            done.add(request.request_id)
            out.chunks.append(ScheduledChunk(
                request, request.num_computed_tokens, num_new,
                self.kv_cache.block_ids(request.request_id), num_new == remaining))
            budget -= num_new
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, unscheduled: list[Request],
                             done: set[str], out: SchedulerOutput, now: float) -> bool:
        """Allocate KV for `num_new` tokens, preempting victims until it fits.
        False if the request itself had to go."""
        while self.kv_cache.allocate_slots(request, num_new) is None:
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
        if any(r.num_tokens - r.num_computed_tokens != 1 for r in batch):
            return None
        run = DecodeRun(self, batch, token_id, max_steps)
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
        for chunk in output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # finished from outside between schedule and update
            request.num_computed_tokens = chunk.end
            self.kv_cache.cache_computed_blocks(request)
            if not chunk.samples:
                continue
            token_id = sampled_token_ids[request.request_id]
            self._append_token(request, token_id, now)
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status, now)
            progressed.append(request)
        return progressed

    @staticmethod
    def _append_token(request: Request, token_id: int, now: float) -> None:
        request.output_token_ids.append(token_id)
        stamps = request.timestamps
        if stamps.first_token is None:
            stamps.first_token = now
        stamps.token_times.append(now)

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
    steps whose end times are known, visiting only the steps with events. The progress of a request with no event in a
    step (num_computed_tokens, output tokens, token timestamps) lags until
    `in_flight_output` or `close` brings every request up to date.
    """

    def __init__(self, scheduler: Scheduler, batch: list[Request], token_id: int, max_steps: int) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv_cache
        self._token_id = token_id
        self.requests = batch  # schedule()'s chunk order: most urgent first
        self._start = [r.num_computed_tokens for r in batch]
        self._synced = [0] * len(batch)  # steps applied to each request's fields
        self.end_times: list[float] = []  # of the steps updated so far
        # Per request: the step that ends it (may lie past the run).
        self._last_step = [scheduler._steps_until_stop(r, token_id) - 1 for r in batch]
        self._allocations: dict[int, list[int]] = {}  # step -> request indexes needing a block
        self._updates: dict[int, list[int]] = {}  # step -> indexes that fill a block or finish
        self.num_steps = self._plan(max_steps)
        self.shapes = self._step_shapes()
        # Steps i whose update_step(i) or schedule_step(i + 1) does any work,
        # ascending: apply_steps visits only these.
        self._event_steps = sorted({i for i in self._updates if i < self.num_steps}
                                   | {i - 1 for i in self._allocations if 0 < i < self.num_steps})
        self._next_event = 0  # index into _event_steps of the first not yet applied
        self._finish_steps = sorted(last for last in self._last_step if last < self.num_steps)

    def _plan(self, max_steps: int) -> int:
        """Collect the steps' events; return how many steps surely fit the KV
        cache (stopping before the first step whose new blocks might not fit,
        so a preemption still happens in an ordinary step)."""
        max_steps = min(max_steps, max(self._last_step) + 1)  # no step after the batch is done
        kv, block_size = self._kv, self._kv.block_size
        caching = kv.enable_prefix_caching
        allocations, updates_at = self._allocations, self._updates  # run once per run and request: locals
        freed: dict[int, int] = {}
        for index, request in enumerate(self.requests):
            computed = self._start[index]
            last_step = self._last_step[index]
            last = min(last_step, max_steps - 1)
            held_tokens = kv.num_held_blocks(request.request_id) * block_size
            # Step i runs token computed + i: it needs a new block when that
            # position passes the blocks held, then every block_size steps.
            crossings = range(max(0, held_tokens - computed), last + 1, block_size)
            for i in crossings:
                if i in allocations:
                    allocations[i].append(index)
                else:
                    allocations[i] = [index]
            if caching:  # step i completes a block when computed + i + 1 is a multiple
                for i in range(-(computed + 1) % block_size, last + 1, block_size):
                    if i in updates_at:
                        updates_at[i].append(index)
                    else:
                        updates_at[i] = [index]
            if last_step < max_steps:
                updates = updates_at.setdefault(last, [])
                if not updates or updates[-1] != index:
                    updates.append(index)
                # Only its blocks from this run are surely its alone (shared
                # prefix blocks may stay held): a lower bound on what it frees.
                freed[last] = freed.get(last, 0) + len(crossings)
        available = self._kv.num_free_blocks
        # Only steps that allocate or free change the count (ascending order).
        for i in sorted(self._allocations.keys() | freed.keys()):
            need = len(self._allocations.get(i, ()))
            if need > available:
                return i
            available += freed.get(i, 0) - need
        return max_steps

    def _step_shapes(self) -> list[tuple[int, int]]:
        """(decoding sequences, KV tokens read) of each step: a request at
        context c reads c + 1 tokens and computes one query over them."""
        ending: dict[int, list[int]] = {}
        for index, last in enumerate(self._last_step):
            if last < self.num_steps:
                ending.setdefault(last, []).append(index)
        active, context = len(self.requests), sum(self._start)
        shapes = []
        for i in range(self.num_steps):
            shapes.append((active, context + active * (i + 1)))
            for index in ending.get(i, ()):
                active -= 1
                context -= self._start[index]
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
        synced = self._synced
        for index in self._allocations.get(step, ()):
            if synced[index] < step:
                self._sync(index, step)
            if self._kv.allocate_slots(self.requests[index], 1) is None:
                raise AssertionError("a planned decode step ran out of KV blocks")

    def update_step(self, step: int, now: float) -> list[Request]:
        """Apply step `step`'s results at `now` (what update() does for it):
        register completed blocks, finish requests that stop. Returns the
        requests finished, in batch order."""
        if len(self.end_times) != step:
            raise ValueError(f"update_step({step}) after {len(self.end_times)} updated steps")
        self.end_times.append(now)
        return self._update_events(step, now)

    def _update_events(self, step: int, now: float) -> list[Request]:
        finished = []
        synced = self._synced
        for index in self._updates.get(step, ()):
            request = self.requests[index]
            if synced[index] <= step:
                self._sync(index, step + 1)
            self._kv.cache_computed_blocks(request)
            if self._last_step[index] == step:
                status = self._scheduler._stop_status(request, self._token_id)
                if status is None:
                    raise AssertionError(f"{request.request_id} planned to stop at step {step} but does not")
                self._scheduler._finish(request, status, now)
                finished.append(request)
        return finished

    def apply_steps(self, last: int, end_times: list[float], last_scheduled: int) -> list[tuple[int, Request]]:
        """Update the steps after those updated so far through `last`, step i
        ending at end_times[i], scheduling step i + 1 after each update while
        i < `last_scheduled`: the same as update_step(i, end_times[i]) then
        schedule_step(i + 1) for each i, with Python work only for steps that
        have any. The caller has called schedule_step for the first of them.
        Returns (step, request) of the requests finished, in order."""
        first = len(self.end_times)
        if last < first:
            return []
        self.end_times.extend(end_times[first:last + 1])
        events, position = self._event_steps, self._next_event
        while position < len(events) and events[position] < first:
            position += 1  # stepped through update_step / schedule_step already
        finished = []
        while position < len(events) and events[position] <= last:
            step = events[position]
            position += 1
            for request in self._update_events(step, end_times[step]):
                finished.append((step, request))
            if step < last_scheduled:
                self.schedule_step(step + 1)
        self._next_event = position
        return finished

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
        for index, request in enumerate(self.requests):
            if request.status == RequestStatus.RUNNING:
                self._sync(index, len(self.end_times))

    def _sync(self, index: int, num_steps: int) -> None:
        """Apply the first `num_steps` steps' tokens to request `index`."""
        done = self._synced[index]
        if num_steps <= done:
            return
        request = self.requests[index]
        times = self.end_times[done:num_steps]
        request.num_computed_tokens += num_steps - done
        request.output_token_ids.extend([self._token_id] * (num_steps - done))
        stamps = request.timestamps
        if stamps.first_token is None:
            stamps.first_token = times[0]
        stamps.token_times.extend(times)
        self._synced[index] = num_steps
