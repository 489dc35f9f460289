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

Pure Python: the clock is injected, no torch.
"""

from __future__ import annotations

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
            if token_id == request.eos_token_id and not params.ignore_eos:
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
