"""The bridge from HTTP to the engine: validate and tokenize (refusing early,
before tokenizing, what admission would refuse at any size), build the
request, hand it to the async engine (whose thread makes the admission
decision), and turn its stream into a JSON body or SSE chunks.

Headers are sent only after the request is admitted and has produced its
first token, so a refused, timed-out or failed request always gets an honest
status code, streaming or not. Every response carries the versions that ran.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionDecision, Outcome, Reason
from kvserve.admission.loop import AdmissionLoop
from kvserve.admission.step_limits import StepLimits
from kvserve.admission.step_time import MIN_FIT_STEPS
from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.contract import InvalidParameter, ResolvedVersions
from kvserve.engine.async_engine import AsyncEngine, Finished, RequestStream, StepReport
from kvserve.engine.core import EngineCore
from kvserve.metrics import ServerMetrics
from kvserve.server import protocol
from kvserve.server.tenants import Tenant, TenantDirectory
from kvserve.server.transport import reader_stalled

log = logging.getLogger(__name__)

# Rejection reasons that mean "the system is full" vs "you are over your share".
RATE_LIMITED_REASONS = {Reason.TENANT_QUOTA}
CLIENT_ABORTS = {"disconnect", "stalled"}
# Tokens a completion prompt may gain beyond one per UTF-8 byte (BOS / EOS
# and a prefix space the tokenizer adds): every BPE or byte-fallback token
# covers at least one byte of the text.
ADDED_TOKENS_SLACK = 8
# Measured warm-up steps: admission fits the step time from MIN_FIT_STEPS
# (decayed weight) on; a few more leave margin for the decay.
WARM_UP_MIN_STEPS = MIN_FIT_STEPS + 4


class APIError(Exception):
    """An OpenAI-shaped error with an honest status (rendered by
    server/errors.py, whose responses always encode)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}


def bad_request(exc: InvalidParameter) -> APIError:
    return APIError(400, str(exc), param=exc.param)


@dataclass
class _Prepared:
    """A validated request before admission."""

    kind: str
    request_id: str
    prompt_token_ids: list[int]
    params: object  # SamplingParams
    max_tokens_defaulted: bool
    arrival: float
    priority: int
    tenant: Tenant
    is_retry: bool
    deadline: float | None
    stream: bool
    include_usage: bool


class Serving:
    """Owns the async engine, the admission loop it drives, metrics and tenants."""

    def __init__(self, core: EngineCore, admission_config: AdmissionConfig, server_config: ServerConfig,
                 tenants: TenantDirectory | None = None, clock: Callable[[], float] = time.monotonic,
                 versions: ResolvedVersions | None = None) -> None:
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
            self.tenants.limits()))
        self.metrics = ServerMetrics(self.model_name, admission_config.ttft_slo_s, admission_config.tpot_slo_s)
        self.metrics.record_weights(core.weight_formats())
        self.engine = AsyncEngine(core, self.admission, on_step=self._on_step)
        # Request ids: a random per-process prefix and a counter. uuid4 per
        # request costs an urandom syscall, which hands the GIL to the engine
        # thread on every request (measurable under overload).
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()
        self._chat_bytes_per_message = self._chat_template_overhead_bytes()
        self.started = False
        self.draining = False
        self._drain_deadline = 0.0  # monotonic time the drain aborts what is left

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self.config.warm_up:
            await self._warm_up()
            await _load_streaming_backend()
        self.engine.start()
        self.started = True

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
        deadline = self._drain_deadline = time.monotonic() + grace_s
        while self.engine.num_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.engine.streams):
            self.engine.abort(rid, "shutdown")
        flush_deadline = time.monotonic() + 2.0
        while self.engine.num_streams and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.engine.stop()

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.engine.dead is None

    # ---- engine events (event loop thread): metrics ---------------------------

    def _on_step(self, report: StepReport) -> None:
        for done in report.finished:
            self._on_finished(done)
        self.metrics.record_step(report.num_decode_seqs, report.num_prefill_tokens, report.step_s)
        if report.stats is not None:
            s = report.stats
            self.metrics.record_stats(s.num_running, s.num_waiting, s.kv_usage, s.num_preemptions,
                                      s.prefix_cache_queries, s.prefix_cache_hits)
        if report.limits is not None:
            self._record_limits(report.limits)

    def _record_limits(self, limits: StepLimits) -> None:
        self.metrics.running_cap.set(limits.max_running)
        tokens = limits.max_batched_tokens
        self.metrics.step_token_budget.set(self.max_num_batched_tokens if tokens is None
                                           else min(tokens, self.max_num_batched_tokens))

    def _on_finished(self, done: Finished) -> None:
        if done.abort_reason in CLIENT_ABORTS:
            self.metrics.record_cancellation(done.abort_reason)
        if done.error is None:
            self.metrics.record_finished(done.timestamps, done.num_prompt_tokens, done.num_output_tokens,
                                         done.finish_reason)

    # ---- requests ----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", "invalid_api_key")
        return tenant

    async def create(self, kind: str, body, tenant: Tenant, headers, http_request):
        """Serve one /v1/completions or /v1/chat/completions request."""
        self._refuse_if_unavailable()
        prepared = self._prepare(kind, body, tenant, headers)
        request = self.core.new_request(prepared.prompt_token_ids, prepared.params, request_id=prepared.request_id,
                                        arrival_time=prepared.arrival, priority=prepared.priority,
                                        tenant=tenant.name, deadline=prepared.deadline)
        stream = self.engine.add(request, prepared.is_retry)
        shape = protocol.ResponseShape(kind, prepared.request_id, self.model_name,
                                       self.versions.fingerprint, self.tokenizer.token_text)
        watcher = asyncio.create_task(self._abort_on_disconnect(http_request, prepared.request_id))
        try:
            first = await stream.next()
            decision = first if isinstance(first, AdmissionDecision) else None
            if decision is not None:
                self.metrics.record_admission(decision.outcome, decision.reason)
                if decision.admitted:
                    first = await stream.next()
        except BaseException:
            watcher.cancel()
            self.engine.abort(prepared.request_id, "disconnect")
            raise
        if decision is not None and not decision.admitted:
            watcher.cancel()
            raise _rejection(decision)
        response_headers = self._headers(prepared, decision)
        if isinstance(first, Finished) and first.num_output_tokens == 0:
            watcher.cancel()
            raise self._ended_without_output(first)
        if prepared.stream:
            watcher.cancel()
            events = self._sse(shape, stream, first, prepared, http_request)
            return StreamingResponse(events, media_type="text/event-stream", headers=response_headers)
        try:
            body_json = await self._collect(shape, stream, first, prepared)
        finally:
            watcher.cancel()
        return JSONResponse(body_json, headers=response_headers)

    def _refuse_if_unavailable(self) -> None:
        if self.draining:
            # Retry-After: this server will not admit anything before its drain ends.
            retry_after_s = max(1, math.ceil(self._drain_deadline - time.monotonic()))
            raise APIError(503, "the server is shutting down", "unavailable", "shutting_down",
                           headers={"Retry-After": str(retry_after_s)})
        if self.engine.dead is not None:
            raise APIError(503, f"the engine failed: {self.engine.dead}", "unavailable", "engine_dead")

    def _prepare(self, kind: str, body, tenant: Tenant, headers) -> _Prepared:
        arrival = self.clock()
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "invalid_request_error", "model_not_found", "model")
        try:
            protocol.refuse_unsupported(body)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        deadline = self._deadline(headers, arrival)
        priority, is_retry = protocol.priority_of(body, tenant.priority), _is_retry(headers)
        self._refuse_before_tokenizing(kind, body, tenant, priority, is_retry, deadline)
        try:
            prompt = self._prompt_token_ids(kind, body)
            max_tokens, defaulted = self._max_tokens(body, len(prompt))
            params = protocol.sampling_params(body, max_tokens, self.vocab_size)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = f"{prefix}-{self._id_prefix}{next(self._id_counter):010x}"
        return _Prepared(kind, request_id, prompt, params, defaulted, arrival, priority, tenant, is_retry,
                         deadline, bool(body.stream), include_usage)

    def _refuse_before_tokenizing(self, kind: str, body, tenant: Tenant, priority: int, is_retry: bool,
                                  deadline: float | None) -> None:
        """429 without tokenizing or building sampling state when admission
        would refuse any request of this class and tenant, whatever its size.

        Under overload most requests are refused; tokenizing them (and the
        chat template) is CPU taken from the engine on a shared machine.
        Only done when a cheap upper bound on the prompt's tokens shows that
        none of the size-dependent 400s (prompt too long, max_tokens past the
        context, never fits the cache or the tenant's tokens per minute)
        applies, so those keep their status. The other 400s of a request
        refused here (bad sampling fields, non-text content parts, a chat
        template that rejects the messages) surface when it is retried."""
        bound = self._prompt_token_bound(kind, body)
        if bound is None or not self._size_cannot_be_refused(bound, body, tenant):
            return
        decision = self.engine.early_refusal(priority, tenant.name, is_retry, deadline)
        if decision is not None:
            self.metrics.record_admission(decision.outcome, decision.reason)
            raise _rejection(decision)

    def _prompt_token_bound(self, kind: str, body) -> int | None:
        """At least as many tokens as the prompt has; None if unknown or the
        prompt is malformed (the full path gives the 400)."""
        if kind == "chat":
            if self._chat_bytes_per_message is None:
                return None
            num_bytes = 0
            for message in body.messages:
                content = message.content
                if isinstance(content, list):
                    content = "".join(p.text or "" for p in content)
                num_bytes += len((content or "").encode()) + len(message.role.encode())
            return num_bytes + self._chat_bytes_per_message * len(body.messages)
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return len(prompt.encode()) + ADDED_TOKENS_SLACK if prompt else None
        vocab = self.vocab_size
        if prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            return len(prompt)
        return None

    def _size_cannot_be_refused(self, bound: int, body, tenant: Tenant) -> bool:
        """True when a prompt of at most `bound` tokens with the body's
        max_tokens can get none of the size-dependent 400s."""
        requested = protocol.requested_max_tokens(body)
        if requested is None:
            if self.admission_config.require_max_tokens:
                return False
            requested = self.admission_config.default_max_tokens
        if requested < 1 or bound + requested > self.max_model_len:
            return False
        controller = self.admission.controller
        if controller.blocks_needed(bound, requested) > controller.num_blocks:
            return False
        tokens_per_minute = tenant.limits.tokens_per_minute
        return tokens_per_minute is None or bound + requested <= tokens_per_minute

    def _chat_template_overhead_bytes(self) -> int | None:
        """UTF-8 bytes the chat template adds around one message (system
        prompt, role markers, generation prompt), for `_prompt_token_bound`;
        None when it cannot be measured."""
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}])
        except (ValueError, AttributeError):
            return None
        return len(text.encode()) + ADDED_TOKENS_SLACK

    def _prompt_token_ids(self, kind: str, body) -> list[int]:
        if kind == "chat":
            try:
                text = self.tokenizer.apply_chat_template(protocol.chat_messages(body))
            except ValueError as exc:
                raise InvalidParameter("messages", str(exc)) from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._completion_prompt(body.prompt)
        if not ids:
            raise InvalidParameter("prompt" if kind == "completion" else "messages",
                                   "must contain at least one token")
        return ids

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidParameter("prompt", "batched prompts are not supported; send one prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise InvalidParameter("prompt", f"token ids must be integers in [0, {vocab})")
        return list(prompt)

    def _max_tokens(self, body, num_prompt_tokens: int) -> tuple[int, bool]:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidParameter("prompt", f"has {num_prompt_tokens} tokens; this model's context is "
                                             f"{self.max_model_len} tokens including the output")
        requested = protocol.requested_max_tokens(body)
        if requested is None:
            if self.admission_config.require_max_tokens:
                raise InvalidParameter("max_tokens", "is required by this server (strict mode)")
            return min(self.admission_config.default_max_tokens, room), True
        if requested < 1:
            raise InvalidParameter("max_tokens", f"must be >= 1, got {requested}")
        if requested > room:
            raise InvalidParameter("max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                                                 f"({requested}) exceeds the context of {self.max_model_len}")
        return requested, False

    def _deadline(self, headers, arrival: float) -> float | None:
        raw = headers.get("x-kvserve-deadline-s")
        if raw is None:
            return None
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not (0 < seconds < 1e6):
            raise APIError(400, "x-kvserve-deadline-s must be a number of seconds in (0, 1e6)",
                           param="x-kvserve-deadline-s")
        return arrival + seconds

    def _headers(self, p: _Prepared, decision: AdmissionDecision | None) -> dict[str, str]:
        """The response headers of an admitted request; `decision` None only
        when the engine failed before deciding (the response is an error)."""
        headers = self.version_headers()
        headers["x-request-id"] = p.request_id
        max_tokens = decision.max_tokens if decision is not None and decision.max_tokens else p.params.max_tokens
        if p.max_tokens_defaulted:
            headers["x-kvserve-max-tokens"] = str(max_tokens)
        if decision is not None and decision.outcome == Outcome.DEGRADE:
            headers["x-kvserve-degraded"] = f"max_tokens={max_tokens}"
        return headers

    def version_headers(self) -> dict[str, str]:
        v = self.versions
        return {"x-kvserve-model-revision": v.model_revision, "x-kvserve-tokenizer-hash": v.tokenizer_hash,
                "x-kvserve-chat-template-hash": v.chat_template_hash}

    def _ended_without_output(self, done: Finished) -> APIError:
        if done.error is not None:
            return APIError(400, done.error, code="engine_refused")
        reason = done.abort_reason or "abort"
        messages = {Reason.QUEUE_TIMEOUT: "the request waited too long in the queue and did not start",
                    Reason.DEADLINE: "the request could not start before its deadline",
                    "shutdown": "the server is shutting down"}
        return APIError(503, messages.get(reason, f"the request was aborted ({reason})"),
                        "unavailable", reason)

    async def _abort_on_disconnect(self, http_request, request_id: str) -> None:
        """Wait for the client to go away, then abort its request."""
        if http_request is None:
            return
        while True:
            message = await http_request.receive()
            if message["type"] == "http.disconnect":
                self.engine.abort(request_id, "disconnect")
                return

    # ---- response bodies ---------------------------------------------------

    async def _collect(self, shape, stream: RequestStream, first, p: _Prepared) -> dict:
        last, logprobs = None, [] if p.params.logprobs is not None else None
        item = first
        while not isinstance(item, Finished):
            last = item
            if logprobs is not None:
                logprobs.extend(_new_logprobs(item))
            item = await stream.next()
        text = last.text if last is not None else ""
        num_out = len(last.token_ids) if last is not None else 0
        reason = item.finish_reason
        return shape.full(text, reason, logprobs,
                          protocol.usage(len(p.prompt_token_ids), num_out, _cached(last)))

    async def _sse(self, shape, stream: RequestStream, first, p: _Prepared, http_request) -> AsyncIterator[str]:
        """One `data:` event per batch of outputs ready together: when the
        reader falls behind the engine (overload, a slow client), the tokens
        that piled up go out as one multi-token delta instead of one event
        each, which saves the JSON encoding and the socket write per token
        that compete with the engine for the CPU. Logprobs keep one entry
        per token; text_offset counts from the start of the completion."""
        pending, last, is_first, text_offset = [first], None, True, 0
        wants_logprobs = p.params.logprobs is not None
        try:
            while True:
                batch = pending + stream.ready()
                outputs = [x for x in batch if not isinstance(x, Finished)]
                end = batch[-1] if isinstance(batch[-1], Finished) else None  # Finished comes last
                if outputs:
                    newest = outputs[-1]
                    text = "".join(o.new_text for o in outputs)
                    lp = [x for o in outputs for x in _new_logprobs(o)] if wants_logprobs else None
                    finish = newest.finish_reason if newest.finished else None
                    if text or finish or is_first or lp:
                        yield shape.chunk(text, finish, lp, first=is_first,
                                          with_usage_field=p.include_usage, text_offset=text_offset)
                        is_first = False
                        text_offset += shape.text_length(lp)
                    last = newest
                if end is not None:
                    break
                pending = [await stream.next()]
            if last is None or not last.finished:  # aborted mid-stream: say so
                yield shape.chunk(None, end.finish_reason, None, with_usage_field=p.include_usage)
            if p.include_usage:
                num_out = len(last.token_ids) if last is not None else 0
                yield shape.usage_chunk(protocol.usage(len(p.prompt_token_ids), num_out, _cached(last)))
            yield protocol.SSE_DONE
        finally:
            if stream.finished is None:  # the client left (generator closed) before the end
                reason = "stalled" if reader_stalled(getattr(http_request, "scope", None)) else "disconnect"
                self.engine.abort(p.request_id, reason)


def _new_logprobs(output) -> list:
    return list(getattr(output, "new_logprobs", None) or output.logprobs or [])


def _cached(output) -> int:
    return int(getattr(output, "num_cached_tokens", 0) or 0) if output is not None else 0


def _is_retry(headers) -> bool:
    for name in ("x-stainless-retry-count", "x-kvserve-retry"):
        raw = (headers.get(name) or "").strip().lower()
        if raw in ("true", "yes"):
            return True
        try:
            if int(raw) > 0:
                return True
        except ValueError:
            continue
    return False


def _rejection(decision) -> APIError:
    headers = {}
    if decision.retry_after_s is not None:
        headers["Retry-After"] = str(decision.retry_after_s)
    if decision.status == 400:
        type_ = "invalid_request_error"
    else:
        type_ = "rate_limited" if decision.reason in RATE_LIMITED_REASONS else "overloaded"
    return APIError(decision.status, decision.message, type_, decision.reason, None, headers)


async def _load_streaming_backend() -> None:
    """Starlette runs every streaming response in an anyio task group, and
    anyio imports its asyncio backend on the first one: ~100 ms (measured
    with py-spy on this CPU) added to the first streamed request's TTFT
    after every start. Open one task group now, before /ready."""
    import anyio

    async with anyio.create_task_group():
        pass
