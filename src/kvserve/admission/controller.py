"""Admission control: the front door that keeps the promise.

A request is admitted only if it can start soon enough to meet the TTFT
target. The controller keeps a ledger of admitted requests (their projected
KV blocks = ceil((prompt + max_tokens - prefix hit) / block_size)), measures
how fast that work drains (an EWMA over busy time of projected blocks and
requests released per second), and estimates a newcomer's wait from the work
queued ahead of it in its priority class. Over the class's limit it answers
429 with a Retry-After instead of letting the queue turn into timeouts.

It also holds the tenant quotas and the retry budget (quotas.py), decides
degradation (cap max_tokens instead of refusing), and reads the step limits
(step_limits.py) from the step-time model (step_time.py) its steps feed.

Pure Python, clock injected, no asyncio or HTTP: the server and the simulator
drive the same object through the admission loop (loop.py). Not thread-safe:
call it from one thread.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from kvserve.admission.busy_rate import BusyRate
from kvserve.admission.decision import AdmissionDecision, AdmissionRequest, Outcome, QueueWait, Reason, reject
from kvserve.admission.quotas import RetryBudget, TenantLimits, TenantQuotas
from kvserve.admission.retry_after import ReturnSlots, earliest_return_s
from kvserve.admission.step_limits import StepLimiter, StepLimits
from kvserve.admission.step_time import StepTimeModel
from kvserve.config import AdmissionConfig

# Waits predicted shorter than this calibrate the fixed start latency; longer
# ones the multiplicative error of the drain model.
SHORT_WAIT_S: Final = 0.05
CALIBRATION_WEIGHT: Final = 0.1  # EWMA weight of one observed start
MAX_WAIT_CORRECTION: Final = 4.0


@dataclass(slots=True)
class _Ticket:
    request: AdmissionRequest
    max_tokens: int
    num_blocks: int
    start_by: float | None
    start_by_reason: Reason
    admitted_at: float
    predicted_wait_s: float | None
    started: bool = False
    started_at: float = 0.0



class AdmissionController:
    """Decides admit / degrade / reject and keeps the ledger of admitted work.

    Lifecycle of a request: `decide` (admits it, or not) -> `on_start` (the
    engine scheduled it) -> `on_finish` (done, aborted or expired).
    `expired()` lists admitted requests that did not start in time. `check`
    is `decide` without the state change (what would happen now).
    """

    def __init__(self, config: AdmissionConfig, num_blocks: int, block_size: int,
                 max_num_seqs: int, clock: Callable[[], float],
                 tenant_limits: Mapping[str, TenantLimits] | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # The scheduler's own chunk, what a prompt is prefilled in while no
        # one decodes (None: unknown, the chunk's fixed step cost uncounted).
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.quotas = TenantQuotas(tenant_limits, clock)
        self.retry_budget = RetryBudget(config.retry_budget, config.retry_budget_burst, config.drain_window_s,
                                        clock)
        self._tickets: dict[str, _Ticket] = {}
        # The unstarted tickets (in admission order, as in _tickets) and the
        # started ones' blocks: the per-request questions (queue length,
        # work ahead, expiry) then read only the queue, not every ticket.
        self._queued: dict[str, _Ticket] = {}
        self._started_blocks = 0
        # Each full prompt block (by its chained hash) -> the admitted
        # requests whose prompts hold it, in admission order. The first is
        # charged for it; when it leaves, the next one is. Charging each
        # request only for what it missed at the door left a prefix that
        # requests hit once its first holder had finished charged to no one:
        # a simulated 8B replica's ledger read 82 blocks where its cache held
        # 458 (five requests pinning three 128-block system prompts), and
        # requests told 0.2-0.7 s waited 2-3.7 s.
        self._block_holders: dict[bytes, dict[str, None]] = {}
        self._drain_blocks = BusyRate(config.drain_window_s)
        self._drain_requests = BusyRate(config.drain_window_s)
        # Output tokens (max_tokens) of the started requests that finished:
        # a slot frees at a rate that depends on how long the requests
        # holding it are, so the measured rate is scaled to the work now.
        self._drain_tokens = BusyRate(config.drain_window_s)
        self.step_model = StepTimeModel()
        self.step_limiter = StepLimiter(self.step_model, config.tpot_slo_s, block_size, max_num_seqs,
                                        config.ttft_slo_s)
        # Calibration of expected_wait_s against the waits actually observed.
        self._wait_ratio = 1.0
        self._start_latency_s = 0.0
        self.return_slots = ReturnSlots(clock)

    # ---- questions -------------------------------------------------------

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, num_cached_tokens: int = 0) -> int:
        tokens = max(0, num_prompt_tokens + max_tokens - num_cached_tokens)
        return -(-tokens // self.block_size)

    def _blocks_claimed(self, request: AdmissionRequest, max_tokens: int) -> int:
        """KV blocks admitting `request` adds to what the admitted requests
        hold: with its prompt's block hashes, every block but the full
        prompt blocks an admitted request already holds (a prefix hit on a
        cached block no one holds still takes that block out of the free
        pool for as long as it runs); without them (prefix caching off),
        prompt + max_tokens less the door's hit."""
        hashes = request.prompt_block_hashes
        if not hashes:
            return self.blocks_needed(request.num_prompt_tokens, max_tokens, request.num_cached_tokens)
        total = -(-(request.num_prompt_tokens + max_tokens) // self.block_size)
        holders = self._block_holders
        return sum(1 for h in hashes if h not in holders) + max(0, total - len(hashes))

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_started(self) -> int:
        return len(self._tickets) - len(self._queued)

    def num_inflight(self, tenant: str | None = None) -> int:
        return sum(1 for t in self._tickets.values() if tenant is None or t.request.tenant == tenant)

    def running_cap(self) -> int:
        """The running-batch cap the measured steps allow (StepLimiter.running_cap)."""
        return self.step_limiter.running_cap()

    def step_limits(self, num_running: int) -> StepLimits:
        """Limits for the next step with `num_running` sequences running
        (StepLimiter.step_limits)."""
        return self.step_limiter.step_limits(num_running)

    def max_wait_s(self, priority: int) -> float:
        """The class's limit (AdmissionConfig.max_wait_s)."""
        limit_s: float = self.config.max_wait_s(priority)
        return limit_s

    def expected_wait_s(self, request: AdmissionRequest, max_tokens: int | None = None) -> tuple[float, Reason]:
        """Expected seconds until `request` can start, and what binds it
        (KV_CACHE, BATCH_SLOTS for the running batch's slots, or
        PREFILL_BACKLOG for the prompts admitted ahead of it)."""
        wait_s, binding, _ = self._expected_start(request, max_tokens)
        return wait_s, binding

    def _expected_start(self, request: AdmissionRequest,
                        max_tokens: int | None = None) -> tuple[float, Reason, float]:
        """expected_wait_s, and the seconds its own prompt then takes to
        prefill (what it does not share with the prompts ahead, at the pace
        of the steps that will prefill it)."""
        now = self.clock()
        max_tokens = request.max_tokens if max_tokens is None else max_tokens
        need = self._blocks_claimed(request, max_tokens)
        blocks_ahead, seqs_ahead = self._work_ahead(request, need)
        running_cap = self.running_cap()
        excess_blocks = blocks_ahead + need - self.num_blocks
        excess_seqs = seqs_ahead + 1 - running_cap
        # Before anything drained, allow one more cache (or batch) worth of
        # queue and refuse beyond it.
        kv_wait = _wait_for(excess_blocks, self._block_drain_rate(now), self.num_blocks)
        seq_wait = _wait_for(excess_seqs, self._request_drain_rate(now), running_cap)
        if excess_seqs > 0 and self.step_model.mean_step_s is not None:
            # Once steps are measured, the slots' own schedule: each started
            # request frees its slot after its max_tokens steps, and those
            # queued ahead take the next ones. The fluid drain rate misleads
            # both ways in a burst: it promises the first slot far too soon
            # when the burst started together, and, measured from finishes,
            # it decays with every busy second no request has finished yet
            # (a burst of answers longer than the last ones was told 37 s
            # for a 3 s wait). Observed waits correct it (_calibrated).
            seq_wait = self._slot_free_wait_s(seqs_ahead - self.num_started, running_cap, now)
        wait_s, binding = (kv_wait, Reason.KV_CACHE) if kv_wait >= seq_wait else (seq_wait, Reason.BATCH_SLOTS)
        prefill_wait, own_prefill_s = self._prefill_backlog_s(request, now, running_cap)
        if prefill_wait > max(wait_s, SHORT_WAIT_S):  # a few ms of prompts ahead is starting at once
            wait_s, binding = prefill_wait, Reason.PREFILL_BACKLOG
        return self._calibrated(wait_s), binding, own_prefill_s

    def _prefill_backlog_s(self, request: AdmissionRequest, now: float, running_cap: int) -> tuple[float, float]:
        """Seconds until the prompts ahead of `request` are prefilled, each at
        the pace of the steps that will prefill it (_prefill_pace_s): beside
        the sequences decoding now and those ahead of it that will decode by
        then; and the seconds its own prompt then takes, at its turn's pace
        (0 before prefill is measured). A request starts only when its turn
        for prefill comes: with slots and KV free, a queue of long prompts
        still holds it (at rate 1 the peers' benchmark waited 11 s where
        slots and blocks promised 0.1 s). Pricing a burst's whole queue at
        the pace of its first prompt, prefilled alone, promised 1.5 s to
        requests that waited 2.1 s: every prompt after the first prefills
        beside the decodes of the ones before it, in TPOT-sized steps."""
        # The last step's decoders are taken to be the longest started ones:
        # their prefill is done whatever pace it ran at.
        num_decoding = min(self.step_model.last_num_decode_seqs, self.num_started)
        paces: dict[int, float] = {}

        def pace(decoders: int) -> float:
            decoders = min(decoders, running_cap)
            if decoders not in paces:
                paces[decoders] = self._prefill_pace_s(decoders)
            return paces[decoders]

        if pace(num_decoding) <= 0:
            return 0.0, 0.0
        wait_s = 0.0
        # Prompt blocks a request ahead prefills: a later request whose
        # prompt starts with them will find them cached when its turn
        # comes, so a prefix shared down a queue is counted once (a
        # prefix-affinity backend queues many requests behind one long
        # system prompt; counted in full each, they were refused as
        # backlog with TTFT far inside the SLO).
        prefilled: set[bytes] = set()
        block_size = self.block_size
        started = [(t.started_at, rid) for rid, t in self._tickets.items() if t.started] if num_decoding else []
        decoding = {rid for _, rid in heapq.nsmallest(num_decoding, started)}
        decoders = num_decoding  # decoding once the prompts counted so far are prefilled
        for rid, t in self._tickets.items():
            if not t.started and t.request.priority > request.priority:
                continue  # it waits behind this one
            tokens = _tokens_to_prefill(t.request, prefilled, block_size)
            if rid in decoding:
                continue
            per_token_s = pace(decoders)
            if t.started:  # its prefill began at started_at and has gone on at the same pace
                wait_s += max(0.0, tokens - (now - t.started_at) / per_token_s) * per_token_s
            else:
                wait_s += tokens * per_token_s
            if t.max_tokens > 1:  # it decodes beside the prompts after it
                decoders += 1
        return wait_s, _tokens_to_prefill(request, prefilled, block_size) * pace(decoders)

    def _prefill_pace_s(self, num_decoding: int) -> float:
        """Seconds per prompt token the steps prefill at with `num_decoding`
        sequences decoding: beside decodes,
        the TPOT-sized step budget's pace where it binds; with no one
        decoding, the scheduler's own chunks (a step with no decode is not
        capped), which on an 8B model are 4x faster: priced at the budget's
        pace, a lone 2,000-token prompt in prefill looked like 2 s of
        backlog and its prefix-affinity backend refused the next request
        with TTFT at 0.8 s of a 2 s target. 0 before prefill is measured,
        and 0 once the fit found prompt tokens cost nothing measurable: the
        whole step time is charged to prefill (the upper bound) only while
        the fit has not separated the two, never after it measured the cost
        as nil (a fast CPU fits the tiny model's prefill at 0 and the bound,
        14 ms a token, then refused a lone 20-token prompt as 0.19 s of
        backlog)."""
        fit = self.step_model.fit()
        per_token_s: float | None
        if fit is not None and fit.per_prefill_token_s is not None:
            per_token_s = fit.per_prefill_token_s
        else:
            per_token_s = self.step_model.upper_bound_per_prefill_token_s
        if per_token_s is None or per_token_s <= 0:
            return 0.0
        # Before the fit the budget caps every step (StepLimiter.step_limits).
        if fit is None or num_decoding > 0:
            budget = self.step_limiter.prefill_token_budget(num_decoding)
            if budget:
                return max(per_token_s, self.step_limiter.step_budget_s / budget)
        elif fit is not None and self.max_num_batched_tokens:
            return per_token_s + max(0.0, fit.intercept_s) / self.max_num_batched_tokens
        return per_token_s

    def _slot_free_wait_s(self, num_queued_ahead: int, running_cap: int, now: float) -> float:
        """Seconds until a batch slot is free for a request behind
        `num_queued_ahead` queued ones: each started request holds its slot
        until its max_tokens decode steps (of the mean measured step) are
        done, and each one ahead takes the next slot that frees."""
        step_s = self.step_model.mean_step_s
        if step_s is None or step_s <= 0:
            return 0.0
        free_at = sorted(t.started_at + t.max_tokens * step_s for t in self._tickets.values() if t.started)
        free_at = [now] * max(0, running_cap - len(free_at)) + free_at[:running_cap]
        heapq.heapify(free_at)
        queued = list(self._queued.values())[:max(0, num_queued_ahead)]
        for ticket in queued:
            heapq.heappush(free_at, max(now, heapq.heappop(free_at)) + ticket.max_tokens * step_s)
        return max(0.0, free_at[0] - now) if free_at else 0.0

    def _calibrated(self, model_wait_s: float) -> float:
        """The drain model's wait, corrected by how observed waits compared
        with earlier predictions (multiplicative for queueing, additive for
        the fixed latency of getting scheduled at all)."""
        if model_wait_s < SHORT_WAIT_S:
            return model_wait_s + self._start_latency_s
        return model_wait_s * self._wait_ratio + self._start_latency_s

    def _work_ahead(self, request: AdmissionRequest, need: int) -> tuple[int, int]:
        """(blocks, requests) that will be served before `request`: everything
        started, queued work of more urgent classes, and within its own class
        its tenant's queue plus, from each other tenant, at most as much as
        its own tenant has queued (the scheduler shares a class fairly)."""
        blocks, seqs = self._started_blocks, len(self._tickets) - len(self._queued)
        same_class: dict[str, list[int]] = {}
        for t in self._queued.values():
            if t.request.priority < request.priority:
                blocks, seqs = blocks + t.num_blocks, seqs + 1
            elif t.request.priority == request.priority:
                tenant = same_class.setdefault(t.request.tenant, [0, 0])
                tenant[0] += t.num_blocks
                tenant[1] += 1
        own_blocks, own_seqs = same_class.pop(request.tenant, (0, 0))
        blocks, seqs = blocks + own_blocks, seqs + own_seqs
        for other_blocks, other_seqs in same_class.values():
            blocks += min(other_blocks, own_blocks + need)
            seqs += min(other_seqs, own_seqs + 1)
        return blocks, seqs

    def _block_drain_rate(self, now: float) -> float | None:
        measured = self._drain_blocks.rate(now)
        if measured is not None:
            return measured
        service_s = self._modelled_service_s()
        return None if service_s is None else self.num_blocks / service_s

    def _request_drain_rate(self, now: float) -> float | None:
        """Requests finishing per second for the work admitted now: the
        measured rate of finished output tokens over the mean max_tokens of
        the admitted requests (a burst of requests twice as long as the
        ones measured frees slots half as fast)."""
        measured = self._drain_requests.rate(now)
        tokens_rate = self._drain_tokens.rate(now)
        if measured is not None and tokens_rate is not None and self._tickets:
            mean_tokens = sum(t.max_tokens for t in self._tickets.values()) / len(self._tickets)
            return tokens_rate / mean_tokens if mean_tokens > 0 else measured
        if measured is not None:
            return measured
        service_s = self._modelled_service_s()
        return None if service_s is None else self.running_cap() / service_s

    def _modelled_service_s(self) -> float | None:
        """Before anything finished: a full cache (or batch) turns over in
        about mean(max_tokens) decode steps of the measured step time."""
        step_s = self.step_model.mean_step_s
        if step_s is None or not self._tickets:
            return None
        mean_tokens = sum(t.max_tokens for t in self._tickets.values()) / len(self._tickets)
        service_s = step_s * mean_tokens
        return service_s if service_s > 0 else None

    # ---- the decision ----------------------------------------------------

    def decide(self, request: AdmissionRequest) -> AdmissionDecision:
        """The one decision per request: `check`, and when it admits (or
        degrades) the request is recorded as `admit` records it."""
        decision = self.check(request)
        if decision.admitted:
            self.admit(request, decision)
        return decision

    def check(self, request: AdmissionRequest) -> AdmissionDecision:
        """Decide without changing any state but a refusal's return slot
        (`retry_after_s`)."""
        need = self.blocks_needed(request.num_prompt_tokens, request.max_tokens, request.num_cached_tokens)
        if need > self.num_blocks:
            return reject(400, Reason.NEVER_FITS, None, (
                f"the request needs {need} KV blocks (prompt + max_tokens) but the whole cache "
                f"holds {self.num_blocks}; shorten the prompt or lower max_tokens"))
        refusal = self.quotas.refusal(request.tenant, request.num_prompt_tokens + request.max_tokens) \
            or self.retry_budget.refusal(request.is_retry)
        if refusal is not None:
            return refusal
        if self.num_queued >= self.config.max_queue_len:
            return self._queue_full()
        return self._check_wait(request, self.clock())

    def refusal_for_any_size(self, priority: int = 0, tenant: str = "default", is_retry: bool = False,
                             deadline: float | None = None) -> AdmissionDecision | None:
        """The 429 that `check` would give every request of this class and
        tenant, whatever its prompt and max_tokens; None when the answer
        depends on the request's size. No state change.

        Lets the server refuse before tokenizing under overload: the refusals
        that need no token count (tenant concurrency, retry budget, a full
        queue) and the expected wait of a request needing zero KV blocks,
        a lower bound on any real request's wait (more blocks never wait
        less). The caller must rule out `check`'s size-dependent 400s itself.
        The reason may say `batch_slots` where `check` would have said
        `kv_cache` (with zero blocks the batch slots bind), and Retry-After
        is the lower bound's. The only state it changes is a refusal's
        return slot (`retry_after_s`)."""
        now = self.clock()
        probe = AdmissionRequest("", 0, 0, 0, priority, tenant, is_retry, deadline)
        refusal = self.quotas.refusal(tenant) or self.retry_budget.refusal(is_retry)
        if refusal is not None:
            return refusal
        if self.num_queued >= self.config.max_queue_len:
            return self._queue_full()
        limit_s = self._wait_limit_s(probe, now)
        wait_s, binding = self.expected_wait_s(probe)
        return self._wait_refusal(probe, wait_s, binding, limit_s) if wait_s > limit_s else None

    def _queue_full(self) -> AdmissionDecision:
        """The queue is at its length limit: come back when the measured
        drain has taken the requests over it (and this one's place) out."""
        rate = self._request_drain_rate(self.clock())
        over = self.num_queued - self.config.max_queue_len + 1
        earliest_s = over / rate if rate else 1.0
        return reject(429, Reason.QUEUE_FULL, self.retry_after_s(earliest_s),
                      f"the waiting queue is full ({self.config.max_queue_len} requests)")

    def _wait_limit_s(self, request: AdmissionRequest, now: float) -> float:
        limit_s = self.max_wait_s(request.priority)
        if request.deadline is not None:
            limit_s = min(limit_s, request.deadline - now)
        return limit_s

    def _ttft_wait_limit_s(self, request: AdmissionRequest, own_prefill_s: float) -> float:
        """The longest wait that still leaves the request its own prefill
        inside the TTFT target, for the interactive classes (priority <= 0;
        deferred ones accept a longer wait). The queue-wait limit alone
        leaves a fixed share of the target for the prefill: a 2,300-token
        prompt prefilled beside decodes on an 8B model takes 1.4 s, and one
        admitted replica at twice its capacity saw 8 of 36 admitted requests
        start inside 1.5 s and miss a 2 s TTFT (simulated, fleet.py's
        workload). A prompt that cannot prefill inside the target even at
        once still gets in when it would start at once (SHORT_WAIT_S):
        refusing it always would refuse it forever. A queue-wait limit at
        or past the TTFT target accepts waits past it (an opened-up server,
        a batch fleet): there the limit alone applies."""
        ttft_slo_s = self.config.ttft_slo_s
        if request.priority > 0 or own_prefill_s <= 0 or self.max_wait_s(request.priority) >= ttft_slo_s:
            return math.inf
        return max(SHORT_WAIT_S, ttft_slo_s - own_prefill_s)

    def _wait_refusal(self, request: AdmissionRequest, wait_s: float, binding: Reason,
                      limit_s: float, own_prefill_s: float = 0.0) -> AdmissionDecision:
        reason = Reason.DEADLINE if request.deadline is not None and limit_s < self.max_wait_s(request.priority) \
            and limit_s < self._ttft_wait_limit_s(request, own_prefill_s) else binding
        retry_s = self.retry_after_s(earliest_return_s(wait_s, limit_s))
        message = _wait_message(wait_s, limit_s, reason, binding)
        if reason != Reason.DEADLINE and limit_s < self.max_wait_s(request.priority):
            message = f"expected queue wait {_fmt_s(wait_s)} and its own prefill ({_fmt_s(own_prefill_s)}) " \
                      f"exceed the TTFT target of {_fmt_s(self.config.ttft_slo_s)} ({binding.replace('_', ' ')})"
        return reject(429, reason, retry_s, message, wait_s)

    def retry_after_s(self, earliest_s: float) -> int:
        """Retry-After for a request refused now that cannot get in for
        `earliest_s` seconds: its own return slot, one request's drain time
        after the one handed out before it (retry_after.py). Takes the slot."""
        rate = self._request_drain_rate(self.clock())
        return self.return_slots.take(earliest_s, 1.0 / rate if rate else 0.0)

    def expected_wait_for_any_size_s(self, priority: int = 0, tenant: str = "default") -> float:
        """The expected wait of a request of this class needing no KV blocks:
        a lower bound on any real request's (more blocks never wait less)."""
        wait_s, _ = self.expected_wait_s(AdmissionRequest("", 0, 0, 0, priority, tenant))
        return wait_s

    def _check_wait(self, request: AdmissionRequest, now: float) -> AdmissionDecision:
        wait_s, binding, own_prefill_s = self._expected_start(request)
        limit_s = min(self._wait_limit_s(request, now), self._ttft_wait_limit_s(request, own_prefill_s))
        cap = self.config.degrade_max_tokens
        degrade_wait_s = self.config.degrade_wait_s
        can_degrade = degrade_wait_s is not None and request.max_tokens > cap
        if wait_s > limit_s:
            if can_degrade:
                capped_wait_s, _ = self.expected_wait_s(request, cap)
                if capped_wait_s <= limit_s:
                    return AdmissionDecision(Outcome.DEGRADE, cap, expected_wait_s=capped_wait_s)
            return self._wait_refusal(request, wait_s, binding, limit_s, own_prefill_s)
        # Degrade on queueing only: the fixed latency of being scheduled at
        # all is paid by every request, even one that starts at once, and
        # counting it would degrade requests that take a free slot.
        if degrade_wait_s is not None and can_degrade and wait_s - self._start_latency_s > degrade_wait_s:
            return AdmissionDecision(Outcome.DEGRADE, cap, expected_wait_s=wait_s)
        return AdmissionDecision(Outcome.ADMIT, request.max_tokens, expected_wait_s=wait_s)

    # ---- the ledger ------------------------------------------------------

    def admit(self, request: AdmissionRequest, decision: AdmissionDecision) -> None:
        """Record an admitted request (after `check` said admit or degrade)."""
        if not decision.admitted:
            raise ValueError(f"cannot admit a rejected request ({decision.reason})")
        if request.request_id in self._tickets:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        now = self.clock()
        self._advance(now, busy=True)
        max_tokens = decision.max_tokens or request.max_tokens
        start_by, reason = now + self.config.queue_timeout_s, Reason.QUEUE_TIMEOUT
        if request.deadline is not None and request.deadline < start_by:
            start_by, reason = request.deadline, Reason.DEADLINE
        self._tickets[request.request_id] = self._queued[request.request_id] = _Ticket(
            request, max_tokens, self._blocks_claimed(request, max_tokens),
            start_by, reason, now, decision.expected_wait_s)
        for block_hash in request.prompt_block_hashes:
            self._block_holders.setdefault(block_hash, {})[request.request_id] = None
        self.quotas.acquire(request.request_id, request.tenant, request.num_prompt_tokens + max_tokens)
        self.retry_budget.record_admission(request.is_retry)

    def on_start(self, request_id: str, started_at: float | None = None) -> QueueWait | None:
        """The engine scheduled it at `started_at` (default: now); the actual
        wait calibrates the prediction. Returns the prediction beside the
        outcome (None for an unknown or already started request, or one
        admitted without a finite prediction)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.started:
            return None
        ticket.started = True
        ticket.started_at = self.clock() if started_at is None else started_at
        del self._queued[request_id]
        self._started_blocks += ticket.num_blocks
        predicted_s = ticket.predicted_wait_s
        if predicted_s is None or not math.isfinite(predicted_s):
            return None
        actual_s = max(0.0, (self.clock() if started_at is None else started_at) - ticket.admitted_at)
        w = CALIBRATION_WEIGHT
        if predicted_s < SHORT_WAIT_S:
            self._start_latency_s = (1 - w) * self._start_latency_s + w * actual_s
        else:
            ratio = min(MAX_WAIT_CORRECTION, max(1 / MAX_WAIT_CORRECTION, actual_s / predicted_s))
            self._wait_ratio = (1 - w) * self._wait_ratio + w * ratio
        return QueueWait(predicted_s, actual_s)

    def on_finish(self, request_id: str, num_tokens: int | None = None) -> None:
        """Release a request. num_tokens (prompt + output actually held)
        refunds the tenant's tokens-per-minute charge to what was used."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        self._advance(self.clock(), busy=bool(self._tickets))
        passed_on = self._release_prompt_blocks(request_id, ticket.request.prompt_block_hashes)
        if ticket.started:
            self._started_blocks -= ticket.num_blocks
            self._drain_blocks.add(ticket.num_blocks - passed_on)
            self._drain_requests.add(1.0)
            self._drain_tokens.add(float(ticket.max_tokens))
        else:
            del self._queued[request_id]
        self.quotas.release(request_id, num_tokens)

    def _release_prompt_blocks(self, request_id: str, hashes: tuple[bytes, ...]) -> int:
        """A request leaves: each prompt block it was charged for that
        another admitted request holds is charged to the next holder.
        Returns how many (blocks that stay in the cache)."""
        passed_on = 0
        for block_hash in hashes:
            holders = self._block_holders.get(block_hash)
            if holders is None or request_id not in holders:
                continue
            charged = next(iter(holders)) == request_id
            del holders[request_id]
            if not holders:
                del self._block_holders[block_hash]
            elif charged:
                heir = self._tickets[next(iter(holders))]
                heir.num_blocks += 1
                if heir.started:
                    self._started_blocks += 1
                passed_on += 1
        return passed_on

    def refresh_prefix_hit(self, request_id: str, num_cached_tokens: int) -> None:
        """A queued request's prefix hit as its turn can count on it now
        (AdmissionLoop.before_step): its share of the prefill backlog
        follows (and, where it has no block hashes, its blocks). Counted at
        the door's value, hits the cache was evicting made a queue of
        prompts look like no prefill at all (six 256-token prompts ahead
        priced as 96 tokens)."""
        ticket = self._queued.get(request_id)
        if ticket is None or ticket.request.num_cached_tokens == num_cached_tokens:
            return
        ticket.request = replace(ticket.request, num_cached_tokens=num_cached_tokens)
        if not ticket.request.prompt_block_hashes:  # with them its blocks are charged whatever it hits
            ticket.num_blocks = self.blocks_needed(ticket.request.num_prompt_tokens, ticket.max_tokens,
                                                   num_cached_tokens)

    def expired(self) -> list[tuple[str, Reason]]:
        """(request_id, reason) of admitted requests not started in time; the
        caller aborts them and calls on_finish."""
        now = self.clock()
        return [(rid, t.start_by_reason) for rid, t in self._queued.items()
                if t.start_by is not None and now > t.start_by]

    def observe_step(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float) -> None:
        """Feed one measured engine step (for the running cap and the
        prefill token budget); empty steps are ignored."""
        self.step_model.observe(num_decode_seqs, num_prefill_tokens, step_s)

    def observe_steps(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """observe_step of each (num_decode_seqs, num_prefill_tokens, step_s)
        in order, in one call (a simulator's multi-step decode run)."""
        self.step_model.observe_steps(steps)

    def _advance(self, now: float, busy: bool) -> None:
        self._drain_blocks.advance(now, busy)
        self._drain_requests.advance(now, busy)
        self._drain_tokens.advance(now, busy)
        self.retry_budget.advance(now, busy)


def _tokens_to_prefill(request: AdmissionRequest, prefilled: set[bytes], block_size: int) -> int:
    """Prompt tokens `request` prefills when its turn comes: past the door's
    hit and past the leading blocks the prompts ahead prefill (`prefilled`,
    to which its own blocks are then added)."""
    tokens = max(0, request.num_prompt_tokens - request.num_cached_tokens)
    hashes = request.prompt_block_hashes
    if not hashes:
        return tokens
    first = request.num_cached_tokens // block_size  # blocks past the door's hit
    shared = 0
    for block_hash in hashes[first:]:
        if block_hash not in prefilled:
            break
        shared += 1
    prefilled.update(hashes[first + shared:])
    return max(0, tokens - shared * block_size)


def _wait_for(excess: float, rate: float | None, cold_allowance: float) -> float:
    """Seconds to drain `excess` at `rate`; with no rate yet, zero within the
    allowance and unbounded beyond it."""
    if excess <= 0:
        return 0.0
    if rate is None:
        return 0.0 if excess <= cold_allowance else math.inf
    return excess / rate if rate > 0 else math.inf


def _wait_message(wait_s: float, limit_s: float, reason: Reason, binding: Reason) -> str:
    """What a wait refusal says: the expected wait against a positive limit,
    and what binds (a deadline already past says so instead of a limit)."""
    what = binding.replace("_", " ")
    if reason == Reason.DEADLINE:
        if limit_s <= 0:
            return f"the request's deadline passed before it could start (expected queue wait {_fmt_s(wait_s)}, {what})"
        return f"expected queue wait {_fmt_s(wait_s)} exceeds the {_fmt_s(limit_s)} left before the request's " \
               f"deadline ({what})"
    return f"expected queue wait {_fmt_s(wait_s)} exceeds the limit of {_fmt_s(limit_s)} ({what})"


def _fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unbounded (no measured drain)"
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"
