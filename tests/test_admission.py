"""AdmissionController: pure Python, driven by a fake clock."""

from __future__ import annotations

import random

import pytest

from kvserve.admission.busy_rate import BusyRate
from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionRequest, Outcome
from kvserve.admission.quotas import TenantLimits
from kvserve.config import AdmissionConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=100, block_size=16, max_num_seqs=64, tenants=None, **config):
    clock = FakeClock()
    ctl = AdmissionController(AdmissionConfig(**config), num_blocks, block_size, max_num_seqs,
                              clock, tenants)
    return ctl, clock


_ids = iter(range(10**9))


def req(prompt=16, max_tokens=16, **kw):
    return AdmissionRequest(f"r{next(_ids)}", prompt, max_tokens, **kw)


def admit(ctl, request):
    decision = ctl.check(request)
    assert decision.admitted, decision
    ctl.admit(request, decision)
    return decision


def test_never_fits_is_400_and_prefix_hit_counts():
    ctl, _ = make(num_blocks=4, block_size=16)
    too_big = ctl.check(req(prompt=60, max_tokens=10))
    assert (too_big.outcome, too_big.status, too_big.reason) == (Outcome.REJECT, 400, "never_fits")
    assert too_big.retry_after_s is None
    # The same request with most of its prompt already cached fits.
    assert ctl.check(req(prompt=60, max_tokens=10, num_cached_tokens=16)).admitted


def test_cold_start_allows_one_cache_of_queue_then_refuses_with_retry_after():
    ctl, _ = make(num_blocks=10, block_size=16)
    decisions = []
    for _ in range(30):
        r = req(prompt=16, max_tokens=16)  # 2 blocks each
        d = ctl.check(r)
        decisions.append(d)
        if d.admitted:
            ctl.admit(r, d)
    admitted = [d for d in decisions if d.admitted]
    rejected = [d for d in decisions if not d.admitted]
    assert len(admitted) == 10  # 5 fit now + one more cache (5) may queue
    assert rejected and all(d.status == 429 and d.reason == "kv_cache" for d in rejected)
    assert all(isinstance(d.retry_after_s, int) and d.retry_after_s >= 1 for d in rejected)


def _run_drain(ctl, clock, finish_every_s, n=20):
    """Admit and start n requests, finishing one every `finish_every_s`."""
    rids = []
    for _ in range(n):
        r = req(prompt=16, max_tokens=16)
        d = ctl.check(r)
        if d.admitted:
            ctl.admit(r, d)
            ctl.on_start(r.request_id)
            rids.append(r.request_id)
    for rid in rids[: len(rids) // 2]:
        clock.now += finish_every_s
        ctl.on_finish(rid, 20)


def test_measured_drain_rate_decides_the_wait():
    fast, fast_clock = make(num_blocks=10, max_queue_wait_s=1.0)
    slow, slow_clock = make(num_blocks=10, max_queue_wait_s=1.0)
    _run_drain(fast, fast_clock, finish_every_s=0.05)
    _run_drain(slow, slow_clock, finish_every_s=2.0)
    assert fast.expected_wait_s(req())[0] < slow.expected_wait_s(req())[0]
    # The same queue ahead: the fast drain admits, the slow one refuses.
    assert fast.check(req()).outcome == Outcome.ADMIT
    slow_out = slow.check(req())
    assert slow_out.outcome == Outcome.REJECT and slow_out.reason == "kv_cache" and slow_out.retry_after_s >= 1


def test_idle_time_does_not_decay_the_drain_rate():
    rate = BusyRate(tau_s=5.0)
    rate.advance(0.0, busy=True)
    for t in range(1, 11):
        rate.advance(float(t), busy=True)
        rate.add(2.0)
    busy_rate = rate.rate(10.0)
    assert busy_rate == pytest.approx(2.0, rel=0.15)
    rate.advance(10.0, busy=False)
    assert rate.rate(1000.0) == pytest.approx(busy_rate)


def test_bounded_queue_gives_queue_full():
    ctl, _ = make(num_blocks=1000, max_queue_len=3)
    for _ in range(3):
        admit(ctl, req())
    d = ctl.check(req())
    assert (d.status, d.reason) == (429, "queue_full") and d.retry_after_s >= 1


def test_urgent_class_skips_queued_deferred_work():
    ctl, _ = make(num_blocks=10, block_size=16, max_queue_wait_s=1.0)
    for _ in range(10):  # fill the cache and the cold queue allowance with deferred work
        admit(ctl, req(priority=1))
    assert ctl.check(req(priority=1)).outcome == Outcome.REJECT
    assert ctl.check(req(priority=0)).outcome == Outcome.ADMIT


def test_tenant_concurrency_quota():
    ctl, _ = make(num_blocks=1000, tenants={"a": TenantLimits(max_concurrent=2)})
    first, second = req(tenant="a"), req(tenant="a")
    admit(ctl, first)
    admit(ctl, second)
    d = ctl.check(req(tenant="a"))
    assert (d.status, d.reason) == (429, "tenant_quota") and d.retry_after_s >= 1
    assert ctl.check(req(tenant="b")).admitted  # other tenants unaffected
    ctl.on_finish(first.request_id, 10)
    assert ctl.check(req(tenant="a")).admitted


def test_tenant_tokens_per_minute_refunds_to_actual_and_expires():
    ctl, clock = make(num_blocks=1000, tenants={"a": TenantLimits(tokens_per_minute=100)})
    big = req(tenant="a", prompt=10, max_tokens=60)  # charged 70
    admit(ctl, big)
    d = ctl.check(req(tenant="a", prompt=10, max_tokens=30))  # 40 more: 110 > 100
    assert (d.status, d.reason) == (429, "tenant_quota")
    assert 1 <= d.retry_after_s <= 60
    ctl.on_finish(big.request_id, num_tokens=15)  # used only 15
    assert ctl.check(req(tenant="a", prompt=10, max_tokens=30)).admitted
    never = ctl.check(req(tenant="a", prompt=50, max_tokens=60))
    assert (never.status, never.reason) == (400, "never_fits")
    clock.now += 61
    assert ctl.check(req(tenant="a", prompt=10, max_tokens=80)).admitted


def test_retry_budget_is_a_fraction_of_admissions():
    ctl, _ = make(num_blocks=10**6, max_queue_len=10**6, retry_budget=0.1, retry_budget_burst=2)
    admit(ctl, req(is_retry=True))
    admit(ctl, req(is_retry=True))
    d = ctl.check(req(is_retry=True))
    assert (d.status, d.reason) == (429, "retry_budget") and d.retry_after_s >= 1
    for _ in range(10):
        admit(ctl, req())
    admit(ctl, req(is_retry=True))
    assert ctl.check(req(is_retry=True)).reason == "retry_budget"


def test_degrade_caps_max_tokens_instead_of_refusing():
    ctl, _ = make(num_blocks=10, block_size=16, degrade_wait_s=0.5, degrade_max_tokens=16)
    for _ in range(9):
        admit(ctl, req(prompt=16, max_tokens=16))  # 18 of 20 allowed cold blocks
    long = req(prompt=16, max_tokens=64)  # 5 blocks would not fit, 2 blocks do
    d = ctl.check(long)
    assert d.outcome == Outcome.DEGRADE and d.max_tokens == 16
    ctl.admit(long, d)
    no_degrade, _ = make(num_blocks=10, block_size=16)
    for _ in range(9):
        admit(no_degrade, req(prompt=16, max_tokens=16))
    assert no_degrade.check(req(prompt=16, max_tokens=64)).outcome == Outcome.REJECT


def test_degrade_counts_queueing_not_the_latency_of_being_scheduled():
    # degrade_wait_s=0: degrade whatever must queue, never what starts at once.
    ctl, clock = make(num_blocks=100, block_size=16, max_num_seqs=4, degrade_wait_s=0.0,
                      degrade_max_tokens=5)
    first = req(max_tokens=10)
    assert admit(ctl, first).outcome == Outcome.ADMIT
    clock.now += 0.02  # it took 20 ms to be scheduled: a start latency, not a queue
    ctl.on_start(first.request_id)
    clock.now += 1.0
    ctl.on_finish(first.request_id)  # and a drain rate is measured
    assert ctl.expected_wait_s(req(max_tokens=10))[0] > 0
    free_slots = [admit(ctl, req(max_tokens=10)).outcome for _ in range(4)]
    assert free_slots == [Outcome.ADMIT] * 4
    assert ctl.check(req(max_tokens=10)).outcome == Outcome.DEGRADE  # all four slots are taken


def test_queue_timeout_and_deadline_expire_unstarted_requests():
    ctl, clock = make(num_blocks=1000, queue_timeout_s=5.0)
    waiting = req()
    started = req()
    urgent = req(deadline=clock.now + 1.0)
    for r in (waiting, started, urgent):
        admit(ctl, r)
    ctl.on_start(started.request_id)
    clock.now += 2.0
    assert ctl.expired() == [(urgent.request_id, "deadline")]
    clock.now += 4.0
    assert sorted(ctl.expired()) == sorted([(waiting.request_id, "queue_timeout"),
                                            (urgent.request_id, "deadline")])


def test_deadline_shorter_than_expected_wait_is_refused_at_the_door():
    ctl, clock = make(num_blocks=10, block_size=16, max_queue_wait_s=100.0)
    _run_drain(ctl, clock, finish_every_s=1.0)
    wait_s, _ = ctl.expected_wait_s(req())
    assert wait_s > 0.5
    d = ctl.check(req(deadline=clock.now + wait_s / 2))
    assert (d.status, d.reason) == (429, "deadline")


def _feed(ctl, steps, a_s, per_decode_s, per_prefill_s, noise=0.0, seed=0):
    """Observe synthetic steps from a known cost, with +-noise relative jitter."""
    rng = random.Random(seed)
    for decodes, prefill in steps:
        step_s = a_s + per_decode_s * decodes + per_prefill_s * prefill
        ctl.observe_step(decodes, prefill, step_s * (1 + rng.uniform(-noise, noise)))


# Decode batches of 0..8 with and without prefill chunks, in a shuffled order.
_GRID = [(d, p) for d in range(9) for p in (0, 0, 16, 64, 256, 512)]
random.Random(1).shuffle(_GRID)


def test_step_model_recovers_intercept_and_both_slopes():
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.105)
    _feed(ctl, _GRID * 3, 0.04, 0.015, 0.001)
    fit = ctl.step_model.fit()
    assert fit.intercept_s == pytest.approx(0.04, rel=1e-6)
    assert fit.per_decode_seq_s == pytest.approx(0.015, rel=1e-6)
    assert fit.per_prefill_token_s == pytest.approx(0.001, rel=1e-6)
    # Budget 0.105 s x 0.9 headroom = 94.5 ms: 40 + 15 B <= 94.5 up to B = 3.
    assert ctl.running_cap() == 3
    # Beside 2 decodes 24.5 ms are left = 24 prefill tokens; beside 3 only
    # 9.5 ms, so the minimum chunk (16 tokens) applies.
    assert ctl.step_limiter.prefill_token_budget(2) == 24
    assert ctl.step_limiter.prefill_token_budget(3) == 16
    assert ctl.step_limits(2)[:2] == (3, 2 + 24)


def test_fitted_step_limits_spare_the_steps_that_decode_no_one():
    # A longer step delays no one's next token when no running request
    # decodes (none runs, or all are part-way through their prompt): once
    # fitted, the budget binds only steps with a decode, so a lone prompt
    # runs in the scheduler's own chunks, not TPOT-sized ones.
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.105)
    _feed(ctl, _GRID * 3, 0.04, 0.015, 0.001)
    assert ctl.step_limits(2) == (3, 2 + 24, False)
    # Before the fit the bound binds every step: a burst must not start on
    # full-size chunks before the running cap is measured.
    cold, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    cold.observe_step(0, 512, 1.0)
    assert cold.step_limits(0) == (64, 46, True)


def test_step_model_fit_tolerates_noisy_steps():
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.105)
    _feed(ctl, _GRID * 3, 0.04, 0.015, 0.001, noise=0.05, seed=7)
    fit = ctl.step_model.fit()  # within 10% of each true coefficient
    assert fit.intercept_s == pytest.approx(0.04, rel=0.1)
    assert fit.per_decode_seq_s == pytest.approx(0.015, rel=0.1)
    assert fit.per_prefill_token_s == pytest.approx(0.001, rel=0.1)
    assert ctl.running_cap() == 3


def test_prefill_heavy_steps_no_longer_inflate_the_running_cap():
    # The failure measured on the CPU server: decode-only steps of 6..9
    # sequences fit the budget and every other step carries a 512-token chunk.
    # True cost 20 ms + 6 ms/seq + 0.3 ms/prefill token, TPOT 100 ms.
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    steps = [(d, p) for _ in range(10) for d in (6, 7, 8, 9) for p in (0, 512)]
    _feed(ctl, steps, 0.02, 0.006, 0.0003)
    # 0.02 + 0.006 B <= 0.09 up to B = 11. (The old one-factor fit on batched
    # tokens gave slope ~0.3 ms/token and intercept ~63 ms: a cap of ~90,
    # clamped to max_num_seqs = 64.)
    assert ctl.running_cap() == 11
    # Beside 6 decodes: 0.09 - 0.02 - 0.036 = 34 ms = 113 prefill tokens, so
    # a 512-token chunk no longer stretches every decode's step.
    assert ctl.step_limiter.prefill_token_budget(6) == 113
    assert ctl.step_limiter.prefill_token_budget(11) == 16


def test_decode_only_steps_fit_intercept_and_decode_slope_alone():
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    assert ctl.running_cap() == 64  # nothing measured: no cap beyond the config
    assert ctl.step_limiter.prefill_token_budget(4) is None
    assert ctl.step_limits(4) == (64, None, True)
    _feed(ctl, [(d, 0) for d in range(1, 9)] * 5, 0.012, 0.01, 0.0)
    fit = ctl.step_model.fit()
    assert fit.per_prefill_token_s is None  # never varied: not identified
    assert fit.intercept_s == pytest.approx(0.012) and fit.per_decode_seq_s == pytest.approx(0.01)
    assert ctl.running_cap() == 7  # 12 + 10 B <= 90 ms
    assert ctl.step_limits(4)[:2] == (7, None)


def test_before_the_fit_a_slow_prefill_step_shrinks_the_next_chunks():
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    ctl.observe_step(0, 512, 1.0)  # a full chunk took a second (a slow CPU)
    assert ctl.step_model.fit() is None
    assert ctl.running_cap() == 64  # no decode measured yet
    # The whole second charged to 512 tokens: 90 ms of budget holds 46.
    assert ctl.step_limiter.prefill_token_budget(0) == 46
    assert ctl.step_limits(0) == (64, 46, True)


def test_one_batch_size_grows_the_cap_by_one_or_scales_it_down():
    fast, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    _feed(fast, [(10, 0)] * 20, 0.05, 0.0, 0.0)
    assert fast.running_cap() == 11  # room: grow by one, then measure again
    slow, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    _feed(slow, [(10, 0)] * 20, 0.17, 0.0, 0.0)
    assert slow.running_cap() == 5  # 10 sequences x 90 ms / 170 ms
    prompt_only, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    _feed(prompt_only, [(0, p) for p in (64, 512)] * 10, 0.05, 0.0, 0.001)
    assert prompt_only.running_cap() == 64  # no decode measured yet


def test_convex_prefill_cost_does_not_charge_the_fixed_step_cost_to_each_decode():
    # As measured on this CPU: large prefill chunks cost more per token than
    # small ones (the warm-up's 496-token chunk 5 ms/token, a 25-token one 2).
    # A line through them and the decodes had a negative intercept, was
    # refitted through the origin and charged the 45 ms fixed cost to each
    # decode sequence: a cap of 2. Decode-only steps alone give 45 + 7 B.
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.1)

    def prefill_s(p):
        return 0.045 + 0.002 * p + 0.000006 * p * p

    def decodes(n):
        for d in (1, 2) * n:
            ctl.observe_step(d, 0, 0.045 + 0.007 * d)

    for p in (496, 372, 248, 124):  # the warm-up's chunks
        ctl.observe_step(0, p, prefill_s(p))
    decodes(10)
    for p in (22, 37):  # lone prompts, each in one step
        ctl.observe_step(0, p, prefill_s(p))
    decodes(3)
    assert ctl.step_model.fit().intercept_s == 0.0  # the joint line bends to the origin
    decode = ctl.step_model.decode_fit()
    assert decode.intercept_s == pytest.approx(0.045) and decode.per_decode_seq_s == pytest.approx(0.007)
    assert ctl.running_cap() == 6  # 45 + 7 B <= 90 ms


def test_a_decode_is_never_fitted_cheaper_than_a_prefill_token():
    # Decode counts that vary with no visible cost (noise on a busy machine)
    # must not lift the cap to max_num_seqs: a decode costs at least what a
    # prefill token does (1 ms here), so 30.5 + 1 x B <= 90 ms gives 59.
    ctl, _ = make(max_num_seqs=256, tpot_slo_s=0.1)
    _feed(ctl, [(d, p) for d in (2, 3, 4) for p in (0, 32, 64)] * 4, 0.0305, 0.0, 0.001)
    assert ctl.running_cap() == 59


def test_steps_that_get_faster_with_more_work_never_give_negative_costs():
    ctl, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    _feed(ctl, [(d, 0) for d in range(1, 9)] * 5, 0.08, -0.005, 0.0)
    fit = ctl.step_model.fit()
    assert fit.per_decode_seq_s == 0.0 and fit.intercept_s >= 0
    assert ctl.running_cap() == 64
    cheap, _ = make(max_num_seqs=256, tpot_slo_s=0.1)
    _feed(cheap, _GRID, 0.001, 0.00001, 0.000001)
    assert cheap.running_cap() == 256


def test_rejected_decision_cannot_be_admitted():
    ctl, _ = make(num_blocks=1)
    r = req(prompt=100)
    with pytest.raises(ValueError):
        ctl.admit(r, ctl.check(r))


def test_a_flooding_tenant_does_not_lengthen_another_tenants_wait():
    ctl, clock = make(num_blocks=10, block_size=16, max_queue_wait_s=1.0)
    _run_drain(ctl, clock, finish_every_s=0.2)  # measured drain, 5 running
    flood = 0
    while ctl.check(req(tenant="flood")).admitted:
        admit(ctl, req(tenant="flood"))
        flood += 1
    assert flood >= 1
    flooder_wait, _ = ctl.expected_wait_s(req(tenant="flood"))
    other_wait, _ = ctl.expected_wait_s(req(tenant="quiet"))
    assert other_wait < flooder_wait
    assert ctl.check(req(tenant="quiet")).admitted
    assert ctl.check(req(tenant="flood")).reason in ("kv_cache", "batch_slots")


def test_observed_waits_longer_than_predicted_raise_later_predictions():
    def run(late_factor: float) -> float:
        ctl, clock = make(num_blocks=10, block_size=16, max_queue_wait_s=100.0)
        _run_drain(ctl, clock, finish_every_s=0.2)
        for _ in range(20):  # the same timeline; only when on_start comes differs
            r = req()
            d = ctl.check(r)
            ctl.admit(r, d)
            clock.now += late_factor * d.expected_wait_s
            ctl.on_start(r.request_id)
            clock.now += (3.0 - late_factor) * d.expected_wait_s
            ctl.on_finish(r.request_id, 20)
        return ctl.expected_wait_s(req())[0]

    on_time, late = run(1.0), run(3.0)
    assert on_time > 0.05
    assert late > 1.5 * on_time


def test_refusal_for_any_size_never_refuses_what_check_would_admit():
    """The size-independent pre-check refuses only when `check` refuses
    every request of the class, whatever its size; it changes no state."""
    ctl, clock = make(num_blocks=40, block_size=16, max_num_seqs=4, max_queue_wait_s=1.0,
                      tenants={"a": TenantLimits(max_concurrent=1)})
    for _ in range(12):
        ctl.observe_step(4, 0, 0.01)  # a measured step: 4 decodes in 10 ms
    rng = random.Random(0)
    num_early = 0
    for _ in range(80):  # sizes from 1 to 5 blocks: the batch slots bind before the cache
        size = req(prompt=rng.randint(1, 40), max_tokens=rng.randint(1, 40))
        before = (ctl.num_queued, ctl.num_started)
        early = ctl.refusal_for_any_size(size.priority, size.tenant, size.is_retry, size.deadline)
        assert (ctl.num_queued, ctl.num_started) == before
        full = ctl.check(size)
        if early is not None:
            num_early += 1
            assert not full.admitted and (early.status, full.status) == (429, 429)
            assert early.reason in ("kv_cache", "batch_slots") and 1 <= early.retry_after_s
        if full.admitted:
            ctl.admit(size, full)
        clock.now += 0.01
    assert num_early > 0 and ctl.refusal_for_any_size() is not None  # the queue got over its limit
    admit(ctl, req(tenant="a", max_tokens=1))
    quota = ctl.refusal_for_any_size(tenant="a")
    assert (quota.status, quota.reason) == (429, "tenant_quota")


def test_a_batch_of_observed_steps_is_each_step_observed_in_order():
    # A simulator's decode run feeds its steps at once (observe_steps): the
    # fit and the limits are those of feeding them one by one, empty steps
    # and negative times skipped as observe_step skips them.
    rng = random.Random(5)
    steps = [(rng.randint(0, 40), rng.choice([0, 0, rng.randint(1, 300)]), rng.uniform(-0.001, 0.05))
             for _ in range(300)]
    steps += [(0, 0, 0.02), (3, 0, -1.0), (5, 0, float("nan"))]
    one_by_one, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    batched, _ = make(max_num_seqs=64, tpot_slo_s=0.1)
    for i in range(0, len(steps), 37):
        for s in steps[i:i + 37]:
            one_by_one.observe_step(*s)
        batched.observe_steps(iter(steps[i:i + 37]))
        assert batched.step_model.fit() == one_by_one.step_model.fit()
        assert batched.step_limits(7) == one_by_one.step_limits(7)
    assert batched.step_model.mean_step_s == one_by_one.step_model.mean_step_s


def test_queued_and_started_counts_follow_starts_and_finishes():
    ctl, clock = make(num_blocks=1000, queue_timeout_s=5.0)
    requests = [req() for _ in range(6)]
    for r in requests:
        admit(ctl, r)
    for r in requests[1:4]:
        ctl.on_start(r.request_id)
    ctl.on_start(requests[1].request_id)  # a second start changes nothing
    ctl.on_finish(requests[2].request_id)  # started, then finished
    ctl.on_finish(requests[5].request_id)  # finished (aborted) before starting
    assert (ctl.num_queued, ctl.num_started, ctl.num_inflight()) == (2, 2, 4)
    clock.now += 6.0
    assert ctl.expired() == [(requests[0].request_id, "queue_timeout"), (requests[4].request_id, "queue_timeout")]
    # Work ahead counts the started requests' blocks: a big request now
    # waits for them to drain, as before any finish.
    assert ctl.expected_wait_s(req(prompt=16 * 995, max_tokens=16))[0] > ctl.expected_wait_s(req())[0]


def _saturated(max_num_seqs=2, **config):
    """A controller whose running batch is full and whose drain is measured
    (one request finishes every 0.5 s)."""
    ctl, clock = make(num_blocks=1000, block_size=16, max_num_seqs=max_num_seqs, max_queue_wait_s=1.0, **config)
    for _ in range(12):
        ctl.observe_step(max_num_seqs, 0, 0.05)
    for _ in range(6):
        r = req()
        ctl.decide(r)
        ctl.on_start(r.request_id)
        clock.now += 0.5
        ctl.on_finish(r.request_id, 32)
    while ctl.decide(req()).admitted:  # fill the batch and the queue up to the wait limit
        pass
    return ctl, clock


def test_a_refused_burst_is_told_to_come_back_one_drain_interval_after_another():
    ctl, _ = _saturated()
    burst = [ctl.decide(req()) for _ in range(12)]
    assert all(d.status == 429 for d in burst)
    advised = [d.retry_after_s for d in burst]
    assert advised == sorted(advised), advised  # later in the line, later back
    # ~2 requests drain per second: about that many are sent back per second.
    assert max(advised.count(s) for s in set(advised)) <= 3, advised
    assert advised[-1] - advised[0] >= 4, advised


def test_early_refusals_and_full_refusals_share_the_return_slots():
    ctl, _ = _saturated()
    early = [ctl.refusal_for_any_size() for _ in range(4)]
    full = [ctl.decide(req()) for _ in range(4)]
    advised = [d.retry_after_s for d in early + full]
    assert advised == sorted(advised) and advised[-1] > advised[0], advised


def test_refusals_name_what_binds():
    ctl, _ = _saturated(max_num_seqs=2)  # plenty of blocks: the batch slots bind
    assert ctl.decide(req()).reason == "batch_slots"
    short, _ = make(num_blocks=1000, max_queue_len=2)
    for _ in range(2):
        admit(short, req())
    assert short.check(req()).reason == "queue_full"


def test_deadline_refusals_say_a_positive_limit():
    ctl, clock = _saturated()
    soon = ctl.decide(req(deadline=clock.now + 0.004))
    past = ctl.decide(req(deadline=clock.now - 0.5))
    assert (soon.reason, past.reason) == ("deadline", "deadline")
    assert "4.0 ms left before the request's deadline" in soon.message, soon.message
    assert "deadline passed" in past.message and "-" not in past.message, past.message


def test_a_loose_tpot_target_does_not_lift_the_running_cap_past_the_ttft_target():
    # Each decoding sequence costs 50 ms of step: with --tpot-slo 1000 the TPOT
    # target allows any batch, but a 64-sequence step (3.2 s) would put every
    # arrival's first token past the 2 s TTFT target.
    ctl, _ = make(num_blocks=1000, max_num_seqs=64, tpot_slo_s=1000.0, ttft_slo_s=2.0)
    for batch in (1, 2, 4, 8, 12, 16) * 4:
        ctl.observe_step(batch, 0, 0.01 + 0.05 * batch)
    cap = ctl.running_cap()
    assert 2 <= cap < 64, cap
    assert 0.01 + 0.05 * cap <= 2.0 / 2, cap  # a step leaves most of the TTFT target to queueing and prefill


def slow_prefill_controller():
    """A controller whose fit prices prefill at 2 ms a token and a decode
    step at ~10 ms; admission waits up to 2.2 s."""
    ctl, clock = make(num_blocks=1000, max_num_seqs=64, tpot_slo_s=1.0, ttft_slo_s=20.0, max_queue_wait_s=2.2)
    for p in (64, 128, 256, 512):
        ctl.observe_step(0, p, 0.002 * p)
    for d in (1, 2, 3, 4) * 3:
        ctl.observe_step(d, 0, 0.01 + 0.001 * d)
    return ctl, clock


def test_a_queue_of_long_prompts_is_a_wait_even_with_slots_and_blocks_free():
    # Prefill at 2 ms per token (a slow CPU: a 256-token prompt is ~0.5 s):
    # prompts admitted ahead are that much prefill before the next one's
    # turn, though the batch has slots and the cache has blocks.
    ctl, clock = slow_prefill_controller()
    assert ctl.expected_wait_s(req(prompt=256))[0] < 0.05  # nothing ahead: it starts at once
    ahead = [req(prompt=256) for _ in range(4)]
    for r in ahead:
        admit(ctl, r)
    wait_s, binding = ctl.expected_wait_s(req(prompt=256))
    assert binding == "prefill_backlog" and 1.8 <= wait_s <= 2.2, (wait_s, binding)
    admit(ctl, req(prompt=256))
    refused = ctl.check(req(prompt=256))  # one more prompt ahead: past the 2.2 s limit
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, "prefill_backlog"), refused
    # A started prompt's prefill goes on: half a second later less is ahead.
    ctl.on_start(ahead[0].request_id)
    clock.now += 0.5
    assert ctl.expected_wait_s(req(prompt=256))[0] < wait_s + 0.5 - 0.4


def test_a_wait_inside_the_queue_limit_is_refused_when_its_own_prefill_then_misses_the_ttft_target():
    # Prefill at 2 ms a token, a 2 s TTFT target and a 1.5 s queue-wait limit:
    # behind a 256-token prompt (0.5 s), an 800-token one would start well
    # inside the limit and still see its first token at 0.5 + 1.6 = 2.1 s.
    ctl, _ = make(num_blocks=1000, max_num_seqs=64, tpot_slo_s=1.0, ttft_slo_s=2.0, max_queue_wait_s=1.5)
    for p in (64, 128, 256, 512):
        ctl.observe_step(0, p, 0.002 * p)
    for d in (1, 2, 3, 4) * 3:
        ctl.observe_step(d, 0, 0.01 + 0.001 * d)
    admit(ctl, req(prompt=256))
    wait_s, _ = ctl.expected_wait_s(req(prompt=800))
    assert 0.4 <= wait_s <= 0.6, wait_s
    refused = ctl.check(req(prompt=800))
    assert (refused.outcome, refused.status, refused.reason) == (Outcome.REJECT, 429, "prefill_backlog"), refused
    assert "TTFT target of 2.00 s" in refused.message and refused.retry_after_s >= 1, refused.message
    assert ctl.check(req(prompt=600)).admitted  # 0.5 + 1.2 s: inside the target
    assert ctl.check(req(prompt=800, priority=1)).admitted  # a deferred class waits on its own limit
    # A prompt that cannot prefill inside the target even alone (2.4 s) is
    # refused behind others, yet admitted when it would start at once.
    assert not ctl.check(req(prompt=1200)).admitted
    idle, _ = make(num_blocks=1000, max_num_seqs=64, tpot_slo_s=1.0, ttft_slo_s=2.0, max_queue_wait_s=1.5)
    for p in (64, 128, 256, 512):
        idle.observe_step(0, p, 0.002 * p)
    assert idle.check(req(prompt=1200)).admitted
    # A queue-wait limit at or past the TTFT target accepts waits past it
    # (an opened-up server): the limit alone applies.
    opened, _ = make(num_blocks=1000, max_num_seqs=64, tpot_slo_s=1.0, ttft_slo_s=2.0, max_queue_wait_s=2.0)
    for p in (64, 128, 256, 512):
        opened.observe_step(0, p, 0.002 * p)
    admit(opened, req(prompt=256))
    assert opened.check(req(prompt=800)).admitted


def test_a_shared_prefix_stays_charged_to_whoever_holds_it_after_its_first_holder_leaves():
    # A 256-token system prompt (16 blocks of 16) and 40 blocks in all. A
    # prefilled it; B arrived on a prefix hit and was charged only its own 2
    # blocks. When A finishes, B still pins the 16 prefix blocks: the ledger
    # charges them to B (before, to no one, and a replica whose cache was
    # full of such prefixes admitted as if it were empty).
    ctl, clock = make(num_blocks=40, block_size=16, max_num_seqs=64, max_queue_wait_s=0.01)
    system = tuple(b"system-%d" % i for i in range(16))
    a = req(prompt=272, max_tokens=16, prompt_block_hashes=system + (b"a",))
    b = req(prompt=272, max_tokens=16, num_cached_tokens=256, prompt_block_hashes=system + (b"b",))
    for r in (a, b):
        admit(ctl, r)
        ctl.on_start(r.request_id)
    clock.now += 1.0
    ctl.on_finish(a.request_id)
    # 18 blocks of B's + 26 of a newcomer's are past the 40: it waits for KV.
    refused = ctl.check(req(prompt=400, max_tokens=16))
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, "kv_cache"), refused
    assert ctl.check(req(prompt=300, max_tokens=16)).admitted  # 18 + 20 fit
    ctl.on_finish(b.request_id)  # the prefix is held by no one now
    assert ctl.check(req(prompt=400, max_tokens=16)).admitted
    # A newcomer on the same prefix is charged for the blocks no admitted request holds.
    c = req(prompt=272, max_tokens=16, num_cached_tokens=256, prompt_block_hashes=system + (b"c",))
    admit(ctl, c)
    assert not ctl.check(req(prompt=400, max_tokens=16)).admitted


def test_a_prefix_shared_down_the_queue_is_prefilled_once():
    # Four 256-token prompts ahead at 2 ms a token, as above, but all behind
    # one 192-token system prompt none of them found cached at the door: the
    # first prefills it, the others will hit it when their turn comes, so
    # the backlog is 256 + 3 x 64 tokens, not 4 x 256.
    ctl, _ = slow_prefill_controller()
    system = tuple(b"system-%d" % i for i in range(12))  # 12 blocks of 16 tokens

    def prompt(i):  # chained hashes: past the shared blocks, each prompt's own
        return system + tuple(b"user-%d-%d" % (i, j) for j in range(4))

    for i in range(4):
        admit(ctl, req(prompt=256, prompt_block_hashes=prompt(i)))
    wait_s, _ = ctl.expected_wait_s(req(prompt=256, prompt_block_hashes=prompt(9)))
    assert 0.002 * (256 + 3 * 64) * 0.9 <= wait_s <= 0.002 * (256 + 3 * 64) * 1.1, wait_s
    # Without hashes (prefix caching off) every prompt is prefilled in full.
    ctl2, _ = slow_prefill_controller()
    for _ in range(4):
        admit(ctl2, req(prompt=256))
    assert ctl2.expected_wait_s(req(prompt=256))[0] >= 0.002 * 4 * 256 * 0.9


def test_a_prompt_prefilled_alone_is_priced_at_the_schedulers_chunks_not_the_tpot_budget():
    # An 8B-like step: 50 ms fixed, 10 ms a decode, 0.2 ms a prompt token; a
    # 0.1 s TPOT leaves ~150 prompt tokens beside one decode, where a step
    # that decodes no one prefills the scheduler's 1024-token chunk. A long
    # prompt prefilling with no one decoding is 2,000 x 0.25 ms ahead, not
    # 2,000 x 0.6 ms (priced at the budget's pace, a prefix-affinity backend
    # refused the next request as backlog with TTFT at 0.8 s of a 2 s SLO).
    clock = FakeClock()
    ctl = AdmissionController(AdmissionConfig(tpot_slo_s=0.1, ttft_slo_s=20.0, max_queue_wait_s=5.0), 1000, 16, 64,
                              clock, max_num_batched_tokens=1024)
    steps = [(0, p, 0.05 + 0.0002 * p) for p in (256, 512, 1024)] + \
            [(d, 0, 0.05 + 0.01 * d) for d in (1, 2, 3)] + [(1, 100, 0.05 + 0.01 + 0.0002 * 100)]
    ctl.observe_steps(steps * 4)
    alone_s = 2000 * (0.0002 + 0.05 / 1024)

    def started(prompt):
        r = req(prompt=prompt, max_tokens=32)
        admit(ctl, r)
        ctl.on_start(r.request_id)
        return r

    first = started(2000)
    ctl.observe_step(0, 1024, 0.05 + 0.0002 * 1024)  # it prefills alone
    wait_s, binding = ctl.expected_wait_s(req(prompt=2000))
    assert binding == "prefill_backlog" and 0.9 * alone_s <= wait_s <= 1.1 * alone_s, (wait_s, binding)
    # Once it decodes (the last step decoded one: the longest started), its
    # prefill is done whatever pace it ran at: nothing is ahead.
    clock.now += 0.3
    ctl.observe_step(1, 0, 0.06)
    assert ctl.expected_wait_s(req(prompt=2000))[0] < 0.05
    # A second prompt behind it now prefills beside that decode, in
    # TPOT-sized steps: well over twice as long.
    started(2000)
    ctl.observe_step(1, 150, 0.09)
    wait_s, binding = ctl.expected_wait_s(req(prompt=2000))
    assert binding == "prefill_backlog" and wait_s > 2 * alone_s, (wait_s, binding)
    ctl.on_finish(first.request_id)  # the decoder left: the one started is the prompt in prefill
    ctl.observe_step(0, 1024, 0.05 + 0.0002 * 1024)
    assert ctl.expected_wait_s(req(prompt=2000))[0] <= 1.1 * alone_s


def test_prompts_the_fit_prices_at_nothing_are_no_backlog():
    # A fast CPU and a tiny model: steps cost ~1 ms whatever their prefill,
    # so the fit prices a prompt token at 0. Charging each step's whole time
    # to its prompt tokens instead (the bound used before any fit) made the
    # prompts ahead look like 0.2 s of prefill and refused a burst of short
    # requests as prefill_backlog where they could start at once.
    ctl, _ = make(num_blocks=1000, max_num_seqs=64, max_queue_wait_s=0.05)
    for d, p in ((1, 0), (0, 20), (2, 0), (1, 16), (3, 0), (0, 40), (2, 8), (1, 0)) * 3:
        ctl.observe_step(d, p, 0.001)
    fit = ctl.step_model.fit()
    assert fit is not None and fit.per_prefill_token_s == 0.0, fit
    for _ in range(4):
        admit(ctl, req(prompt=200))
    wait_s, binding = ctl.expected_wait_s(req(prompt=200))
    assert binding != "prefill_backlog" and wait_s < 0.05, (wait_s, binding)
