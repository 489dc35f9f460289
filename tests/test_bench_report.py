"""report.json schema, summaries from hand-made records, histograms, HTML."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.report import (SLO, SLO_PRESETS, MetricsSample, RequestRecord, build_report,
                                  format_table, histogram_quantile, parse_slo,
                                  queue_time_from_server, report_json, write_report)

STAT_KEYS = {"mean", "p50", "p90", "p95", "p99"}


def _ok(index, ttft, gap, tokens, tenant="a", priority=0, sent=0.0):
    """A success sent at `sent`: first token after `ttft`, then one per `gap`."""
    events = tuple((sent + ttft + i * gap, 1) for i in range(tokens))
    return RequestRecord(index, "success", sent, sent, sent + 0.001, events, events[-1][0],
                         200, None, tenant, priority, 10, tokens, tokens)


def _records():
    return [
        _ok(0, 0.1, 0.05, 11, tenant="a"),
        _ok(1, 0.3, 0.02, 6, tenant="b", priority=1, sent=1.0),
        _ok(2, 3.0, 0.01, 2, tenant="b", priority=1, sent=2.0),  # misses TTFT
        RequestRecord(3, "rejected", 0.5, 0.5, 0.51, (), 0.51, 429, "kv_cache", "a"),
        RequestRecord(4, "rejected", 0.6, 0.6, 0.61, (), 0.61, 429, "kv_cache", "b"),
        RequestRecord(5, "rejected", 0.7, 0.7, 0.71, (), 0.71, 503, None, "b"),
        RequestRecord(6, "cancelled", 0.8, 0.8, 0.9, ((0.95, 1),), 1.0, 200, None, "a"),
        RequestRecord(7, "timed_out", 0.9, 0.9, None, (), 4.0, None, None, "a"),
        RequestRecord(8, "error", 1.0, 1.0, 1.01, (), 1.01, 500, None, "a", error="HTTP 500"),
    ]


@pytest.fixture
def report():
    return build_report(_records(), SLO(2.0, 0.1), duration_s=10.0, price_per_hour=36.0)


def test_schema_names(report):
    assert {"summary", "requests", "server_metrics", "by_tenant", "by_priority", "config",
            "slo", "client"} <= set(report)
    s = report["summary"]
    for name in ("ttft", "tpot", "itl", "e2e", "queue_time"):
        assert STAT_KEYS <= set(s[name]), name
    assert {"success", "cancelled", "rejected", "timed_out", "error",
            "rejected_reasons"} <= set(s["outcomes"])
    for name in ("request_throughput", "output_token_throughput", "goodput", "slo_attainment",
                 "cost_per_successful_request", "cost_per_million_output_tokens", "cost_total"):
        assert name in s, name
    raw = report["requests"][0]
    assert {"sent_s", "headers_s", "token_events", "end_s", "outcome", "status_code",
            "reject_reason", "tenant", "priority", "prompt_tokens", "output_tokens",
            "retries", "scheduled_s"} <= set(raw)
    json.dumps(report, allow_nan=False)


def test_summary_values(report):
    s = report["summary"]
    assert s["outcomes"] == {"success": 3, "cancelled": 1, "rejected": 3, "timed_out": 1,
                             "error": 1, "rejected_reasons": {"kv_cache": 2, "http_503": 1}}
    assert s["ttft"]["p50"] == pytest.approx(0.3)
    assert s["ttft"]["mean"] == pytest.approx((0.1 + 0.3 + 3.0) / 3)
    assert s["tpot"]["p50"] == pytest.approx(0.02)
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_token_throughput"] == pytest.approx(1.9)
    assert s["num_good"] == 2
    assert s["goodput"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(2 / 8)
    assert s["slo_passed"] is False
    # 36 per hour for 10 s = 0.1; 3 successes; 19 output tokens.
    assert s["cost_total"] == pytest.approx(0.1)
    assert s["cost_per_successful_request"] == pytest.approx(0.1 / 3)
    assert s["cost_per_million_output_tokens"] == pytest.approx(0.1 / 19 * 1e6)
    assert s["queue_time"]["mean"] is None and s["queue_time"]["source"] is None


def test_per_class_breakdowns(report):
    assert set(report["by_tenant"]) == {"a", "b"}
    assert report["by_tenant"]["b"]["outcomes"]["rejected_reasons"] == {"kv_cache": 1, "http_503": 1}
    assert report["by_priority"]["1"]["outcomes"]["success"] == 2
    assert report["by_priority"]["1"]["ttft"]["p50"] == pytest.approx(1.65)


def test_slo_passes_when_percentiles_and_success_share_hold():
    records = [_ok(i, 0.2, 0.05, 5, sent=i * 0.1) for i in range(20)]
    assert build_report(records, SLO_PRESETS["mlperf-server"])["summary"]["slo_passed"] is True
    assert build_report(records, SLO_PRESETS["mlperf-interactive"])["summary"]["slo_passed"] is False
    one_rejected = records + [RequestRecord(20, "rejected", 0, 0, None, (), 0.1, 429, "x")]
    assert build_report(one_rejected, SLO(2.0, 0.1, 99.0))["summary"]["slo_passed"] is False
    assert build_report(one_rejected, SLO(2.0, 0.1, 90.0))["summary"]["slo_passed"] is True


def test_parse_slo():
    assert parse_slo("mlperf-server") == SLO(2.0, 0.1, 99.0, name="mlperf-server")
    assert parse_slo("mlperf-interactive").ttft_s == 0.5
    custom = parse_slo("ttft=1.5,tpot=0.05,p=95")
    assert (custom.ttft_s, custom.tpot_s, custom.percentile) == (1.5, 0.05, 95.0)
    for bad in ("ttft=1", "fast", "ttft=1,tpot=0.1,foo=2", "ttft=-1,tpot=0.1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_bad_outcome_rejected():
    with pytest.raises(ValueError, match="outcome"):
        RequestRecord(0, "ok", 0, 0)


def test_histogram_quantile_interpolates_inside_buckets():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.3)  # rank 20: halfway in (0.1, 0.5]
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.1)
    assert histogram_quantile([(1.0, 5.0), (float("inf"), 10.0)], 0.99) == 1.0
    assert histogram_quantile([(1.0, 0.0)], 0.5) is None


def test_queue_time_is_the_runs_delta_of_the_server_histogram():
    before = MetricsSample(0.0, queue_buckets=((0.1, 100.0), (1.0, 100.0), (float("inf"), 100.0)),
                           queue_sum_s=5.0, queue_count=100.0)
    after = MetricsSample(5.0, queue_buckets=((0.1, 100.0), (1.0, 110.0), (float("inf"), 110.0)),
                          queue_sum_s=11.0, queue_count=110.0)
    stats = queue_time_from_server([before, after])
    assert stats["count"] == 10
    assert stats["mean"] == pytest.approx(0.6)  # (11 - 5) / 10: old requests excluded
    assert 0.1 <= stats["p50"] <= 1.0
    rep = build_report([_ok(0, 0.1, 0.1, 2)], metrics_samples=[before, after])
    assert rep["summary"]["queue_time"]["source"] == "server_histogram"
    assert rep["summary"]["queue_time"]["mean"] == pytest.approx(0.6)


def test_zero_queue_times_read_zero_not_half_a_bucket():
    empty = MetricsSample(0.0, queue_buckets=((0.01, 0.0), (float("inf"), 0.0)),
                          queue_sum_s=0.0, queue_count=0.0)
    zeros = MetricsSample(1.0, queue_buckets=((0.01, 50.0), (float("inf"), 50.0)),
                          queue_sum_s=0.0, queue_count=50.0)
    stats = queue_time_from_server([empty, zeros])
    assert stats["mean"] == 0.0 and stats["p50"] == 0.0 and stats["p99"] == 0.0


def test_files_written(report, tmp_path):
    paths = write_report(report, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["outcomes"]["success"] == 3
    html = paths["html"].read_text()
    assert html.count("<svg") >= 4 and "TTFT CDF" in html and "</html>" in html
    assert "ttft" in format_table(report)


def test_report_json_reads_back_as_the_report_with_one_line_per_request(report):
    text = report_json(report)
    assert json.loads(text) == report
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith('  {"index":')]
    assert len(rows) == len(report["requests"]) == 9
    assert ' "summary": {' in lines and '  "ttft": {' in lines  # the head stays indented
    assert json.loads(report_json({**report, "requests": []}))["requests"] == []
    with pytest.raises(ValueError):  # NaN is not JSON: refused, not written
        report_json({**report, "requests": [{"ttft_s": float("nan")}]})


def test_a_class_holding_every_request_gets_the_runs_summary_without_cost():
    # One tenant and one priority (the usual run): each class's summary is
    # the run's, computed once, with the cost fields left out as for any class.
    records = [r for r in _records() if r.tenant == "a"]
    one_class = build_report(records, SLO(2.0, 0.1), duration_s=10.0, price_per_hour=36.0)
    unpriced = build_report(records, SLO(2.0, 0.1), duration_s=10.0)
    assert set(one_class["by_tenant"]) == {"a"} and set(one_class["by_priority"]) == {"0"}
    assert one_class["summary"]["cost_total"] == pytest.approx(0.1)
    for block in (one_class["by_tenant"]["a"], one_class["by_priority"]["0"]):
        assert block["cost_total"] is None
        assert json.dumps(block, sort_keys=True) == json.dumps(
            {**unpriced["summary"], "queue_time": {k: v for k, v in unpriced["summary"]["queue_time"].items()
                                                  if k != "source"}}, sort_keys=True)
    # The classes' blocks are copies: the run's queue-time source is the run's alone.
    assert "source" in one_class["summary"]["queue_time"] and "source" not in one_class["by_tenant"]["a"]["queue_time"]


def test_report_html_states_the_run_targets_outcomes_lengths_and_classes(tmp_path):
    from kvserve.bench.plots import render_html
    from kvserve.bench.report import SLO, RequestRecord, build_report

    records = [RequestRecord(i, "success" if i % 4 else "rejected", float(i), float(i),
                             token_events=((i + 0.2, 1), (i + 0.3, 1)) if i % 4 else (), end_s=i + 0.3,
                             reject_reason=None if i % 4 else "kv_cache", tenant="alice" if i % 2 else "bob",
                             priority=i % 3, prompt_tokens=10 + i, output_tokens=2 if i % 4 else 0,
                             expected_output_tokens=5 + i)
               for i in range(12)]
    report = build_report(records, SLO(ttft_s=0.5, tpot_s=0.05, name="mine"),
                          config={"workload": "chat", "arrival": {"kind": "poisson"}, "rate": 2.0,
                                  "base_url": "http://x", "server_versions": {"x-kvserve-model-revision": "rev9"}})
    page = render_html(report, "table")
    assert "<th>workload</th><td>chat</td>" in page and "rev9" in page and "TTFT &lt;= 0.5 s" in page
    assert page.count('class="target"') >= 4  # TTFT and TPOT targets on their CDFs and on the scatter
    assert "outcomes by reason over time" in page and "rejected: kv_cache" in page
    assert "prompt and output lengths sent" in page
    assert 'class="by-tenant"' in page and "<td>alice</td>" in page and 'class="by-priority"' in page
