"""The fleet's front door: one admission decision for every backend behind
it. The gateway, the Ray ingress and `kvserve simulate`'s fleet all run it,
so a simulated fleet refuses, and re-sends, as the live one does.

Three parts:
- `FleetQuotas`: API keys -> tenants, per-tenant concurrency and
  tokens-per-minute quotas and the retry budget, counted once for the
  fleet (a tenant limited to 4 in flight gets its 5th refused however many
  backends have room). They are the admission package's own `TenantQuotas`
  and `RetryBudget` (admission/quotas.py), the classes each replica's
  controller keeps, here kept once at the door; refusals are its
  `AdmissionDecision`s with its `Reason`s.
- `wait_refusal`: refuse before asking any backend when none of the
  eligible ones could start the request within its class's queue-wait
  limit: 429 with the binding reason (batch_slots or kv_cache) in the
  OpenAI error body, and a Retry-After of the request's own, staggered
  return slot, as each replica's controller gives. Where the door has no
  measured drain for a kvserve backend, that backend's own admission
  decides instead.
- `FullAnswers`: a backend's own 429 (refused, not started): one other
  backend may be tried within the retry budget; when none takes it, one
  429 whose Retry-After is the soonest any of them expects room.

Pure Python, clock injected; no HTTP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.admission.decision import AdmissionDecision, Reason, reject, whole_seconds
from kvserve.admission.quotas import RetryBudget, TenantQuotas
from kvserve.admission.retry_after import ReturnSlots, earliest_return_s
from kvserve.admission.tenants import Tenant, TenantDirectory
from kvserve.fleet.backend_state import DRAIN_WINDOW_S, BackendLoad, expected_wait_s, kv_binds


class FleetQuotas:
    """Tenants' quotas and the retry budget for the whole fleet. Lifecycle of
    a request: admit -> on_finish (once; later calls are no-ops)."""

    def __init__(self, tenants: TenantDirectory, retry_budget: float, retry_budget_burst: float,
                 clock: Callable[[], float], tenant_keys: dict[str, str] | None = None) -> None:
        self.tenants = tenants
        self.clock = clock
        self._tenant_keys = dict(tenant_keys or {})
        self.quotas = TenantQuotas(tenants.limits(), clock)
        # Retries earn from the gateway's admissions over its busy time (any
        # request in flight), as a replica's controller earns from its own.
        self.retry_budget = RetryBudget(retry_budget, retry_budget_burst, DRAIN_WINDOW_S, clock)
        self._in_flight: set[str] = set()

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
              is_retry: bool) -> AdmissionDecision | None:
        """Count the request against its tenant and, if a retry, the retry
        budget; the refusal instead when over either (nothing counted)."""
        num_tokens = num_prompt_tokens + max_tokens
        refusal = self.quotas.refusal(tenant.name, num_tokens) or self.retry_budget.refusal(is_retry)
        if refusal is not None:
            return refusal
        if request_id in self._in_flight:
            raise ValueError(f"request {request_id!r} is already admitted")
        self.retry_budget.advance(self.clock(), busy=True)
        self._in_flight.add(request_id)
        self.quotas.acquire(request_id, tenant.name, num_tokens)
        self.retry_budget.record_admission(is_retry)
        return None

    def on_finish(self, request_id: str, num_tokens: int | None = None) -> None:
        """Done: frees its concurrency slot; `num_tokens` (prompt + output
        used) refunds its tokens-per-minute charge to what it used."""
        if request_id not in self._in_flight:
            return
        self._in_flight.discard(request_id)
        self.retry_budget.advance(self.clock(), busy=bool(self._in_flight))
        self.quotas.release(request_id, num_tokens)

    def take_retry(self) -> bool:
        """One token of the retry budget for a re-send the gateway makes
        (a backend's 429 tried on another backend); False when spent."""
        if self.retry_budget.refusal(is_retry=True) is not None:
            return False
        self.retry_budget.record_admission(is_retry=True)
        return True

    def num_in_flight(self, tenant: str) -> int:
        """Requests in flight of a tenant with limits (0 for the others)."""
        return self.quotas.num_inflight(tenant)


def wait_refusal(backends: Sequence[BackendLoad], num_tokens: int, limit_s: float,
                 return_slots: ReturnSlots) -> AdmissionDecision | None:
    """429 when no backend could start a request of `num_tokens` (prompt +
    max_tokens) within `limit_s`; None when one could. The reason names what
    binds on the backend with the shortest wait (a batch slot or KV blocks),
    and the Retry-After is the request's own return slot, spaced by the
    fleet's measured drain (admission/retry_after.py, as a replica's)."""
    if not backends:
        return None
    waits = [expected_wait_s(b, num_tokens) for b in backends]
    first = min(range(len(waits)), key=waits.__getitem__)  # ties: the earlier backend
    wait_s, soonest = waits[first], backends[first]
    if wait_s <= limit_s:
        return None
    if any(not math.isfinite(w) and b.drain_rps is None and b.running_cap is not None
           for w, b in zip(waits, backends)):
        # A kvserve backend (it exports its running cap, so it admits on its
        # own) whose drain the door has not measured yet, as in a fresh
        # fleet's first burst: the door knows only "beyond one batch", while
        # the backend's own admission has the step times of its warm-up and
        # answers honestly (its 429 goes to FullAnswers). A backend without
        # admission of its own (vLLM) keeps the door's cold rule.
        return None
    reason = Reason.KV_CACHE if kv_binds(soonest, num_tokens) else Reason.BATCH_SLOTS
    fleet_drain_rps = sum(b.drain_rps or 0.0 for b in backends)
    retry_s = return_slots.take(earliest_return_s(wait_s, limit_s),
                                1.0 / fleet_drain_rps if fleet_drain_rps > 0 else 0.0)
    shown = f"{wait_s:.2f} s" if math.isfinite(wait_s) else "unbounded (no measured drain)"
    what = "KV blocks" if reason == Reason.KV_CACHE else "a batch slot"
    return reject(429, reason, retry_s,
                  f"no backend can start this request within {limit_s:.2f} s: the shortest expected "
                  f"wait for {what} across {len(backends)} backends is {shown}", wait_s)


@dataclass
class Saturated:
    """No backend took the request: why (a Reason, or the code a backend's
    429 gave), and when to come back (whole seconds)."""

    reason: str
    message: str
    retry_after_s: int


@dataclass
class FullAnswers:
    """The 429s backends answered one request (each refused it before
    starting it): their Retry-After (None: not sent) and error code."""

    retry_afters_s: list[int | None] = field(default_factory=list)
    codes: list[str | None] = field(default_factory=list)

    def record(self, retry_after_s: int | None, code: str | None) -> None:
        self.retry_afters_s.append(retry_after_s)
        self.codes.append(code)

    def __len__(self) -> int:
        return len(self.codes)

    def may_try_another(self, num_left: int, quotas: FleetQuotas) -> bool:
        """After the first 429 only, with a backend left and a retry token
        (taken here): one other backend is asked, never a round of all."""
        return len(self) == 1 and num_left > 0 and quotas.take_retry()

    def saturated(self, left: Sequence[BackendLoad]) -> Saturated:
        """The client's one 429: Retry-After is the soonest any backend that
        answered 429, or another eligible one by its measured drain, expects room."""
        waits = [s for s in self.retry_afters_s if s is not None]
        waits += [whole_seconds(expected_wait_s(b)) for b in left]
        reason = (self.codes[-1] if self.codes else None) or Reason.QUEUE_FULL
        return Saturated(reason, f"every backend tried is full ({len(self)} answered 429)", min(waits or [1]))
