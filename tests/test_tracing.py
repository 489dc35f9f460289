"""Request traces through a live server with an in-memory span exporter: one
request span with queue, prefill (its chunks as events) and decode children
in order; a refused request's span with its outcome; the client's W3C
traceparent as the parent, also through `kvserve gateway`. And the request log line."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed (make install installs it)")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from kvserve.config import AdmissionConfig, ServerConfig  # noqa: E402
from kvserve.server.serving import Serving  # noqa: E402
from kvserve.tracing import RequestTracer, otlp_exporter  # noqa: E402
from tests.fleet_helpers import gateway, start_all  # noqa: E402
from tests.load_helpers import wait_until  # noqa: E402
from tests.server_helpers import MODEL_NAME, LiveServer, tiny_core  # noqa: E402

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def _traced_server(exporter: InMemorySpanExporter, admission: AdmissionConfig | None = None,
                   **server_fields) -> LiveServer:
    core = tiny_core(num_blocks=16, max_num_batched_tokens=16, max_model_len=512)
    tracer = RequestTracer(exporter, core.versions, MODEL_NAME, span_processor=SimpleSpanProcessor(exporter))
    serving = Serving(core, admission or AdmissionConfig(), ServerConfig(served_model_name=MODEL_NAME, **server_fields),
                      tracer=tracer)
    return LiveServer(serving)


def _requests(exporter: InMemorySpanExporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == "llm_request"]


def test_a_completion_is_one_request_span_with_queue_prefill_and_decode_in_order():
    exporter = InMemorySpanExporter()
    with _traced_server(exporter) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(range(1, 34)), "max_tokens": 5,
                                               "priority": 2})
        assert r.status_code == 200
        assert wait_until(lambda: len(_requests(exporter)) == 1)
    spans = exporter.get_finished_spans()
    (root,) = _requests(exporter)
    a = root.attributes
    assert a["gen_ai.usage.prompt_tokens"] == 33 and a["gen_ai.usage.completion_tokens"] == 5
    assert a["kvserve.tenant"] == "default" and a["kvserve.priority"] == 2
    assert a["kvserve.admission.outcome"] == "admit" and a["kvserve.admission.reason"] == "none"
    assert a["kvserve.prefix_hit_tokens"] == 0 and a["kvserve.preemptions"] == 0
    assert a["kvserve.model_revision"] == "tinyrev0123456789" and a["gen_ai.request.id"] == r.json()["id"]
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
    assert [s.attributes["phase"] for s in children] == ["queue", "prefill", "decode"]
    assert root.start_time == children[0].start_time and root.end_time == children[-1].end_time
    for earlier, later in zip(children, children[1:]):
        assert earlier.end_time == later.start_time  # queue ends when prefill starts, prefill at the first token
    # A 33-token prompt under a 16-token step budget: three chunks in order,
    # the last of one token (a prefill chunk all the same).
    chunks = [(e.attributes["kvserve.chunk.start"], e.attributes["kvserve.chunk.tokens"])
              for e in children[1].events]
    assert chunks == [(0, 16), (16, 16), (32, 1)]
    assert children[2].attributes["kvserve.decode_tokens"] == 4


def test_a_request_that_finishes_before_its_reader_sees_the_decision_keeps_its_admission(monkeypatch):
    # On a fast machine a 2-token request can finish before the response's
    # coroutine reads its admission decision off the stream; its span then
    # went out without the admission (and the decision was kept forever).
    # Here the reader is held back until the request has finished.
    exporter = InMemorySpanExporter()
    first_output = Serving._first_output

    async def late_reader(self, choice, p, headers):
        await wait_for_finish(self, choice.request_id)
        return await first_output(self, choice, p, headers)

    async def wait_for_finish(serving, request_id):
        import asyncio
        for _ in range(500):
            if request_id not in serving.engine.streams or serving.engine.streams[request_id].finished:
                return
            await asyncio.sleep(0.01)

    monkeypatch.setattr(Serving, "_first_output", late_reader)
    with _traced_server(exporter) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert wait_until(lambda: len(_requests(exporter)) == 1)
        assert srv.serving.tracer._admissions == {}  # nothing kept for a request that ended
    (span,) = _requests(exporter)
    assert span.attributes["kvserve.admission.outcome"] == "admit", dict(span.attributes)
    assert span.attributes["gen_ai.request.max_tokens"] == 2


def test_a_refused_request_has_a_span_with_its_outcome():
    exporter = InMemorySpanExporter()
    with _traced_server(exporter) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "never_fits"
        assert wait_until(lambda: len(_requests(exporter)) == 1)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["kvserve.admission.outcome"] == "reject"
    assert span.attributes["kvserve.admission.reason"] == "never_fits"
    assert span.attributes["gen_ai.usage.prompt_tokens"] == 3
    assert span.status.status_code.name == "ERROR"


def test_a_request_refused_before_tokenizing_keeps_the_clients_parent():
    exporter = InMemorySpanExporter()
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with _traced_server(exporter, AdmissionConfig(retry_budget=0.0, retry_budget_burst=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as http:
        statuses = [http.post("/v1/completions", headers={"traceparent": traceparent, "x-kvserve-retry": "1"},
                              json={"model": MODEL_NAME, "prompt": "again", "max_tokens": 2}) for _ in range(2)]
        assert [r.status_code for r in statuses] == [200, 429]  # the budget held one retry
        assert statuses[1].json()["error"]["code"] == "retry_budget"
        assert wait_until(lambda: len(_requests(exporter)) == 2)
    (span,) = [s for s in _requests(exporter) if s.attributes["kvserve.admission.outcome"] == "reject"]
    assert span.attributes["kvserve.admission.reason"] == "retry_budget"
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(span.parent.span_id, "016x") == CLIENT_SPAN_ID


def test_the_clients_traceparent_becomes_the_parent():
    exporter = InMemorySpanExporter()
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with _traced_server(exporter) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        traced = http.post("/v1/chat/completions", headers={"traceparent": traceparent},
                           json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
        untraced = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2})
        assert traced.status_code == untraced.status_code == 200
        assert wait_until(lambda: len(_requests(exporter)) == 2)
    # By request id: a response can come back before its request's span ends.
    by_id = {s.attributes["gen_ai.request.id"]: s for s in _requests(exporter)}
    with_parent, without = by_id[traced.json()["id"]], by_id[untraced.json()["id"]]
    assert format(with_parent.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(with_parent.parent.span_id, "016x") == CLIENT_SPAN_ID and with_parent.parent.is_remote
    assert without.parent is None and format(without.context.trace_id, "032x") != CLIENT_TRACE_ID
    # Every child lives in its request's trace.
    for span in exporter.get_finished_spans():
        if span.name != "llm_request":
            assert span.context.trace_id in (with_parent.context.trace_id, without.context.trace_id)


def test_the_clients_traceparent_reaches_the_backend_through_the_gateway(tmp_path):
    exporter = InMemorySpanExporter()
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with _traced_server(exporter) as backend:
        (gw,) = start_all(gateway([backend.base_url], "--state-dir", str(tmp_path / "state")))
        try:
            r = httpx.post(gw.url + "/v1/completions", headers={"traceparent": traceparent}, timeout=60,
                           json={"model": MODEL_NAME, "prompt": "through", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert wait_until(lambda: len(_requests(exporter)) == 1)
        finally:
            gw.stop()
    (span,) = _requests(exporter)
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(span.parent.span_id, "016x") == CLIENT_SPAN_ID


def test_the_request_log_line_has_no_text_unless_asked(caplog):
    prompt = "tell me"
    for log_prompts in (False, True):
        exporter = InMemorySpanExporter()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvserve.requests"), \
                _traced_server(exporter, request_log=True, log_prompts=log_prompts) as srv:
            r = httpx.post(srv.base_url + "/v1/completions",
                           json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3}, timeout=30)
            assert r.status_code == 200
            assert wait_until(lambda: any(rec.name == "kvserve.requests" for rec in caplog.records))
        (record,) = [rec for rec in caplog.records if rec.name == "kvserve.requests"]
        line = json.loads(record.getMessage())
        assert line["request_id"] == r.json()["id"] and line["prompt_tokens"] == len(prompt)
        assert line["output_tokens"] == 3 and line["finish_reason"] == "length" and line["ttft_s"] > 0
        assert ("prompt" in line) == log_prompts and (prompt in record.getMessage()) == log_prompts
        if log_prompts:
            assert line["prompt"] == prompt and line["output"] == r.json()["choices"][0]["text"]


def test_the_otlp_exporter_follows_the_protocol_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert type(otlp_exporter("http://127.0.0.1:4318/v1/traces")).__module__.endswith("http.trace_exporter")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert type(otlp_exporter("http://127.0.0.1:4317")).__module__.endswith("grpc.trace_exporter")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError):
        otlp_exporter("http://127.0.0.1:4317")
