"""What goes into admission and what comes out: the request's plain numbers,
the decision, and the enums of outcomes and reasons.

The enums are StrEnums whose values are the strings on the wire: a reason is
the OpenAI error `code` of a refusal and a label of
`kvserve_admission_decisions_total`, so server, simulator, metrics and bench
compare and print them as those strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    ADMIT = "admit"
    DEGRADE = "degrade"  # admitted with max_tokens capped
    REJECT = "reject"


class Reason(StrEnum):
    """Why a request is refused, or ended before it started."""

    KV_CACHE = "kv_cache"  # the expected wait for KV blocks is over the class's limit
    QUEUE_FULL = "queue_full"  # the waiting queue is at its length limit (--max-queue-len)
    BATCH_SLOTS = "batch_slots"  # the expected wait for a slot in the running batch is over the class's limit
    PREFILL_BACKLOG = "prefill_backlog"  # the prompts ahead of it take longer than the limit to prefill
    TENANT_QUOTA = "tenant_quota"
    RETRY_BUDGET = "retry_budget"
    NEVER_FITS = "never_fits"  # 400: the request can never fit (the cache, the tenant's tokens per minute)
    DEADLINE = "deadline"
    QUEUE_TIMEOUT = "queue_timeout"  # admitted, but did not start in time


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission needs to know about one request (plain numbers)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_cached_tokens: int = 0  # prefix-cache hit known at the door
    priority: int = 0  # lower = more urgent
    tenant: str = "default"
    is_retry: bool = False
    deadline: float | None = None  # absolute, on the controller's clock
    # The prompt's full-block prefix-cache hashes (chained: equal leading
    # hashes are a shared prefix), () where prefix caching is off. The
    # prefill backlog counts a prefix that requests ahead share once.
    prompt_block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """admit | degrade (admit with max_tokens capped) | reject (status, reason)."""

    outcome: Outcome
    max_tokens: int | None = None  # what to run with when admitted
    status: int = 200
    reason: Reason | None = None
    retry_after_s: int | None = None  # whole seconds >= 1 on a 429
    expected_wait_s: float | None = None
    message: str = ""

    @property
    def admitted(self) -> bool:
        return self.outcome != Outcome.REJECT


@dataclass(frozen=True, slots=True)
class QueueWait:
    """An admitted request's queue wait: what admission predicted when it
    admitted it, and what happened (admitted -> first scheduled)."""

    predicted_s: float
    actual_s: float


def reject(status: int, reason: Reason, retry_after_s: int | None, message: str,
           expected_wait_s: float | None = None) -> AdmissionDecision:
    return AdmissionDecision(Outcome.REJECT, None, status, reason, retry_after_s, expected_wait_s, message)


def whole_seconds(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 60
