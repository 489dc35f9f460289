"""The load tester's measurements against a server whose timings are scripted.

Tolerance: a scripted delay is a server-side sleep, so measured latencies can
only come out later than scripted, by the loop wake-up and loopback time on
both sides. We allow 2 ms early (clock reads) and 40 ms late (TIME_TOL_S). The
scripted gaps are 100-700 ms, so a wrong definition (e.g. TPOT including the
first token, ITL not split across a multi-token chunk) is off by far more
than that.

The test machine is a shared 2-core box where a process can lose the CPU for
tens of ms, which would make a measurement late without any error in it. The
fake server and the client share one event loop, so a watcher on that loop
sees every such stall (a late wake-up of its own 5 ms sleeps); a run that
stalled for more than CALM_LAG_S is discarded and run again, so the
assertions judge the client and never the machine's moment. When every run
stalls (a CI box at load 9 did, four times in a row) the timing tests are
skipped with the lags as the reason, not failed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.fake_openai_server import FakeOpenAIServer, Script
from kvserve.bench.client import ClientConfig, run_load
from kvserve.bench.report import SLO, build_report
from kvserve.bench.workload import RequestSpec

TIME_TOL_S = 0.040
EARLY_S = 0.002
# A run whose loop stalled for longer than this is run again, up to MAX_RUNS.
CALM_LAG_S = 0.020
MAX_RUNS = 8

SCRIPTS = {
    # TTFT 0.3 (0.1 queued + 0.2), then one token every 0.1 s: TPOT 0.1, E2E 0.6.
    0: Script(headers_delay_s=0.1, chunks=((0.2, 1), (0.1, 1), (0.1, 1), (0.1, 1))),
    # Multi-token chunks with logprobs: 7 tokens, TTFT 0.15, TPOT 0.3 / 6 = 0.05,
    # ITL: 0 (second token of the first chunk), 4 x 0.05, then 0.1.
    1: Script(chunks=((0.15, 2), (0.2, 4), (0.1, 1))),
    2: Script(status=429, retry_after="1", error_code="kv_cache"),
    3: Script(status=429, retry_after="2", error_code="queue_full"),
    4: Script(status=500),
    # Slower than the client's 1 s timeout.
    5: Script(chunks=((3.0, 1),)),
    # Cancelled by the client 0.3 s after sending (spec.cancel_after_s).
    6: Script(chunks=((0.1, 1), (0.6, 1), (0.6, 1))),
    # Two 2-token chunks without logprobs: only usage (4) tells the count.
    # TTFT 0.1, TPOT 0.1 / 3.
    7: Script(chunks=((0.1, 2), (0.1, 2)), logprobs=False),
    # Succeeds but misses the SLO's TTFT (0.7 > 0.5).
    8: Script(chunks=((0.7, 1), (0.1, 1))),
}
SLO_UNDER_TEST = SLO(ttft_s=0.5, tpot_s=0.2, percentile=90)


def _close(measured: float, scripted: float) -> bool:
    return scripted - EARLY_S <= measured <= scripted + TIME_TOL_S


async def _max_loop_lag_s(stop: asyncio.Event, period_s: float = 0.005) -> float:
    """How late this loop woke up for a `period_s` sleep, at most, until `stop`."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - start - period_s)
    return worst


async def _scripted_run():
    """One run of all scripted requests (each sent 50 ms apart) and the
    longest stall of the loop they shared."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(_max_loop_lag_s(stop))
    server = FakeOpenAIServer(lambda index, attempt: SCRIPTS[index])
    url = await server.start()
    specs = [RequestSpec(i, 8, 4, tenant="t" + str(i % 2), priority=i % 3,
                         cancel_after_s=0.3 if i == 6 else None) for i in SCRIPTS]
    config = ClientConfig(url, model="fake", timeout_s=1.0, metrics_interval_s=0.25)
    result = await run_load(config, specs, lambda spec: "hello world",
                            offsets_s=[0.05 * i for i in range(len(specs))])
    await asyncio.sleep(0.1)  # let the server notice the disconnect
    await server.stop()
    stop.set()
    return server, result, await watcher


@pytest.fixture(scope="module")
def any_run():
    """The first calm run, else the last one: (server, result, report, calm,
    lags). Tests of what the client sent and counted use any run."""
    lags = []
    for _ in range(MAX_RUNS):
        server, result, lag_s = asyncio.run(_scripted_run())
        lags.append(lag_s)
        if lag_s <= CALM_LAG_S:
            break
    report = build_report(result.records, SLO_UNDER_TEST, metrics_samples=result.metrics_samples,
                          client_stats=result.client_stats)
    return server, result, report, lags[-1] <= CALM_LAG_S, lags


@pytest.fixture(scope="module")
def run(any_run):
    """A calm run: tests of the client's timings judge only one of those."""
    server, result, report, calm, lags = any_run
    if not calm:
        # Not a verdict on the client: there is no calm run to judge it by
        # (-ra prints this, so a CI log shows the timings were not judged).
        pytest.skip(f"the machine stalled the event loop in every run (worst lags {lags} s > "
                    f"{CALM_LAG_S} s): no calm run to judge the client's timings by")
    return server, result, report


def _request(report, index):
    return next(r for r in report["requests"] if r["index"] == index)


def test_ttft_tpot_e2e_of_single_token_chunks(run):
    _, _, report = run
    r = _request(report, 0)
    assert r["outcome"] == "success" and r["output_tokens"] == 4
    assert _close(r["ttft_s"], 0.3), r["ttft_s"]
    assert abs(r["tpot_s"] - 0.1) <= TIME_TOL_S / 3, r["tpot_s"]
    assert _close(r["e2e_s"], 0.6), r["e2e_s"]
    # Headers came after the scripted 0.1 s queue wait, before the first token.
    assert _close(r["headers_s"] - r["sent_s"], 0.1)


def test_multi_token_chunks_counted_from_logprobs(run):
    _, result, report = run
    r = _request(report, 1)
    assert [n for _, n in r["token_events"]] == [2, 4, 1]
    assert r["output_tokens"] == 7
    assert _close(r["ttft_s"], 0.15)
    assert abs(r["tpot_s"] - 0.05) <= TIME_TOL_S / 6
    # ITL is pooled over successful requests; request 1's own gaps must show
    # the zero gap and the 4-way split of the 0.2 s chunk gap.
    from kvserve.latency import derive_latency
    rec = next(x for x in result.records if x.index == 1)
    itl = derive_latency(rec.sent_s, rec.token_events, rec.end_s).itl_s
    assert len(itl) == 6 and itl[0] == 0.0
    assert all(abs(g - 0.05) <= TIME_TOL_S / 4 for g in itl[1:5])
    assert abs(itl[5] - 0.1) <= TIME_TOL_S


def test_usage_rescales_chunks_without_logprobs(run):
    _, _, report = run
    r = _request(report, 7)
    assert [n for _, n in r["token_events"]] == [2, 2]
    assert r["output_tokens"] == 4
    assert _close(r["ttft_s"], 0.1)
    assert abs(r["tpot_s"] - 0.1 / 3) <= TIME_TOL_S / 3


def test_outcomes_and_reasons_match_the_script(run):
    _, _, report = run
    outcomes = report["summary"]["outcomes"]
    assert {k: outcomes[k] for k in ("success", "cancelled", "rejected", "timed_out", "error")} \
        == {"success": 4, "cancelled": 1, "rejected": 2, "timed_out": 1, "error": 1}
    assert outcomes["rejected_reasons"] == {"kv_cache": 1, "queue_full": 1}
    assert _request(report, 4)["status_code"] == 500
    timed_out = _request(report, 5)
    assert timed_out["outcome"] == "timed_out"
    assert _close(timed_out["end_s"] - timed_out["sent_s"], 1.0)
    cancelled = _request(report, 6)
    assert cancelled["outcome"] == "cancelled"
    assert _close(cancelled["end_s"] - cancelled["sent_s"], 0.3)
    assert len(cancelled["token_events"]) == 1  # the 0.1 s token arrived, the 0.7 s one not


def test_goodput_and_attainment_count_scripted_good_requests(run):
    _, _, report = run
    s = report["summary"]
    # Good: requests 0, 1 and 7; request 8 succeeds with TTFT 0.7 > 0.5.
    assert s["num_good"] == 3
    assert s["slo_attainment"] == pytest.approx(3 / 8)  # 9 requests, 1 cancelled by the client
    assert s["goodput"] == pytest.approx(3 / s["duration_s"])
    assert s["slo_passed"] is False  # only 4 of 8 succeeded, under the 90% judged share


def test_server_metrics_scraped_beside_client_figures(any_run):
    server, _, report = any_run[:3]
    metrics = report["server_metrics"]
    assert metrics["num_samples"] >= 3
    assert {"kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
            "num_preemptions"} <= set(metrics["series"])
    assert max(v for _, v in metrics["series"]["num_requests_running"]) >= 1
    # Queue time: the server observed 0.1 s (request 0) and 0 s for the five
    # other streams it started, so the histogram mean is exact.
    queue = report["summary"]["queue_time"]
    assert queue["source"] == "server_histogram"
    assert queue["mean"] == pytest.approx(0.1 / 6)
    assert metrics["counters_delta"]['vllm:request_success_total{finished_reason="length"}'] == 4


def test_cancelled_stream_is_closed_at_the_server(any_run):
    server, _, _ = any_run[:3]
    assert 6 in server.disconnected


def test_request_body_and_headers(any_run):
    server, _, _ = any_run[:3]
    body = next(r["body"] for r in server.received if r["index"] == 0)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["min_tokens"] == 4 and body["ignore_eos"] is True
    assert "priority" not in body  # only sent when a priority mix is configured


def test_schedule_lag_recorded(run):
    _, result, _ = run
    lag = result.client_stats["schedule_lag_s"]
    assert lag["count"] == len(SCRIPTS)
    assert lag["p50"] < 0.05


def test_kvserve_own_counters_reach_the_report():
    # The names come from the server's own metrics (metrics.py), not from
    # this test: every counter kvserve exports beside vLLM's must reach
    # server_metrics.counters_delta, as a difference between two scrapes.
    from kvserve.bench.client import parse_metrics
    from kvserve.bench.report import server_metrics_block
    from kvserve.contract import RequestTimestamps
    from kvserve.metrics import ServerMetrics
    from kvserve.scheduler.scheduler import SchedulerStats

    metrics = ServerMetrics("m", ttft_slo_s=1.0, tpot_slo_s=0.1)
    before = parse_metrics(metrics.render().decode(), 0.0)
    metrics.record_admission("admit", None)
    metrics.record_admission("reject", "kv_cache")
    metrics.record_cancellation("disconnect")
    metrics.record_finished(RequestTimestamps(arrival=0.0, scheduled=0.1, token_times=[0.2, 0.25],
                                              finished=0.25), 8, 2, "length")
    metrics.record_stats(SchedulerStats(num_running=1, num_waiting=0, num_preemptions=1, kv_usage=0.5,
                                        prefix_cache_queries=8, prefix_cache_hits=0, num_evicted_blocks=2,
                                        num_allocation_failures=1, num_recomputed_tokens=5))
    after = parse_metrics(metrics.render().decode(), 1.0)
    deltas = server_metrics_block([before, after])["counters_delta"]
    exported = {family.name for family in metrics.registry.collect()
                if family.type == "counter" and family.name.startswith("kvserve")}
    assert exported >= {"kvserve_admission_decisions", "kvserve_cancellations", "kvserve_slo_requests"}
    for family in exported:
        assert any(key.startswith(family + "_total{") for key in deltas), (family, sorted(deltas))
    assert deltas['kvserve_admission_decisions_total{model_name="m",outcome="reject",reason="kv_cache"}'] == 1
    assert deltas['kvserve_cancellations_total{model_name="m",reason="disconnect"}'] == 1
    assert deltas['kvserve_slo_requests_total{model_name="m",priority="0",result="met",slo="both",tenant="default"}'] == 1
    # Histograms and gauges are not counters: they stay out of the deltas.
    assert not any(key.startswith(("kvserve_engine_step", "kvserve_running_cap")) for key in deltas)
