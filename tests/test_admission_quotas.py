"""Tenant quotas and the retry budget on their own: no KV blocks, no queue,
only a clock (what a gateway in front of many replicas keeps)."""

from kvserve.admission.decision import Outcome, Reason
from kvserve.admission.quotas import RetryBudget, TenantLimits, TenantQuotas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_concurrency_is_held_until_release_and_other_tenants_are_free():
    clock = Clock()
    quotas = TenantQuotas({"a": TenantLimits(max_concurrent=2)}, clock)
    for rid in ("a1", "a2"):
        assert quotas.refusal("a", 10) is None
        quotas.acquire(rid, "a", 10)
    refusal = quotas.refusal("a")  # any size
    assert (refusal.outcome, refusal.status, refusal.reason, refusal.retry_after_s) == \
        (Outcome.REJECT, 429, Reason.TENANT_QUOTA, 1)
    assert quotas.refusal("b", 10**9) is None and quotas.num_inflight("b") == 0  # no limits: never held
    quotas.release("a1")
    quotas.release("a1")  # a second release changes nothing
    assert quotas.num_inflight("a") == 1 and quotas.refusal("a", 10) is None


def test_tokens_per_minute_slide_refund_to_actual_and_say_when_to_retry():
    clock = Clock()
    quotas = TenantQuotas({"t": TenantLimits(tokens_per_minute=100)}, clock)
    too_big = quotas.refusal("t", 101)
    assert (too_big.status, too_big.reason) == (400, Reason.NEVER_FITS)
    quotas.acquire("r1", "t", 60)
    clock.now += 20
    quotas.acquire("r2", "t", 30)
    over = quotas.refusal("t", 20)
    assert (over.status, over.reason) == (429, Reason.TENANT_QUOTA)
    assert over.retry_after_s == 40  # r1's charge leaves the window 60 s after it was made
    quotas.release("r1", num_tokens_used=10)  # used far less than it was charged
    assert quotas.refusal("t", 20) is None
    quotas.acquire("r3", "t", 20)
    clock.now += 41  # r1 (charged at 100 s) is out of the window
    assert quotas.refusal("t", 50) is None


def test_retries_spend_what_first_attempts_earn():
    clock = Clock()
    budget = RetryBudget(ratio=0.5, burst=2.0, rate_window_s=10.0, clock=clock)
    assert budget.refusal(is_retry=False) is None
    for _ in range(2):  # the burst
        assert budget.refusal(is_retry=True) is None
        budget.record_admission(is_retry=True)
    refusal = budget.refusal(is_retry=True)
    assert (refusal.status, refusal.reason) == (429, Reason.RETRY_BUDGET) and refusal.retry_after_s >= 1
    budget.record_admission(is_retry=False)
    assert budget.refusal(is_retry=True) is not None  # half a retry earned
    budget.record_admission(is_retry=False)
    assert budget.refusal(is_retry=True) is None
    for _ in range(10):
        budget.record_admission(is_retry=False)
    assert budget.tokens == 2.0  # never more than the burst


def test_a_refused_retrys_wait_follows_the_measured_admission_rate():
    def retry_after(admissions_per_s: float) -> int:
        clock = Clock()
        budget = RetryBudget(ratio=0.1, burst=1.0, rate_window_s=10.0, clock=clock)
        budget.record_admission(is_retry=True)  # the bucket is empty
        budget.advance(clock.now, busy=True)
        for _ in range(40):
            clock.now += 1 / admissions_per_s
            budget.advance(clock.now, busy=True)
            budget.tokens = 0.0  # keep it empty: only the rate is measured
            budget.record_admission(is_retry=False)
            budget.tokens = 0.0
        return budget.refusal(is_retry=True).retry_after_s

    # One retry needs 10 first attempts: ~1 s at 10 per second, ~10 s at 1 per second.
    assert retry_after(10.0) <= 2 and retry_after(1.0) >= 8
