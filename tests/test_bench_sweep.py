"""Capacity search on a stand-in server with known limits: it keeps up to
40 req/s (beyond that it rejects a third of the requests) and keeps TTFT
under the SLO up to 25 req/s (beyond that TTFT is 3 s)."""

from __future__ import annotations

import pytest

from kvserve.bench.report import SLO, RequestRecord, build_report
from kvserve.bench.sweep import capacity_search, is_sustainable

SUSTAINABLE_PER_S = 40.0
SLO_LIMIT_PER_S = 25.0


def _report_at(rate: float) -> dict:
    records = []
    for i in range(30):
        sent = i / rate
        if rate > SUSTAINABLE_PER_S and i % 3 == 0:
            records.append(RequestRecord(i, "rejected", sent, sent, None, (), sent + 0.01, 429,
                                         "queue_full"))
            continue
        ttft = 0.2 if rate <= SLO_LIMIT_PER_S else 3.0
        events = tuple((sent + ttft + k * 0.02, 1) for k in range(5))
        records.append(RequestRecord(i, "success", sent, sent, None, events, events[-1][0], 200))
    return build_report(records, SLO(2.0, 0.1))


def test_finds_both_capacities_within_tolerance():
    rates = []

    def run_at(rate):
        rates.append(rate)
        return _report_at(rate)

    result = capacity_search(run_at, start_rate=2.0, max_runs=14, rel_tol=0.05)
    assert len(rates) <= 14
    assert SLO_LIMIT_PER_S / 1.05 <= result.capacity_at_slo_per_s <= SLO_LIMIT_PER_S
    assert SUSTAINABLE_PER_S / 1.05 <= result.max_sustainable_rate_per_s <= SUSTAINABLE_PER_S
    assert result.max_sustainable_rate_per_s > result.capacity_at_slo_per_s
    assert len(result.to_dict()["points"]) == len(rates)


def test_run_budget_is_respected():
    calls = []
    capacity_search(lambda r: calls.append(r) or _report_at(r), start_rate=1.0, max_runs=3)
    assert len(calls) == 3


def test_a_search_that_never_saw_a_rate_fail_says_its_answer_is_a_lower_bound():
    # 1, 2, 4, 8 req/s all hold: the answer is the budget's last rate, not the limit.
    capped = capacity_search(_report_at, start_rate=1.0, max_runs=4)
    assert capped.max_sustainable_rate_per_s == 8.0
    assert not capped.max_sustainable_rate_found and not capped.capacity_at_slo_found
    assert capped.to_dict()["max_sustainable_rate_found"] is False
    # 4, 8, 16, 32 req/s: 32 breaks the SLO (over 25) yet is sustained (up to 40).
    partial = capacity_search(_report_at, start_rate=4.0, max_runs=4)
    assert partial.capacity_at_slo_found and not partial.max_sustainable_rate_found
    full = capacity_search(_report_at, start_rate=2.0, max_runs=14, rel_tol=0.05)
    assert full.max_sustainable_rate_found and full.capacity_at_slo_found
    assert full.to_dict()["capacity_at_slo_found"] is True


def test_growing_queue_is_not_sustainable():
    # Every request succeeds but TTFT climbs through the run: the server is
    # falling behind, so the rate is not sustainable even with no rejections.
    records = []
    for i in range(30):
        events = ((i + 0.1 + i * 0.5, 1), (i + 0.2 + i * 0.5, 1))
        records.append(RequestRecord(i, "success", float(i), float(i), None, events, events[-1][0], 200))
    assert not is_sustainable(build_report(records))
    steady = [RequestRecord(i, "success", float(i), float(i), None, ((i + 0.1, 1),), i + 0.2, 200)
              for i in range(30)]
    assert is_sustainable(build_report(steady))


def test_bad_arguments():
    with pytest.raises(ValueError):
        capacity_search(_report_at, start_rate=0)
