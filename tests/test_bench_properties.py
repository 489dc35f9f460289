"""Invariants of the pure-Python bench core, for any input (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.bench.arrivals import arrival_offsets, parse_arrival
from kvserve.bench.report import OUTCOMES, SLO, RequestRecord, build_report, histogram_quantile
from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests

ARRIVALS = st.sampled_from(["constant", "poisson", "gamma:burstiness=3", "gamma:burstiness=0.3",
                            "diurnal:period=5,amplitude=0.9", "step:rates=1/4/0.5,step=2",
                            "ramp:start=0.5,end=6,duration=4"])


@settings(max_examples=60, deadline=None)
@given(ARRIVALS, st.floats(0.5, 50), st.integers(0, 200), st.integers(0, 2**31))
def test_offsets_are_sorted_non_negative_and_bounded(kind, rate, count, seed):
    offsets = arrival_offsets(parse_arrival(kind, rate), num_requests=count, duration_s=30.0,
                              seed=seed)
    assert len(offsets) <= count
    assert all(a <= b for a, b in zip(offsets, offsets[1:]))
    assert all(0 <= o < 30.0 for o in offsets)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.floats(0.01, 3), st.integers(0, 2**31))
def test_sampled_lengths_respect_bounds(lo, span, sigma, seed):
    hi = lo + span
    dist = LengthDist("lognormal", (("median", float(lo + span // 2)), ("sigma", sigma),
                                    ("min", float(lo)), ("max", float(hi))))
    spec = WorkloadSpec((LengthClass("x", 1.0, dist, dist),), prefix_share=0.5,
                        num_prefix_groups=2, prefix_tokens=lo)
    for r in generate_requests(spec, 40, seed):
        assert lo <= r.output_tokens <= hi
        assert r.prompt_tokens >= lo
        if r.prefix_group:
            assert r.prompt_tokens > r.prefix_group.prefix_tokens


RECORD = st.builds(
    lambda i, outcome, sent, ttft, gaps, status: RequestRecord(
        i, outcome, sent, sent, sent, tuple((sent + ttft + sum(gaps[:k]), 1) for k in range(len(gaps)))
        if outcome in ("success", "cancelled") else (), sent + ttft + sum(gaps), status),
    st.integers(0, 10**6), st.sampled_from(OUTCOMES), st.floats(0, 100), st.floats(0, 5),
    st.lists(st.floats(0, 1), min_size=0, max_size=8), st.sampled_from([200, 429, 500, None]))


@settings(max_examples=80, deadline=None)
@given(st.lists(RECORD, max_size=30), st.floats(0.1, 3), st.floats(0.01, 1))
def test_report_invariants(records, ttft_s, tpot_s):
    s = build_report(records, SLO(ttft_s, tpot_s))["summary"]
    assert sum(s["outcomes"][k] for k in OUTCOMES) == len(records)
    assert sum(s["outcomes"]["rejected_reasons"].values()) == s["outcomes"]["rejected"]
    assert s["num_good"] <= s["outcomes"]["success"]
    assert s["goodput"] <= s["request_throughput"] + 1e-12
    if s["slo_attainment"] is not None:
        assert 0.0 <= s["slo_attainment"] <= 1.0
    for name in ("ttft", "tpot", "e2e"):
        stats = s[name]
        if stats["count"]:
            assert stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_histogram_quantile_is_monotone_and_inside_the_buckets(increments, q1, q2):
    bounds = [0.01 * 2**i for i in range(len(increments))] + [float("inf")]
    cumulative, total = [], 0
    for bound, inc in zip(bounds, increments + [0]):
        total += inc
        cumulative.append((bound, float(total)))
    lo, hi = sorted((q1, q2))
    a, b = histogram_quantile(cumulative, lo), histogram_quantile(cumulative, hi)
    if total == 0:
        assert a is None and b is None
    else:
        assert 0.0 <= a <= b <= bounds[-2]
