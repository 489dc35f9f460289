"""Fleet admission: one decision for every backend behind the gateway.

Two parts:
- `FleetQuotas`: API keys -> tenants, per-tenant concurrency and
  tokens-per-minute quotas and the retry budget, counted once for the
  fleet (a tenant limited to 4 in flight gets its 5th refused however many
  backends have room). This is the one seam onto the admission package's
  quota and retry-budget classes: until that package lands it drives an
  `AdmissionController` whose capacity is unbounded, so that only its
  tenant and retry checks can refuse, through the controller's public
  calls (check / admit / on_start / on_finish) and never a copy of them.
- `wait_refusal`: refuse before asking any backend when none of the
  eligible ones could start the request within its class's queue-wait
  limit: 429, Retry-After from the smallest expected wait (their measured
  drain), and the reason in the OpenAI error body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import AdmissionConfig
from kvserve.fleet.backend_state import BackendLoad, expected_wait_s
from kvserve.scheduler.admission import QUEUE_FULL, AdmissionController, AdmissionDecision, AdmissionRequest
from kvserve.server.tenants import Tenant, TenantDirectory

# Capacity the quota ledger never runs out of: the fleet's capacity is the
# backends' business (wait_refusal), the ledger's only the tenants'.
_UNBOUNDED = 2**40
# The gateway's own re-sends draw on the retry budget under this tenant,
# which has no limits, so they never count against the client's tenant.
_GATEWAY_TENANT = "\x00gateway-retry"


@dataclass(frozen=True)
class Refusal:
    """An OpenAI-shaped refusal: status, `error.code`, message, Retry-After."""

    status: int
    reason: str
    message: str
    retry_after_s: int | None = None
    type: str = "overloaded"


def whole_seconds(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1 (60 while unbounded)."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 60


class FleetQuotas:
    """Tenants' quotas and the retry budget for the whole fleet. Lifecycle of
    a request: admit -> on_start (a backend answers it) -> on_finish."""

    def __init__(self, tenants: TenantDirectory, retry_budget: float, retry_budget_burst: float,
                 clock: Callable[[], float], tenant_keys: dict[str, str] | None = None) -> None:
        self.tenants = tenants
        self._tenant_keys = dict(tenant_keys or {})
        config = AdmissionConfig(retry_budget=retry_budget, retry_budget_burst=retry_budget_burst,
                                 max_queue_len=_UNBOUNDED, queue_timeout_s=float(_UNBOUNDED),
                                 max_queue_wait_s=float(_UNBOUNDED), deferred_max_queue_wait_s=float(_UNBOUNDED))
        self._ledger = AdmissionController(config, _UNBOUNDED, 1, _UNBOUNDED, clock, tenants.limits())
        self._num_resends = 0

    @classmethod
    def from_keys_file(cls, path: str | None, retry_budget: float, retry_budget_burst: float,
                       clock: Callable[[], float]) -> FleetQuotas:
        if path is None:
            return cls(TenantDirectory(), retry_budget, retry_budget_burst, clock)
        tenants = TenantDirectory.from_file(path)  # validates; ValueError names the bad entry
        keys = {entry["tenant"]: key for key, entry in json.loads(Path(path).read_text()).items()}
        return cls(tenants, retry_budget, retry_budget_burst, clock, keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        return self.tenants.authenticate(authorization)

    def key_of(self, tenant: str) -> str | None:
        """A key of the tenant, for work the gateway sends on its behalf
        later (a batch), so backends namespace its prefix cache as theirs."""
        return self._tenant_keys.get(tenant)

    def admit(self, request_id: str, tenant: Tenant, num_prompt_tokens: int, max_tokens: int,
              is_retry: bool) -> Refusal | None:
        """Count the request against its tenant and, if a retry, the retry
        budget; the refusal instead when over either (nothing counted)."""
        ask = AdmissionRequest(request_id, num_prompt_tokens, max_tokens, tenant=tenant.name, is_retry=is_retry)
        decision = self._ledger.check(ask)
        if not decision.admitted:
            return _refusal(decision)
        self._ledger.admit(ask, decision)
        return None

    def on_start(self, request_id: str) -> None:
        self._ledger.on_start(request_id)

    def on_finish(self, request_id: str, num_tokens: int | None = None) -> None:
        """Done: frees its concurrency slot; `num_tokens` (prompt + output
        used) refunds its tokens-per-minute charge to what it used."""
        self._ledger.on_finish(request_id, num_tokens)

    def take_retry(self) -> bool:
        """One token of the retry budget for a re-send the gateway makes
        (a backend's 429 tried on another backend); False when spent."""
        self._num_resends += 1
        rid = f"\x00resend-{self._num_resends}"
        ask = AdmissionRequest(rid, 0, 0, tenant=_GATEWAY_TENANT, is_retry=True)
        decision = self._ledger.check(ask)
        if not decision.admitted:
            return False
        self._ledger.admit(ask, decision)
        self._ledger.on_finish(rid)
        return True

    def num_in_flight(self, tenant: str) -> int:
        return self._ledger.num_inflight(tenant)


def _refusal(decision: AdmissionDecision) -> Refusal:
    type_ = "invalid_request_error" if decision.status == 400 else "rate_limited"
    return Refusal(decision.status, decision.reason or "refused", decision.message, decision.retry_after_s, type_)


def wait_refusal(backends: Sequence[BackendLoad], num_tokens: int, limit_s: float) -> Refusal | None:
    """429 when no backend could start a request of `num_tokens` (prompt +
    max_tokens) within `limit_s`; None when one could."""
    if not backends:
        return None
    wait_s = min(expected_wait_s(b, num_tokens) for b in backends)
    if wait_s <= limit_s:
        return None
    shown = f"{wait_s:.2f} s" if math.isfinite(wait_s) else "unbounded (no measured drain)"
    return Refusal(429, QUEUE_FULL, f"no backend can start this request within {limit_s:.2f} s: the shortest "
                                    f"expected queue wait across {len(backends)} backends is {shown}",
                   whole_seconds(wait_s - limit_s))
