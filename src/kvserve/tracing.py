"""Request traces (OpenTelemetry) and the request log line.

One span per request, `llm_request`, whose parent is the client's W3C
`traceparent` when it sent one, with three children in time order: `queue`
(arrival -> first scheduled), `prefill` (-> first token; each prefill chunk
an event with its start and tokens) and `decode` (-> finished), each with a
`phase` attribute. The request span carries tenant, priority, prompt and
output tokens, prefix-hit tokens, the admission outcome and reason,
preemptions, the finish (or abort) reason and the resolved versions. A
refused request gets a request span alone, with its outcome and reason.

Spans are built when the request ends, from its raw timestamps (engine
clock, converted once to wall time), so tracing adds nothing to the
request's path but one lookup per prefill chunk on the engine thread.
Off by default: without a tracer, the server's hooks are `None` checks.

Needs the `tracing` extra (opentelemetry-sdk and the OTLP exporters); the
server imports this module only when tracing is on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvserve.contract import ResolvedVersions

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_exporter(endpoint: str, protocol: str | None = None) -> SpanExporter:
    """An OTLP span exporter to `endpoint`, over `protocol` (default: the
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL environment variable, else grpc, as vLLM)."""
    protocol = protocol or os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")


@dataclass(frozen=True)
class Admission:
    """What the front door decided for a traced request."""

    outcome: str
    reason: str | None
    max_tokens: int


class RequestTracer:
    """Builds each request's spans when it ends. `admitted` / `refused` are
    called on the event loop, `on_scheduled` on the engine thread (it only
    appends to per-request lists), `finished` on the event loop after the
    request's last step."""

    def __init__(self, exporter: SpanExporter, versions: ResolvedVersions, model_name: str,
                 clock: Callable[[], float] = time.monotonic, span_processor=None) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvserve"}))
        self.provider.add_span_processor(span_processor or BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvserve")
        self.versions = versions
        self.model_name = model_name
        # Engine-clock seconds -> epoch nanoseconds, fixed once.
        self._clock_to_wall_ns = time.time_ns() - int(clock() * 1e9)
        self._admissions: dict[str, tuple[Admission, object]] = {}  # request id -> (decision, parent context)
        self._chunks: dict[str, list[tuple[float, int, int]]] = {}  # request id -> (time, start, tokens)

    @classmethod
    def to_otlp(cls, endpoint: str, versions: ResolvedVersions, model_name: str,
                clock: Callable[[], float] = time.monotonic) -> "RequestTracer":
        return cls(otlp_exporter(endpoint), versions, model_name, clock)

    def shutdown(self) -> None:
        """Export what is pending and stop."""
        self.provider.shutdown()

    def _ns(self, t: float) -> int:
        return self._clock_to_wall_ns + int(t * 1e9)

    # ---- hooks -------------------------------------------------------------

    def admitted(self, request_id: str, headers: Mapping[str, str], admission: Admission) -> None:
        self._admissions[request_id] = (admission, _parent(headers))

    def on_scheduled(self, scheduled) -> None:
        """Engine thread, after a step: record its prefill chunks (a
        SchedulerOutput's chunks that do not decode)."""
        at = scheduled.scheduled_at
        for chunk in scheduled.chunks:
            request = chunk.request
            if chunk.num_new_tokens > 1 or chunk.start < request.num_prompt_tokens:
                self._chunks.setdefault(request.request_id, []).append((at, chunk.start, chunk.num_new_tokens))

    def refused(self, headers: Mapping[str, str], admission: Admission, arrival: float, decided: float,
                attributes: Mapping[str, object]) -> None:
        """A request the front door refused: its request span alone."""
        span = self.tracer.start_span("llm_request", context=_parent(headers), kind=SpanKind.SERVER,
                                      start_time=self._ns(arrival),
                                      attributes={**self._base_attributes(), **attributes,
                                                  **_admission_attributes(admission)})
        span.set_status(Status(StatusCode.ERROR, f"refused: {admission.reason}"))
        span.end(end_time=self._ns(decided))

    def finished(self, done, end_time: float | None = None) -> None:
        """An admitted request ended (async_engine.Finished): its spans."""
        admission, parent = self._admissions.pop(done.request_id, (None, None))
        chunks = self._chunks.pop(done.request_id, [])
        ts = done.timestamps
        end = ts.finished if ts.finished is not None else (end_time if end_time is not None else ts.arrival)
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                      start_time=self._ns(ts.arrival), attributes=self._request_attributes(done))
        if admission is not None:
            span.set_attributes(_admission_attributes(admission))
        if done.error is not None or done.abort_reason is not None:
            span.set_status(Status(StatusCode.ERROR, done.error or f"aborted: {done.abort_reason}"))
        self._children(span, ts, end, chunks)
        span.end(end_time=self._ns(end))

    # ---- spans -------------------------------------------------------------

    def _children(self, parent_span, ts, end: float, chunks: list[tuple[float, int, int]]) -> None:
        context = trace.set_span_in_context(parent_span)
        scheduled = ts.scheduled
        first = ts.token_times[0] if ts.token_times else None
        phases = [("queue", ts.arrival, scheduled if scheduled is not None else end)]
        if scheduled is not None:
            phases.append(("prefill", scheduled, first if first is not None else end))
        if first is not None:
            phases.append(("decode", first, end))
        for phase, start, stop in phases:
            attributes: dict[str, object] = {"phase": phase}
            if phase == "decode":
                attributes["kvserve.decode_tokens"] = max(0, len(ts.token_times) - 1)
            span = self.tracer.start_span(phase, context=context, start_time=self._ns(start), attributes=attributes)
            if phase == "prefill":
                for at, position, num_tokens in chunks:
                    span.add_event("prefill_chunk", {"kvserve.chunk.start": position,
                                                     "kvserve.chunk.tokens": num_tokens}, timestamp=self._ns(at))
            span.end(end_time=self._ns(stop))

    def _base_attributes(self) -> dict[str, object]:
        v = self.versions
        attributes: dict[str, object] = {
            "gen_ai.system": "kvserve", "gen_ai.response.model": self.model_name,
            "kvserve.model_revision": v.model_revision, "kvserve.tokenizer_hash": v.tokenizer_hash,
            "kvserve.chat_template_hash": v.chat_template_hash}
        if v.adapter_id:
            attributes["kvserve.adapter_id"] = v.adapter_id
        return attributes

    def _request_attributes(self, done) -> dict[str, object]:
        attributes = {**self._base_attributes(),
                      "gen_ai.request.id": done.request_id, "kvserve.tenant": done.tenant,
                      "kvserve.priority": done.priority, "gen_ai.usage.prompt_tokens": done.num_prompt_tokens,
                      "gen_ai.usage.completion_tokens": done.num_output_tokens,
                      "kvserve.prefix_hit_tokens": done.num_cached_tokens,
                      "kvserve.preemptions": done.num_preemptions,
                      "gen_ai.response.finish_reasons": (done.finish_reason,)}
        if done.abort_reason is not None:
            attributes["kvserve.abort_reason"] = done.abort_reason
        return attributes


def _parent(headers: Mapping[str, str]):
    """The client's trace context (W3C traceparent / tracestate), or None."""
    traceparent = headers.get("traceparent")
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    tracestate = headers.get("tracestate")
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


def _admission_attributes(admission: Admission) -> dict[str, object]:
    return {"kvserve.admission.outcome": admission.outcome,
            "kvserve.admission.reason": admission.reason or "none",
            "gen_ai.request.max_tokens": admission.max_tokens}
