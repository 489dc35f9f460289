"""Retry-After is honoured and the client-side retry budget caps retries."""

from __future__ import annotations

import asyncio

from tests.fake_openai_server import FakeOpenAIServer, Script
from kvserve.bench.client import ClientConfig, run_load
from kvserve.bench.workload import RequestSpec

OK = Script(chunks=((0.01, 1), (0.01, 1)))


def _run(script, num_requests: int, **config):
    async def main():
        server = FakeOpenAIServer(script)
        url = await server.start()
        specs = [RequestSpec(i, 8, 2) for i in range(num_requests)]
        result = await run_load(ClientConfig(url, model="fake", scrape_metrics=False, **config),
                                specs, lambda spec: "hi", offsets_s=[0.0] * num_requests)
        await server.stop()
        return server, result

    return asyncio.run(main())


def test_retry_waits_at_least_retry_after_then_succeeds():
    def script(index, attempt):
        return Script(status=429, retry_after="1", error_code="kv_cache") if attempt == 0 else OK

    server, result = _run(script, 1, max_retries=3)
    record = result.records[0]
    assert record.outcome == "success" and record.retries == 1 and record.status_code == 200
    first, second = server.received
    assert second["t"] - first["t"] >= 1.0
    assert second["headers"]["x-stainless-retry-count"] == "1"
    assert "x-stainless-retry-count" not in first["headers"]
    # The user's clock started at the first attempt: TTFT includes the wait.
    assert record.token_events[0][0] - record.sent_s >= 1.0
    assert record.last_sent_s - record.sent_s >= 1.0


def test_retry_budget_caps_total_retries():
    always_refuse = Script(status=429, retry_after="0", error_code="queue_full")
    server, result = _run(always_refuse, 6, max_retries=5, retry_budget_ratio=0.0,
                          retry_budget_min=2, backoff_base_s=0.01)
    assert sum(r.retries for r in result.records) == 2
    assert len(server.received) == 6 + 2
    assert all(r.outcome == "rejected" and r.reject_reason == "queue_full" for r in result.records)


def test_max_retries_per_request_caps_each_request():
    always_refuse = Script(status=503, retry_after="0", error_code="queue_timeout")
    server, result = _run(always_refuse, 2, max_retries=2, retry_budget_min=100,
                          backoff_base_s=0.01)
    assert [r.retries for r in result.records] == [2, 2]
    assert len(server.received) == 6


def test_no_retries_by_default():
    refuse_once = lambda index, attempt: Script(status=429, retry_after="1") if attempt == 0 else OK  # noqa: E731
    server, result = _run(refuse_once, 1)
    assert len(server.received) == 1
    assert result.records[0].outcome == "rejected"
    assert result.records[0].reject_reason == "overloaded"  # error.type when code is null
