"""Quotas that hold whatever serves the requests: a tenant's concurrency and
tokens per minute, and the retry budget.

Standalone, with an injected clock: a replica's admission controller keeps
one of each for its own requests, and a gateway in front of many replicas
can keep the same classes for fleet-wide quotas (they know nothing of KV
blocks or queue waits).

Pure Python; not thread-safe (call them from one thread or under a lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from kvserve.admission.busy_rate import BusyRate
from kvserve.admission.decision import AdmissionDecision, Reason, reject, whole_seconds

TPM_WINDOW_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """None = unlimited."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None


class _Held:
    """What a request of a limited tenant holds until it finishes."""

    __slots__ = ("tenant", "charge")

    def __init__(self, tenant: str, charge: list | None) -> None:
        self.tenant = tenant
        self.charge = charge  # its [time, request_id, tokens] in the window, if charged


class TenantQuotas:
    """Per-tenant limits: requests in flight, and prompt + max_tokens per
    minute (a sliding window, each charge refunded to the tokens actually
    used when its request finishes). Tenants without limits cost nothing."""

    def __init__(self, limits: Mapping[str, TenantLimits] | None, clock: Callable[[], float]) -> None:
        self.limits = dict(limits or {})
        self.clock = clock
        self._inflight: dict[str, int] = {}
        self._held: dict[str, _Held] = {}
        # tenant -> deque of [time, request_id, tokens]; tokens refunded on finish.
        self._window: dict[str, deque[list]] = {}

    def num_inflight(self, tenant: str) -> int:
        """Requests of a limited tenant acquired and not released (0 for others)."""
        return self._inflight.get(tenant, 0)

    def refusal(self, tenant: str, num_tokens: int | None = None) -> AdmissionDecision | None:
        """The refusal of a request of `tenant` charging `num_tokens` (prompt
        + max_tokens), or None when its quotas allow it; num_tokens None
        asks about concurrency alone (a request of any size). No state
        change."""
        limits = self.limits.get(tenant)
        if limits is None:
            return None
        if limits.max_concurrent is not None and self.num_inflight(tenant) >= limits.max_concurrent:
            return reject(429, Reason.TENANT_QUOTA, 1,
                          f"tenant {tenant!r} has {limits.max_concurrent} requests in flight (its limit)")
        tokens_per_minute = limits.tokens_per_minute
        if num_tokens is None or tokens_per_minute is None:
            return None
        if num_tokens > tokens_per_minute:
            return reject(400, Reason.NEVER_FITS, None,
                          f"prompt + max_tokens = {num_tokens} exceeds tenant {tenant!r}'s "
                          f"{tokens_per_minute} tokens per minute")
        now = self.clock()
        if self._tokens_used(tenant, now) + num_tokens <= tokens_per_minute:
            return None
        return reject(429, Reason.TENANT_QUOTA, self._retry_after_s(tenant, num_tokens, tokens_per_minute, now),
                      f"tenant {tenant!r} is over its {tokens_per_minute} tokens per minute")

    def acquire(self, request_id: str, tenant: str, num_tokens: int) -> None:
        """An admitted request: one more in flight, `num_tokens` charged."""
        limits = self.limits.get(tenant)
        if limits is None:
            return
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        charge = None
        if limits.tokens_per_minute is not None:
            charge = [self.clock(), request_id, num_tokens]
            self._window.setdefault(tenant, deque()).append(charge)
        self._held[request_id] = _Held(tenant, charge)

    def release(self, request_id: str, num_tokens_used: int | None = None) -> None:
        """The request finished: no longer in flight; its charge refunded
        down to `num_tokens_used` (prompt + output actually held) if given."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._inflight[held.tenant] -= 1
        if held.charge is not None and num_tokens_used is not None:
            held.charge[2] = min(held.charge[2], num_tokens_used)

    def _tokens_used(self, tenant: str, now: float) -> int:
        window = self._window.get(tenant)
        if not window:
            return 0
        while window and window[0][0] <= now - TPM_WINDOW_S:
            window.popleft()
        return sum(entry[2] for entry in window)

    def _retry_after_s(self, tenant: str, charge: int, tokens_per_minute: int, now: float) -> int:
        """Seconds until enough of the window expires to fit `charge`."""
        used = self._tokens_used(tenant, now)
        for time, _, tokens in self._window.get(tenant, ()):
            used -= tokens
            if used + charge <= tokens_per_minute:
                return whole_seconds(time + TPM_WINDOW_S - now)
        return int(TPM_WINDOW_S)


class RetryBudget:
    """Retries draw from a token bucket that first attempts refill: each
    admission of a first attempt earns `ratio` of a retry (up to `burst`),
    each admitted retry spends one. A retry claims KV for its whole context
    again, so under overload retries must not multiply the load.

    The admission rate (for the Retry-After of a refused retry) counts only
    busy time: the owner says when it is busy (`advance`)."""

    def __init__(self, ratio: float, burst: float, rate_window_s: float, clock: Callable[[], float]) -> None:
        self.ratio = ratio
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self._admissions = BusyRate(rate_window_s)

    def refusal(self, is_retry: bool) -> AdmissionDecision | None:
        """The 429 of a retry while the bucket holds less than one retry; None
        otherwise. No state change."""
        if not is_retry or self.tokens >= 1.0 - 1e-9:  # 10 x 0.1 is 0.999...
            return None
        rate = self._admissions.rate(self.clock())
        earn_s = (1.0 - self.tokens) / (self.ratio * rate) if rate and self.ratio > 0 else 1.0
        return reject(429, Reason.RETRY_BUDGET, whole_seconds(earn_s),
                      "retries are over budget: a retry claims KV for its whole context again")

    def record_admission(self, is_retry: bool) -> None:
        self._admissions.add(1.0)
        if is_retry:
            self.tokens -= 1.0
        else:
            self.tokens = min(self.burst, self.tokens + self.ratio)

    def advance(self, now: float, busy: bool) -> None:
        """Move the admission rate to `now`; `busy` says whether the owner is
        busy in the coming interval (see BusyRate)."""
        self._admissions.advance(now, busy)
