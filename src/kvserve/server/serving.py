"""The bridge from HTTP to the engine, as one pass: prepare (validate,
refuse early what admission would refuse at any size, tokenize;
server/prepare.py) -> compile its structured-output constraint (a 400
before admission; never an engine stall) -> build one request per choice
through the engine's RequestFactory -> hand them to the async engine (whose
thread makes each admission decision) -> render their streams as a JSON
body or SSE events (server/streaming.py). Errors are `APIError`s
(server/errors.py).

Headers are sent only after the request is admitted and has produced its
first token, so a refused, timed-out or failed request always gets an honest
status code, streaming or not. Every response carries the versions that ran.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionDecision, Outcome, whole_seconds
from kvserve.admission.loop import AdmissionLoop
from kvserve.admission.step_limits import StepLimits
from kvserve.admission.tenants import Tenant, TenantDirectory
from kvserve.admission.warm_up import WARM_UP_MIN_STEPS
from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.contract import InvalidParameter, ResolvedVersions
from kvserve.engine.async_engine import AsyncEngine, Finished, StepReport
from kvserve.engine.core import EngineCore
from kvserve.metrics import ServerMetrics
from kvserve.model.lora import LoraError
from kvserve.request_log import RequestLog
from kvserve.server import protocol, streaming
from kvserve.server.errors import APIError, bad_request, ended_without_output, rejection
from kvserve.server.prepare import Kind, ModelLimits, PreparedRequest, RequestClass, RequestPreparer
from kvserve.server.prompts import chat_prompt_ids, completion_prompt_ids, detokenize_body, tokenize_body
from kvserve.server.streaming import Choice
from kvserve.server.tools import ToolSet
from kvserve.server.transport import reader_stalled
from kvserve.startup import StartupPhases

if TYPE_CHECKING:
    from kvserve.tracing import RequestTracer

log = logging.getLogger(__name__)
# The headers of the request being prepared, for the span of a request
# refused before it is tokenized (set only with tracing on).
_TRACED_HEADERS: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("traced_headers", default={})

CLIENT_ABORTS = {"disconnect", "stalled"}

class Serving:
    """Owns the async engine, the admission loop it drives, metrics and tenants."""

    def __init__(self, core: EngineCore, admission_config: AdmissionConfig, server_config: ServerConfig,
                 tenants: TenantDirectory | None = None, clock: Callable[[], float] = time.monotonic,
                 versions: ResolvedVersions | None = None, tracer: "RequestTracer | None" = None) -> None:
        """tracer: where request spans go (default: OTLP to the config's
        endpoint, or none: no cost)."""
        self.core = core
        self.config = server_config
        self.admission_config = admission_config
        self.tenants = tenants or TenantDirectory()
        self.clock = clock
        self.tokenizer = core.tokenizer
        self.versions = versions or core.versions
        if self.versions is None:
            raise ValueError("Serving needs the resolved versions (pass versions=, e.g. LoadedModel.versions)")
        self.vocab_size = core.model_config.vocab_size
        self.model_name = server_config.served_model_name
        self.max_model_len = core.max_model_len
        self.max_num_batched_tokens = core.config.max_num_batched_tokens
        self.admission = AdmissionLoop(AdmissionController(
            admission_config, core.num_kv_blocks, core.config.block_size, core.config.max_num_seqs, clock,
            self.tenants.limits(), max_num_batched_tokens=core.config.max_num_batched_tokens))
        self.metrics = ServerMetrics(self.model_name, admission_config.ttft_slo_s, admission_config.tpot_slo_s,
                                     self.max_model_len,
                                     max_loras=core.config.max_loras if core.config.enable_lora else None)
        self.metrics.record_weights(core.weight_formats())
        self.metrics.record_memory(core.memory_bytes)
        self.metrics.record_cache_config(core.config.block_size, core.num_kv_blocks, core.config.enable_prefix_caching,
                                         core.kv_cache_dtype, core.memory_bytes()["kv_cache"])
        self.tracer = tracer if tracer is not None else _otlp_tracer(server_config, self.versions, clock)
        self.request_log = RequestLog(self.model_name, self.tokenizer.decode, server_config.log_prompts) \
            if server_config.request_log else None
        # Tracing: each choice's client headers and max_tokens from its add
        # until its admission decision is delivered (event loop only).
        self._traced: dict[str, tuple[Mapping[str, str], int]] = {}
        self.engine = AsyncEngine(core, self.admission, on_step=self._on_step,
                                  on_scheduled=None if self.tracer is None else self.tracer.on_scheduled,
                                  on_decision=None if self.tracer is None else self._trace_admission)
        self.preparer = RequestPreparer(
            self.tokenizer, ModelLimits(self.model_name, self.vocab_size, self.max_model_len), admission_config,
            self._fits_cache, self._refuse_early, clock, self.versions, server_config.max_n, self._adapter_id_of)
        self.started = False
        self.draining = False
        self._drain_deadline = 0.0  # monotonic time the drain aborts what is left
        # Filled by whoever builds the engine (server.cli.build_serving), then the warm-up.
        self.startup = StartupPhases()
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 weights dropped too
        # Reads the weights again for a wake from level 2 (server.cli sets it; None: level 2 refused).
        self.reload_weights: Callable[[], dict] | None = None
        self.metrics.record_ready(lambda: self.ready)

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self.config.warm_up:
            with self.startup.phase("warm_up"):
                await self._warm_up()
                await _load_streaming_backend()
        self.engine.start()
        self.started = True
        self.metrics.record_startup(self.startup.seconds)
        log.info("start to ready: %s", self.startup.summary())

    async def _warm_up(self) -> None:
        """Fit the step-time model before traffic: a cold controller has no
        running cap and no service time, so the first burst would be
        admitted on guesses and then wait (seconds of TTFT). Failure only
        costs the cold start, never the server."""
        start = time.perf_counter()
        try:
            steps = await asyncio.to_thread(self.engine.warm_up, WARM_UP_MIN_STEPS)
        except Exception:
            log.exception("warm-up failed; starting cold")
            return
        limits = self.admission.next_step_limits(0)  # the engine thread has not started: no lock
        self._record_limits(limits)
        log.info("warm-up: %d steps in %.2f s; running cap %d", len(steps), time.perf_counter() - start,
                 limits.max_running)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let in-flight requests finish for up to grace_s,
        then abort the rest (503 / finish_reason "abort")."""
        self.draining = True
        self._drain_deadline = time.monotonic() + grace_s
        await self._finish_in_flight(grace_s, "shutdown")

    async def _finish_in_flight(self, grace_s: float, reason: str) -> None:
        deadline = time.monotonic() + grace_s
        while self.engine.num_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.engine.streams):
            self.engine.abort(rid, reason)
        flush_deadline = time.monotonic() + 2.0
        while self.engine.num_streams and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.engine.stop()
        if self.tracer is not None:
            self.tracer.shutdown()

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.engine.dead is None and not self.sleep_level

    # ---- sleep and wake (vLLM's endpoints) --------------------------------

    async def sleep(self, level: int, if_idle: bool = False) -> dict:
        """Stop admitting (503 "sleeping"), let in-flight requests finish for
        up to the shutdown grace and abort the rest, then free the KV cache
        (level 1) and the weights too (level 2) on the engine thread.
        `if_idle`: only when no request is in flight (409 "busy" otherwise:
        an autoscaler's idea of idle can be a moment old)."""
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
        if if_idle and self.engine.num_streams and not self.sleep_level:
            raise APIError(409, f"{self.engine.num_streams} requests are in flight", "conflict", "busy")
        if level == 2 and self.reload_weights is None:
            raise APIError(400, "level 2 drops the weights, and this server cannot read them again",
                           param="level")
        if self.sleep_level:
            return {"is_sleeping": True, "level": self.sleep_level, "freed_bytes": 0}
        self.sleep_level = level  # from here requests get 503 and /ready says so
        self.metrics.sleeping.set(level)
        await self._finish_in_flight(self.config.shutdown_grace_s, "sleep")
        freed = await self.engine.call(lambda: self.core.sleep(level))
        log.info("asleep at level %d: %.1f MiB freed", level, freed / 2**20)
        return {"is_sleeping": True, "level": level, "freed_bytes": freed}

    async def wake_up(self) -> dict:
        """Back to serving: weights read again after level 2, the KV cache
        allocated (empty); the time it took is the `wake_up` startup phase."""
        if not self.sleep_level:
            return {"is_sleeping": False, "wake_up_s": 0.0}
        start = time.perf_counter()
        weights = None
        if self.sleep_level == 2 and self.reload_weights is not None:
            weights = await asyncio.to_thread(self.reload_weights)
        await self.engine.call(lambda: self.core.wake_up(weights))
        wake_up_s = time.perf_counter() - start
        self.sleep_level = 0
        self.metrics.sleeping.set(0)
        self.startup.seconds["wake_up"] = wake_up_s  # the latest wake, beside the cold start's phases
        self.metrics.record_startup({"wake_up": wake_up_s})
        log.info("awake in %.3f s", wake_up_s)
        return {"is_sleeping": False, "wake_up_s": wake_up_s}

    # ---- engine events (event loop thread): metrics ---------------------------

    def _on_step(self, report: StepReport) -> None:
        for done in report.finished:
            self._on_finished(done)
        self.metrics.record_step_report(report)
        if report.stats is not None and self.metrics.max_loras is not None:
            name_of = self.core.adapters.name_of
            self.metrics.record_adapters([name_of(i) for i in report.stats.running_adapters],
                                         [name_of(i) for i in report.stats.waiting_adapters])
        if report.limits is not None:
            self._record_limits(report.limits)

    def _record_limits(self, limits: StepLimits) -> None:
        self.metrics.running_cap.set(limits.max_running)
        tokens = limits.max_batched_tokens
        self.metrics.step_token_budget.set(self.max_num_batched_tokens if tokens is None
                                           else min(tokens, self.max_num_batched_tokens))

    def _on_finished(self, done: Finished) -> None:
        cancelled = done.abort_reason in CLIENT_ABORTS
        if cancelled:
            self.metrics.record_cancellation(done.abort_reason)
        if done.error is None:
            self.metrics.record_finished(done.timestamps, done.num_prompt_tokens, done.num_output_tokens,
                                         done.finish_reason, cancelled, done.priority, done.tenant)
        else:  # the engine refused or failed it after admission
            self.metrics.record_slo_result("aborted", done.priority, done.tenant)
        if self.tracer is not None:
            self._traced.pop(done.request_id, None)  # ended before any decision (the engine failed)
            self.tracer.finished(done, self.clock())
        if self.request_log is not None:
            self.request_log.finished(done)

    # ---- requests ----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", "invalid_api_key")
        return tenant

    async def create(self, kind: Kind, body, tenant: Tenant, headers, http_request):
        """Serve one /v1/completions or /v1/chat/completions request."""
        self._refuse_if_unavailable()
        if self.tracer is not None:
            _TRACED_HEADERS.set(headers)
        prepared = self.preparer.prepare(kind, body, tenant, headers)
        await self._compile_constraint(prepared)
        choices: list[Choice] = []
        watcher = asyncio.create_task(self._abort_on_disconnect(http_request, choices))
        try:
            decision = await self._start_choices(prepared, choices, headers)
        except BaseException as exc:
            watcher.cancel()
            self._abort(choices, "choice_refused" if isinstance(exc, APIError) else "disconnect")
            raise
        response_headers = self._headers(prepared, decision)
        shape = protocol.ResponseShape(kind, prepared.request_id, prepared.model,
                                       prepared.versions.fingerprint, self.tokenizer.token_text)
        if prepared.stream:
            watcher.cancel()
            events = streaming.sse(shape, choices, prepared, lambda: self._client_left(choices, http_request))
            return StreamingResponse(events, media_type="text/event-stream", headers=response_headers)
        try:
            body_json = await streaming.collect(shape, choices, prepared)
        finally:
            watcher.cancel()
        return JSONResponse(body_json, headers=response_headers)

    async def _compile_constraint(self, p: PreparedRequest) -> None:
        """Compile the request's constraint before admitting it (on the
        compiler's worker thread; cached per schema): one the grammar engine
        cannot enforce is a 400 naming its field, never an engine stall."""
        constraint = p.params.structured_output
        if constraint is None:
            return
        # shield: a client leaving mid-compile must not cancel the cached future others share.
        try:
            await asyncio.shield(asyncio.wrap_future(self.core.structured.submit(constraint)))
        except InvalidParameter as exc:
            param = p.constraint_param or "structured_output"
            message = str(exc).removeprefix(f"{exc.param} ")
            raise APIError(400, f"{param}: {message}", code="invalid_structured_output", param=param) from None

    async def _start_choices(self, p: PreparedRequest, choices: list[Choice],
                             headers: Mapping[str, str]) -> AdmissionDecision | None:
        """Admit and start every choice, each an engine request of its own
        (appended to `choices` as it is added). The first goes alone, the
        others once it has its first token: its prompt's full blocks are
        then in the prefix cache, so they share them (admission counts that
        hit, so it charges their outputs and the prompt once). Any choice
        refused refuses the response. Returns the first choice's decision
        (None only when the engine failed before deciding)."""
        decision = await self._first_output(self._add_choice(p, 0, choices), p, headers)
        others = [self._add_choice(p, i, choices) for i in range(1, p.num_choices)]
        for choice in others:
            await self._first_output(choice, p, headers)
        return decision

    def _add_choice(self, p: PreparedRequest, index: int, choices: list[Choice]) -> Choice:
        request_id = p.choice_id(index)
        request = self.core.new_request(p.prompt_token_ids, p.choice_params(index), request_id=request_id,
                                        arrival_time=p.arrival, priority=p.priority, tenant=p.tenant.name,
                                        deadline=p.deadline, adapter_id=p.adapter_id)
        if self.tracer is not None:
            self._traced[request_id] = (_TRACED_HEADERS.get(), p.params.max_tokens)
        try:
            stream = self.engine.add(request, p.is_retry)
        except RuntimeError:  # the engine failed since the check in create()
            self._traced.pop(request_id, None)
            self._refuse_if_unavailable()
            raise
        choice = Choice(index, request_id, stream, p.params.logprobs is not None, p.tool_set)
        choices.append(choice)
        return choice

    async def _first_output(self, choice: Choice, p: PreparedRequest,
                            headers: Mapping[str, str]) -> AdmissionDecision | None:
        """Wait for a choice's admission decision and its first output (kept
        in `choice.pending`); raises the APIError of one that was refused or
        ended before its first token."""
        first = await choice.stream.next()
        decision = first if isinstance(first, AdmissionDecision) else None
        if decision is not None:
            self.metrics.record_admission(decision.outcome, decision.reason)
            if self.tracer is not None and not decision.admitted:
                self._trace_refusal(p, choice.request_id, decision, headers)
            if not decision.admitted:
                raise rejection(decision)
            first = await choice.stream.next()
        if isinstance(first, Finished) and first.num_output_tokens == 0:
            raise self._ended_without_output(first, p)
        choice.pending = [first]
        return decision

    def _abort(self, choices: list[Choice], reason: str) -> None:
        for choice in choices:
            if choice.stream.finished is None:
                self.engine.abort(choice.request_id, reason)

    # ---- vLLM's token helpers ----------------------------------------------------

    def tokenize(self, body) -> dict:
        """vLLM's /tokenize: a prompt, or messages with their tools, counted
        as a request's prompt is."""
        self.preparer.resolve_model(body.model)
        try:
            if isinstance(body, protocol.TokenizeChatRequest):
                tool_set = ToolSet.of_request(body.tools, body.tool_choice, body.parallel_tool_calls)
                ids = chat_prompt_ids(self.tokenizer, protocol.chat_messages(body), tool_set,
                                      add_generation_prompt=body.add_generation_prompt is not False,
                                      add_special_tokens=bool(body.add_special_tokens))
            else:
                ids = completion_prompt_ids(self.tokenizer, self.vocab_size, body.prompt,
                                            add_special_tokens=body.add_special_tokens is not False)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        return tokenize_body(self.tokenizer, ids, self.max_model_len, bool(body.return_token_strs))

    def detokenize(self, body: protocol.DetokenizeRequest) -> dict:
        self.preparer.resolve_model(body.model)
        try:
            return detokenize_body(self.tokenizer, self.vocab_size, body.tokens)
        except InvalidParameter as exc:
            raise bad_request(exc) from None

    def _refuse_if_unavailable(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "unavailable", "shutting_down",
                           headers={"Retry-After": str(self._retry_after_s(self._drain_left_s()))})
        if self.engine.dead is not None:
            raise APIError(503, f"the engine failed: {self.engine.dead}", "unavailable", "engine_dead")
        if self.sleep_level:
            raise APIError(503, f"the server is asleep (level {self.sleep_level}); POST /wake_up to serve again",
                           "unavailable", "sleeping")

    def not_ready_error(self) -> APIError:
        """/ready's 503: starting, shutting down, or the engine failed. While
        starting or draining it says when to look again."""
        if self.engine.dead is not None:
            return APIError(503, f"not ready: the engine failed ({self.engine.dead})", "unavailable", "not_ready")
        # Starting: warm-up takes seconds; draining: this server will not admit before its drain ends.
        # Not a return slot (admission/retry_after.py): /ready is polled by orchestrators and
        # balancers, and their probes must not push refused requests' slots later.
        earliest_s = self._drain_left_s() if self.draining else 1.0
        return APIError(503, "not ready (starting or shutting down)", "unavailable", "not_ready",
                        headers={"Retry-After": str(whole_seconds(earliest_s))})

    def _drain_left_s(self) -> float:
        return max(0.0, self._drain_deadline - time.monotonic())

    def _retry_after_s(self, earliest_s: float | None = None, priority: int = 0, tenant: str = "default") -> int:
        """Retry-After for a request turned away now, staggered with every
        other refusal (admission/retry_after.py); `earliest_s` None: the
        class's expected wait."""
        retry_after_s = self.engine.retry_after_s(earliest_s, priority, tenant)
        return max(1, math.ceil(earliest_s or 0.0)) if retry_after_s is None else retry_after_s

    def _refuse_early(self, request_class: RequestClass) -> None:
        """429 before tokenizing when admission would refuse any request of
        this class and tenant now, whatever its size (see server/prepare.py)."""
        decision = self.engine.early_refusal(request_class.priority, request_class.tenant, request_class.is_retry,
                                             request_class.deadline)
        if decision is not None:
            self.metrics.record_admission(decision.outcome, decision.reason)
            if self.tracer is not None:
                now = self.clock()
                self.tracer.refused(_TRACED_HEADERS.get(), _admission(decision, 0), now, now,
                                    {"kvserve.tenant": request_class.tenant, "kvserve.priority": request_class.priority})
            raise rejection(decision)

    def _ended_without_output(self, done: Finished, p: PreparedRequest) -> APIError:
        """A 503 for a request that ended before its first token, with when
        to come back: the class's expected wait (a queue timeout, a
        deadline), what is left of the drain (shutdown)."""
        if done.error is not None:
            return ended_without_output(done)
        earliest_s = self._drain_left_s() if done.abort_reason == "shutdown" else None
        return ended_without_output(done, self._retry_after_s(earliest_s, p.priority, p.tenant.name))

    def _trace_admission(self, request_id: str, decision: AdmissionDecision) -> None:
        """Event loop, as the engine delivers a choice's decision: an
        admitted one to its trace (each choice is an engine request with a
        span of its own, under the client's traceparent). Here, not where
        the response reads the decision: a short request can finish first,
        and its span then went out without its admission."""
        traced = self._traced.pop(request_id, None)
        if traced is not None and decision.admitted:
            headers, max_tokens = traced
            self.tracer.admitted(request_id, headers, _admission(decision, max_tokens))

    def _trace_refusal(self, p: PreparedRequest, request_id: str, decision: AdmissionDecision,
                       headers: Mapping[str, str]) -> None:
        """A refused choice's span (it has no other)."""
        admission = _admission(decision, p.params.max_tokens)
        self.tracer.refused(headers, admission, p.arrival, self.clock(), {
            "gen_ai.request.id": request_id, "kvserve.tenant": p.tenant.name, "kvserve.priority": p.priority,
            "gen_ai.usage.prompt_tokens": p.num_prompt_tokens})

    def _fits_cache(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        controller = self.admission.controller
        return controller.blocks_needed(num_prompt_tokens, max_tokens) <= controller.num_blocks

    def _headers(self, p: PreparedRequest, decision: AdmissionDecision | None) -> dict[str, str]:
        """The response headers of an admitted request; `decision` None only
        when the engine failed before deciding (the response is an error)."""
        headers = self.version_headers(p.versions)
        headers["x-request-id"] = p.request_id
        max_tokens = decision.max_tokens if decision is not None and decision.max_tokens else p.params.max_tokens
        if p.max_tokens_defaulted:
            headers["x-kvserve-max-tokens"] = str(max_tokens)
        if decision is not None and decision.outcome == Outcome.DEGRADE:
            headers["x-kvserve-degraded"] = f"max_tokens={max_tokens}"
        return headers

    def version_headers(self, versions: ResolvedVersions | None = None) -> dict[str, str]:
        """The versions that shape an answer: the server's, or a request's own
        (with its schema and tool hashes, `ResolvedVersions.for_request`)."""
        v = versions or self.versions
        headers = {"x-kvserve-model-revision": v.model_revision, "x-kvserve-tokenizer-hash": v.tokenizer_hash,
                   "x-kvserve-chat-template-hash": v.chat_template_hash}
        for name, value in (("x-kvserve-adapter-id", v.adapter_id),
                            ("x-kvserve-structured-output-hash", v.structured_output_hash),
                            ("x-kvserve-tool-schema-hash", v.tool_schema_hash)):
            if value:
                headers[name] = value
        return headers

    # ---- LoRA adapters (vLLM's runtime endpoints) -----------------------------

    def _adapter_id_of(self, name: str) -> str | None:
        adapter = self.core.adapters.get(name)
        return None if adapter is None else adapter.adapter_id

    async def load_lora_adapter(self, name: str, path: str) -> str:
        """Read and serve a PEFT adapter folder; 400 for a bad folder, a name
        in use, or LoRA not enabled."""
        self._require_lora()
        if name == self.model_name:
            raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
        try:
            # Reading and hashing the files is I/O: off the event loop.
            adapter = await asyncio.to_thread(self.core.load_lora_adapter, name, path)
        except LoraError as exc:
            raise APIError(400, str(exc), code="invalid_lora_adapter", param="lora_path") from None
        except ValueError as exc:
            raise APIError(400, str(exc), code="lora_adapter_exists", param="lora_name") from None
        log.info("loaded LoRA adapter %r from %s (id %s, rank %d)", name, path, adapter.adapter_id[:12],
                 adapter.rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: str) -> str:
        """Stop serving an adapter (requests under it finish); 404 if unknown."""
        self._require_lora()
        if not self.core.unload_lora_adapter(name):
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", "invalid_request_error",
                           "lora_adapter_not_found", "lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _require_lora(self) -> None:
        if not self.core.config.enable_lora:
            raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora "
                                "or --lora-modules)", code="lora_not_enabled")

    async def _abort_on_disconnect(self, http_request, choices: list[Choice]) -> None:
        """Wait for the client to go away, then abort its requests."""
        if http_request is None:
            return
        while True:
            message = await http_request.receive()
            if message["type"] == "http.disconnect":
                self._abort(choices, "disconnect")
                return

    def _client_left(self, choices: list[Choice], http_request) -> None:
        """A stream's reader went away before its end: abort, saying whether
        it stalled (the transport's stall clock) or disconnected."""
        self._abort(choices, "stalled" if reader_stalled(getattr(http_request, "scope", None)) else "disconnect")


def _admission(decision: AdmissionDecision, max_tokens: int):
    from kvserve.tracing import Admission  # only with tracing on

    return Admission(str(decision.outcome), None if decision.reason is None else str(decision.reason),
                     decision.max_tokens or max_tokens)


def _otlp_tracer(config: ServerConfig, versions: ResolvedVersions, clock: Callable[[], float]):
    """The OTLP tracer of --otlp-traces-endpoint, or None (tracing off)."""
    if config.otlp_traces_endpoint is None:
        return None
    try:
        from kvserve.tracing import RequestTracer
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry (pip install 'kvserve[tracing]'): "
                         f"{exc}") from None
    return RequestTracer.to_otlp(config.otlp_traces_endpoint, versions, config.served_model_name, clock)


async def _load_streaming_backend() -> None:
    """Starlette runs every streaming response in an anyio task group, and
    anyio imports its asyncio backend on the first one: ~100 ms (measured
    with py-spy on this CPU) added to the first streamed request's TTFT
    after every start. Open one task group now, before /ready."""
    import anyio

    async with anyio.create_task_group():
        pass
