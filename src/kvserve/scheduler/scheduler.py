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
   A request under a LoRA adapter that no running request uses starts only
   while fewer than `max_loras` adapters run (the runner's resident slots).

Speculative decoding: a decoding request that carries draft tokens
(`Request.spec_token_ids`, proposed after the previous step) asks for
1 + k tokens: its last token and the drafts, verified in the same forward
pass. The drafts count against the token budget and get KV slots for the
step; they are dropped (never preempting anyone) when the budget or the
cache has no room for them, and the slots of rejected drafts are released
in update(). Drafts never reach past the request's max_tokens or the
model's context, so lookahead never needs more KV than admission projected.

When the KV cache has no room for a running request, the scheduler preempts
the lowest-priority, latest-arrived running request not yet scheduled this
step (possibly the one asking): its blocks are freed and it returns to the
front of its class's waiting queue; prefix-cache hits may restore part of its
work when it resumes. Waiting requests never preempt running ones.

The KV cache manager is asked only its narrow questions: a prefix hit
(`get_computed_blocks`), room for a step's tokens (`allocate_slots` -> blocks
or None), `free`, the block table, and registering computed blocks.

Pure Python: the clock is injected, no torch.
"""

from __future__ import annotations

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
    # Draft tokens run after the request's last token (speculative decoding):
    # num_new_tokens = 1 + len(spec_token_ids), every position sampled.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token on top of computed context. Defined by the step's
        cost shape, not by why the token runs: the last token of a prompt or
        of a recompute costs what a generated token's step does. Everything
        else (prefill, chunks of it, recompute after preemption) is prefill.
        A chunk verifying k drafts is a decode too, its k drafts priced as
        prefill tokens (`SchedulerOutput.num_prefill_tokens`).
        The server, the simulator and the cost model all use this one rule."""
        return self.num_new_tokens == 1 + len(self.spec_token_ids) and self.start > 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished while scheduling (one that outgrew the whole KV cache);
    # the engine reports them like any other finish.
    finished: list[Request] = field(default_factory=list)
    # Requests scheduled for the first time in this step, and when: the end
    # of their queue time (admission calibrates its waits with it).
    started_ids: list[str] = field(default_factory=list)
    scheduled_at: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        """Prefill chunks' tokens, and the drafts that decodes verify."""
        return sum(len(c.spec_token_ids) if c.is_decode else c.num_new_tokens for c in self.chunks)


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_evicted_blocks: int  # total since start: cached blocks evicted from the prefix cache
    num_allocation_failures: int  # total: KV allocations the pool could not satisfy
    num_recomputed_tokens: int  # total: computed tokens whose KV preemption dropped
    running_adapters: tuple[str, ...] = ()  # LoRA adapter ids of running requests
    waiting_adapters: tuple[str, ...] = ()  # ... and of waiting ones


# Sort key of running requests: most urgent first; the last is the
# preemption victim. (A C-level getter: it runs for every running request
# at every step.)
URGENCY: Final = operator.attrgetter("priority", "arrival_time")
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
        self.num_recomputed_tokens = 0
        # LoRA adapter id -> requests under it, running and waiting (kept per
        # transition: stats and the max_loras check never scan the queues).
        self._running_adapters: dict[str, int] = {}
        self._waiting_adapters: dict[str, int] = {}

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
        if request.adapter_id is not None:
            _count(self._waiting_adapters, request.adapter_id, 1)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of a request not yet started that the prefix cache would
        serve now (admission's projection); no state change, no stats."""
        return self.kv_cache.get_computed_blocks(request).num_tokens

    def held_prefix_hit_tokens(self, request_id: str) -> int | None:
        """Of a request that is waiting and has computed nothing yet, the
        prefix hit on blocks some request holds (KVCacheManager.held_prefix_tokens):
        while the cache evicts, the hit its turn can count on. None for any
        other request (started, preempted, unknown)."""
        request = self._requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING or request.num_computed_tokens:
            return None
        return self.kv_cache.held_prefix_tokens(request)

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks evicted from the prefix cache since start."""
        return self.kv_cache.num_evicted_blocks

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
        Decided here, as the step is built: the limits are set before the
        step's batch is known, and an idle budget still in force when the
        first decode appears would stretch that decode's step."""
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
            if request.adapter_id is not None:
                _count(self._waiting_adapters, request.adapter_id, -1)
        self.finish(request, status, self.clock())
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              kv.usage(), kv.prefix_cache_queries, kv.prefix_cache_hits,
                              kv.num_evicted_blocks, kv.num_allocation_failures, self.num_recomputed_tokens,
                              tuple(self._running_adapters), tuple(self._waiting_adapters))

    def context_lengths(self) -> tuple[list[int], list[int]]:
        """Tokens (prompt + output so far) of each running and each waiting
        request: the context lengths behind the KV occupancy."""
        return ([r.num_tokens for r in self.running.values()],
                [r.num_tokens for r in self.waiting])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds, and zero the prefix-cache
        and preemption totals (an engine's warm-up leaves no trace)."""
        self.kv_cache.reset_prefix_cache()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    # -- the step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch; allocates KV for every scheduled token."""
        now = self.clock()
        out = SchedulerOutput(scheduled_at=now)
        budget = self._schedule_running(out, now)
        self.start_waiting(out, budget, now)
        out.num_batched_tokens = sum(c.num_new_tokens for c in out.chunks)
        return out

    def _schedule_running(self, out: SchedulerOutput, now: float) -> int:
        # Runs over every running request at every step (the server's hot
        # path): len()s instead of the num_tokens property, locals.
        running, kv, chunks = self.running, self.kv_cache, out.chunks
        by_urgency = sorted(running.values(), key=URGENCY)
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
            if request.spec_token_ids:
                chunk = self._schedule_drafts(request, remaining, budget)
                if chunk is not None:
                    done.add(rid)
                    chunks.append(chunk)
                    budget -= chunk.num_new_tokens
                    continue
            num_new = remaining if remaining < budget else budget
            if kv.allocate_slots(request, num_new) is None and \
                    not self._preempt_until_allocated(request, num_new, unscheduled, done, out, now):
                continue
            done.add(rid)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new, kv.block_ids(rid),
                                         num_new == remaining))
            budget -= num_new
        return budget

    def _schedule_drafts(self, request: Request, remaining: int, budget: int) -> ScheduledChunk | None:
        """The chunk verifying a decoding request's drafts, their KV slots
        allocated; None (drafts dropped) when the request is not decoding or
        the budget or the cache has no room for at least one of them."""
        drafts = request.spec_token_ids
        request.spec_token_ids = []
        if remaining != 1:
            return None
        num_drafts = min(len(drafts), budget - 1, self.max_spec_tokens(request))
        if num_drafts <= 0 or self.kv_cache.allocate_slots(request, 1 + num_drafts) is None:
            return None
        return ScheduledChunk(request, request.num_computed_tokens, 1 + num_drafts,
                              self.kv_cache.block_ids(request.request_id), True, tuple(drafts[:num_drafts]))

    def max_spec_tokens(self, request: Request) -> int:
        """The most draft tokens a decoding request may verify in one step: all
        accepted plus the step's own token must stay within max_tokens and
        the model's context (the stop rules of `stop_status`)."""
        num_output = len(request.output_token_ids)
        return max(0, min(request.sampling_params.max_tokens - num_output - 1,
                          self.config.max_model_len - len(request.prompt_token_ids) - num_output - 1))

    def _preempt_until_allocated(self, request: Request, num_new: int, unscheduled: list[Request],
                                 done: set[str], out: SchedulerOutput, now: float) -> bool:
        """After `request` found no room for `num_new` tokens: preempt
        victims until its allocation fits. False if the request itself had
        to go."""
        while True:
            victim = self._pick_victim(unscheduled, done)
            if victim is request and len(self.running) == 1:
                # Alone and still out of room: it has outgrown the whole cache.
                self.finish(request, RequestStatus.FINISHED_LENGTH, now)
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
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)
        if request.adapter_id is not None:
            _count(self._running_adapters, request.adapter_id, -1)
            _count(self._waiting_adapters, request.adapter_id, 1)

    def start_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Start waiting requests in policy order within `budget` tokens and
        the running cap, appending their chunks (and the ids of those
        scheduled for the first time) to `out`; the head of the queue that
        finds no room stops the rest. Step 3 of schedule(), also used by a
        caller that gave the running requests their tokens itself."""
        while budget > 0 and len(self.running) < self.max_running:
            request = self.waiting.peek(now)
            if request is None:
                break
            if request.adapter_id is not None and not self._adapter_can_run(request.adapter_id):
                break  # head-of-line waits for an adapter slot, as for KV
            computed = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, computed) is None:
                break  # head-of-line waits: skipping it for smaller requests would starve it
            self.waiting.pop(request)
            if request.adapter_id is not None:
                _count(self._waiting_adapters, request.adapter_id, -1)
                _count(self._running_adapters, request.adapter_id, 1)
            if request.timestamps.scheduled is None:
                out.started_ids.append(request.request_id)
            self._start(request, computed.num_tokens, now)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _adapter_can_run(self, adapter_id: str) -> bool:
        """A request under this adapter may start: the adapter already runs,
        or fewer than max_loras do."""
        limit = self.config.max_loras
        return limit is None or adapter_id in self._running_adapters or len(self._running_adapters) < limit

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

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
               num_accepted: Mapping[str, int] | None = None) -> list[Request]:
        """Apply a step's results: advance progress, append sampled tokens, finish
        and free requests that stop. Returns the requests that received a token.

        A chunk with drafts appends its first `num_accepted[request_id]`
        drafts, then the sampled token (drawn at the first rejected position,
        or after the last draft), stopping at the first token that ends the
        request; the KV slots of rejected drafts are released."""
        now = self.clock()
        progressed = []
        kv_cache = self.kv_cache
        for chunk in output.chunks:  # every running request, every step: locals, no properties
            request = chunk.request
            if request.status != _RUNNING:
                continue  # finished from outside between schedule and update
            if chunk.spec_token_ids:
                accepted = num_accepted.get(request.request_id, 0) if num_accepted else 0
                self._update_verified(chunk, accepted, sampled_token_ids[request.request_id], now)
                progressed.append(request)
                continue
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            kv_cache.cache_computed_blocks(request)
            if not chunk.samples:
                continue
            token_id = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token_id)
            stamps = request.timestamps
            if stamps.first_token is None:
                stamps.first_token = now
            stamps.token_times.append(now)
            status = self.stop_status(request, token_id)
            if status is not None:
                self.finish(request, status, now)
            progressed.append(request)
        return progressed

    def _update_verified(self, chunk: ScheduledChunk, num_accepted: int, token_id: int, now: float) -> None:
        request = chunk.request
        if not 0 <= num_accepted <= len(chunk.spec_token_ids):
            raise ValueError(f"{num_accepted} drafts accepted of {len(chunk.spec_token_ids)}")
        stamps = request.timestamps
        for token in (*chunk.spec_token_ids[:num_accepted], token_id):
            request.output_token_ids.append(token)
            stamps.token_times.append(now)
            status = self.stop_status(request, token)
            if status is not None:
                self.finish(request, status, now)
                return
        # KV is computed for the last token and the accepted drafts; the
        # sampled token is the new last token, its slot kept for the next step.
        request.num_computed_tokens = chunk.start + 1 + num_accepted
        self.kv_cache.cache_computed_blocks(request)
        self.kv_cache.free_tail(request, request.num_computed_tokens + 1)

    # -- when a request stops ------------------------------------------------
    def stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status of `request` once `token_id` is its newest
        output token, or None while it goes on: EOS / a stop token (after
        min_tokens), max_tokens, the model's context."""
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

    def steps_until_stop(self, request: Request, token_id: int) -> int:
        """Decode steps until `request` stops when every step samples
        `token_id`: the first count at which `stop_status` (the same three
        rules, in closed form: change them together) returns a status."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        steps = min(params.max_tokens - num_output,
                    self.config.max_model_len - len(request.prompt_token_ids) - num_output)
        if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            steps = min(steps, params.min_tokens - num_output)
        return max(1, steps)

    def finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """End a request that is not waiting (running, or just out of the
        queue) at `now`: stamp it, drop it and free its KV."""
        request.status = status
        request.timestamps.finished = now
        if self.running.pop(request.request_id, None) is not None and request.adapter_id is not None:
            _count(self._running_adapters, request.adapter_id, -1)
        self._requests.pop(request.request_id, None)
        self.kv_cache.free(request)


def _count(counts: dict[str, int], key: str, change: int) -> None:
    """Add `change` to counts[key], dropping keys that reach zero."""
    num = counts.get(key, 0) + change
    if num:
        counts[key] = num
    else:
        del counts[key]
