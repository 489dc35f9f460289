"""The admission loop: what an engine loop tells admission, and when.

Written once, driven by the server's engine thread (engine/async_engine.py)
and by each simulated replica (sim/replica.py), so both feed the same
controller the same calls in the same order around every engine step:

    an arrival       decide(request, num_cached_tokens,   admit / degrade / refuse
                            ..., num_evicted_blocks)
    before a step    before_step(num_running, abort,      expired requests aborted,
                                 scheduler)               queued prefix hits re-read after
                                                          evictions -> the limits of this step
    the step runs    on_scheduled(started_ids, at)        first schedules (queue time)
    arrivals during the step are decided here, before its end is known
    the step ends    on_step_end(decodes, prefill, s)     the measured step time
                     on_finished(request_id, tokens)      every end, whatever ended it

The limits returned by `before_step` are the ones the step about to be
built runs under (`Scheduler.set_step_limits` just before `schedule()`):
computed from every step measured so far, never a step late.

Pure Python, clock injected through the controller; not thread-safe (the
server calls it under the async engine's lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from kvserve.admission.decision import AdmissionDecision, AdmissionRequest, QueueWait, Reason
from kvserve.admission.step_limits import StepLimits
from kvserve.contract import Request


class QueuedPrefixHits(Protocol):
    """What before_step reads of the KV cache (the Scheduler has it)."""

    @property
    def num_evicted_blocks(self) -> int: ...

    def held_prefix_hit_tokens(self, request_id: str) -> int | None: ...


class AdmissionLoop:
    """One replica's admission, step by step (see the module docstring)."""

    def __init__(self, controller: Any) -> None:
        # An AdmissionController, or the proxy a traced simulation hands in
        # to log every call (sim/replica.py); Any for that (kvserve/compiled).
        self.controller = controller
        # Queued requests admitted on a prefix hit -> the cache's eviction
        # count when that hit was last read (at the door, then on refresh).
        self._hit_read_at_evictions: dict[str, int] = {}

    # ---- arrivals ----------------------------------------------------------

    def decide(self, request: Request, num_cached_tokens: int, is_retry: bool = False,
               num_evicted_blocks: int = 0) -> AdmissionDecision:
        """The one decision for an arriving request whose prefix-cache hit is
        `num_cached_tokens` (read on the thread that owns the KV cache, when
        it had evicted `num_evicted_blocks` in all). Admitted requests are
        recorded; a degraded one leaves with its max_tokens (and min_tokens)
        capped to what was admitted."""
        params = request.sampling_params
        decision: AdmissionDecision = self.controller.decide(AdmissionRequest(
            request.request_id, len(request.prompt_token_ids), params.max_tokens, num_cached_tokens,
            request.priority, request.tenant, is_retry, request.deadline,
            # Computed by the prefix-hit lookup that gave num_cached_tokens.
            tuple(request.block_hashes)))
        if decision.admitted and num_cached_tokens > 0:
            self._hit_read_at_evictions[request.request_id] = num_evicted_blocks
        cap = decision.max_tokens
        if decision.admitted and cap is not None and cap < params.max_tokens:
            request.sampling_params = replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))
        return decision

    def refusal_for_any_size(self, priority: int, tenant: str, is_retry: bool,
                             deadline: float | None) -> AdmissionDecision | None:
        """The refusal every request of this class would get now, whatever its
        size (AdmissionController.refusal_for_any_size): lets the server
        refuse before tokenizing."""
        refusal: AdmissionDecision | None = self.controller.refusal_for_any_size(priority, tenant, is_retry,
                                                                                 deadline)
        return refusal

    def retry_after_s(self, earliest_s: float | None = None, priority: int = 0, tenant: str = "default") -> int:
        """Retry-After for a request turned away now (a 503: shutting down,
        a queue timeout, not ready) that cannot be served for `earliest_s`
        seconds, by default the expected wait of its class: its own
        staggered return slot (admission/retry_after.py)."""
        if earliest_s is None:
            earliest_s = self.controller.expected_wait_for_any_size_s(priority, tenant)
        retry_s: int = self.controller.retry_after_s(earliest_s)
        return retry_s

    # ---- around each step --------------------------------------------------

    def before_step(self, num_running: int, abort: Callable[[str, Reason], None],
                    cache: QueuedPrefixHits | None = None) -> StepLimits:
        """Before the next step is built: every admitted request that did not
        start in time goes to `abort` (which ends it; its on_finished
        follows); a queued request admitted on a prefix hit, once `cache`
        (the scheduler) evicted blocks since its hit was read, keeps only the
        part some running request holds: a block held by no one is the next
        eviction's candidate, and while the cache evicts, a queue's hits on
        such blocks are gone by its turn (measured on the default server at
        1.8x capacity, prompts re-sent after their blocks were freed: each
        queued hit fell from 240 tokens to 0 over the steps before its start,
        and admitted requests waited 9 s behind a 1.5 s limit); then the
        limits that step runs under."""
        for request_id, reason in self.controller.expired():
            abort(request_id, reason)
        if cache is not None and self._hit_read_at_evictions:
            # Keyed by each request's own last read, not by the last step's
            # count: the same calls whether steps ran one by one or as a
            # simulator's decode run (which has no queued request).
            num_evicted = cache.num_evicted_blocks
            for request_id, read_at in self._hit_read_at_evictions.items():
                if read_at != num_evicted:
                    self._hit_read_at_evictions[request_id] = num_evicted
                    hit = cache.held_prefix_hit_tokens(request_id)
                    if hit is not None:
                        self.controller.refresh_prefix_hit(request_id, hit)
        return self.next_step_limits(num_running)

    def next_step_limits(self, num_running: int) -> StepLimits:
        """The limits a step built now would run under, with `num_running`
        sequences running (no state change)."""
        limits: StepLimits = self.controller.step_limits(num_running)
        return limits

    def on_scheduled(self, started_ids: Iterable[str], scheduled_at: float) -> list[QueueWait]:
        """The step scheduled these requests for the first time at
        `scheduled_at` (SchedulerOutput.started_ids): their queue wait is
        over, and calibrates the next predictions. Returns each one's
        predicted and actual wait (for the prediction's error metric)."""
        waits: list[QueueWait] = []
        for request_id in started_ids:
            self._hit_read_at_evictions.pop(request_id, None)
            wait: QueueWait | None = self.controller.on_start(request_id, scheduled_at)
            if wait is not None:
                waits.append(wait)
        return waits

    def on_step_end(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float,
                    captured_graph: bool = False) -> None:
        """One step ran in `step_s`. A step that captured a CUDA graph holds a
        one-off cost, not the step's own, and stays out of the fit."""
        if not captured_graph:
            self.controller.observe_step(num_decode_seqs, num_prefill_tokens, step_s)

    def on_steps_end(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """on_step_end of each (num_decode_seqs, num_prefill_tokens, step_s) in
        order, in one call (a simulator's multi-step decode run)."""
        self.controller.observe_steps(steps)

    def on_finished(self, request_id: str, num_tokens: int | None = None) -> None:
        """A request ended (finished, aborted, expired, or refused by the
        engine after admission); `num_tokens` (prompt + output it held)
        refunds its tenant's tokens-per-minute charge to what was used."""
        self._hit_read_at_evictions.pop(request_id, None)
        self.controller.on_finish(request_id, num_tokens)
