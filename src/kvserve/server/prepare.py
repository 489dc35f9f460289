"""The serving pipeline's first stage: a parsed body -> one validated, typed
`PreparedRequest` (prompt token ids, max_tokens resolved once, sampling
params with the request's one structured-output constraint, its choices and
tools, the versions that shape its answer, deadline, priority, retry flag),
or an `APIError` saying why not.

The size rules live here once: the context length (`_max_tokens`) and the
vocabulary (`_in_vocab`) are checked by the same functions for the cheap
bound taken before tokenizing and for the tokenized prompt.

Before tokenizing, a request that admission would refuse at any size is
handed to `refuse_early` (which raises its 429): under overload most
requests are refused, and tokenizing them (and the chat template) is CPU
taken from the engine on a shared machine. That is done only when a cheap
upper bound on the prompt's tokens shows that none of the size-dependent
400s (prompt too long, max_tokens past the context, never fits the cache or
the tenant's tokens per minute) applies, so those keep their status. The
other 400s of a request refused early (bad sampling fields, non-text content
parts, a chat template that rejects the messages) surface when it is retried.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from kvserve.admission.tenants import Tenant
from kvserve.config import AdmissionConfig
from kvserve.contract import InvalidParameter, ResolvedVersions, SamplingParams, StructuredOutput
from kvserve.server import protocol
from kvserve.server.errors import APIError, bad_request
from kvserve.server.prompts import chat_prompt_ids, completion_prompt_ids, in_vocab
from kvserve.server.tools import ToolSet

Kind = Literal["completion", "chat"]
# Tokens a completion prompt may gain beyond one per UTF-8 byte (BOS / EOS
# and a prefix space the tokenizer adds): every BPE or byte-fallback token
# covers at least one byte of the text.
ADDED_TOKENS_SLACK = 8
DEADLINE_HEADER = "x-kvserve-deadline-s"


@dataclass(frozen=True)
class RequestClass:
    """What admission needs to refuse a request before it is tokenized."""

    priority: int
    tenant: str
    is_retry: bool
    deadline: float | None


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed every check that does not need the engine."""

    kind: Kind
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved
    max_tokens_defaulted: bool  # the server chose max_tokens (said in x-kvserve-max-tokens)
    arrival: float  # on the server's clock
    priority: int
    tenant: Tenant
    is_retry: bool
    deadline: float | None  # on the server's clock
    stream: bool
    include_usage: bool
    versions: ResolvedVersions  # what shapes this answer: the server's plus its schema and tool hashes
    num_choices: int = 1  # n: one engine request per choice
    tool_set: ToolSet | None = None
    constraint_param: str | None = None  # the field the structured-output constraint came from
    model: str = ""  # what the response names: the base model, or the LoRA adapter the body named
    adapter_id: str | None = None  # that adapter's id (its file hash); None: the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def choice_params(self, index: int) -> SamplingParams:
        """Choice i of a seeded request samples with seed + i, so the n
        choices differ and the same request gives the same n again."""
        if index == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2**64)

    def choice_id(self, index: int) -> str:
        """The engine request id of choice i (choice 0's is the response's id)."""
        return self.request_id if index == 0 else f"{self.request_id}-{index}"


@dataclass(frozen=True)
class ModelLimits:
    """The facts of the served model that the size checks need."""

    name: str
    vocab_size: int
    max_model_len: int


class RequestPreparer:
    """Turns bodies into `PreparedRequest`s: one call per request.

    `fits_cache(prompt_tokens, max_tokens)` says whether such a request can
    ever fit the KV cache; `refuse_early(RequestClass)` raises the refusal
    any request of that class would get now, or returns. `versions` are the
    server's (each request adds its own hashes); `max_n` bounds `n`;
    `adapter_id_of(name)` is the id of the LoRA adapter served as `name`, or None."""

    def __init__(self, tokenizer, limits: ModelLimits, admission_config: AdmissionConfig,
                 fits_cache: Callable[[int, int], bool], refuse_early: Callable[[RequestClass], None],
                 clock: Callable[[], float], versions: ResolvedVersions, max_n: int = 1,
                 adapter_id_of: Callable[[str], str | None] = lambda name: None) -> None:
        self.tokenizer = tokenizer
        self.adapter_id_of = adapter_id_of
        self.limits = limits
        self.versions = versions
        self.max_n = max_n
        self.admission_config = admission_config
        self.fits_cache = fits_cache
        self.refuse_early = refuse_early
        self.clock = clock
        # Request ids: a random per-process prefix and a counter. uuid4 per
        # request costs an urandom syscall, which hands the GIL to the engine
        # thread on every request (measurable under overload).
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()
        self._chat_bytes_per_message = self._chat_template_overhead_bytes()

    def prepare(self, kind: Kind, body, tenant: Tenant, headers: Mapping[str, str]) -> PreparedRequest:
        arrival = self.clock()
        model, adapter_id = self.resolve_model(body.model)
        try:
            protocol.refuse_unsupported(body, self.max_n)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        request_class = RequestClass(protocol.priority_of(body, tenant.priority), tenant.name,
                                     protocol.is_retry(headers), deadline_of(headers, arrival))
        bound = self._prompt_token_bound(kind, body)
        if bound is not None and self._size_cannot_be_refused(bound, body, tenant):
            self.refuse_early(request_class)
        try:
            tool_set = (ToolSet.of_request(body.tools, body.tool_choice, body.parallel_tool_calls)
                        if kind == "chat" else None)
            constraint, constraint_param = _constraint(body, tool_set)
            prompt = self.prompt_token_ids(kind, body, tool_set)
            max_tokens, defaulted = self._max_tokens(body, len(prompt))
            params = protocol.sampling_params(body, max_tokens, self.limits.vocab_size, constraint)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        versions = self.versions.for_request(params, None if tool_set is None else tool_set.schema_hash, adapter_id)
        return PreparedRequest(
            kind, f"{prefix}-{self._id_prefix}{next(self._id_counter):010x}", prompt, params, defaulted, arrival,
            request_class.priority, tenant, request_class.is_retry, request_class.deadline, bool(body.stream),
            bool(body.stream_options and body.stream_options.include_usage), versions, body.n or 1, tool_set,
            constraint_param, model, adapter_id)

    def resolve_model(self, name: str | None) -> tuple[str, str | None]:
        """(the name the response gives, the LoRA adapter's id or None) of a
        request's `model`: the one place it is looked up; 404 for a name this
        server does not serve (neither the base model nor a loaded adapter)."""
        base = self.limits.name
        if name is None or name == base:
            return base, None
        adapter_id = self.adapter_id_of(name)
        if adapter_id is None:
            raise APIError(404, f"model {name!r} does not exist; this server serves {base!r} and the LoRA "
                                "adapters GET /v1/models lists", "invalid_request_error", "model_not_found", "model")
        return name, adapter_id

    # ---- the size rules ------------------------------------------------------

    def _max_tokens(self, body, num_prompt_tokens: int) -> tuple[int, bool]:
        """(max_tokens, defaulted): the body's, or the server's default
        clamped to the room left in the context."""
        max_model_len = self.limits.max_model_len
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidParameter("prompt", f"has {num_prompt_tokens} tokens; this model's context is "
                                             f"{max_model_len} tokens including the output")
        requested = protocol.requested_max_tokens(body)
        if requested is None:
            if self.admission_config.require_max_tokens:
                raise InvalidParameter("max_tokens", "is required by this server (strict mode)")
            return min(self.admission_config.default_max_tokens, room), True
        if requested < 1:
            raise InvalidParameter("max_tokens", f"must be >= 1, got {requested}")
        if requested > room:
            raise InvalidParameter("max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                                                 f"({requested}) exceeds the context of {max_model_len}")
        return requested, False

    def _in_vocab(self, token_ids: list) -> bool:
        return in_vocab(token_ids, self.limits.vocab_size)

    def _size_cannot_be_refused(self, bound: int, body, tenant: Tenant) -> bool:
        """True when a prompt of at most `bound` tokens with the body's
        max_tokens can get none of the size-dependent 400s."""
        try:
            max_tokens, _ = self._max_tokens(body, bound)
        except InvalidParameter:
            return False
        if not self.fits_cache(bound, max_tokens):
            return False
        tokens_per_minute = tenant.limits.tokens_per_minute
        return tokens_per_minute is None or bound + max_tokens <= tokens_per_minute

    # ---- the prompt ----------------------------------------------------------

    def _prompt_token_bound(self, kind: Kind, body) -> int | None:
        """At least as many tokens as the prompt has; None if unknown or the
        prompt is malformed (the full path gives the 400)."""
        if kind == "chat":
            if self._chat_bytes_per_message is None or body.tools:
                return None  # unknown, or tools the template renders beside the messages
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
        if prompt and self._in_vocab(prompt):
            return len(prompt)
        return None

    def _chat_template_overhead_bytes(self) -> int | None:
        """UTF-8 bytes the chat template adds around one message (system
        prompt, role markers, generation prompt), for `_prompt_token_bound`;
        None when it cannot be measured."""
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}])
        except (ValueError, AttributeError):
            return None
        return len(text.encode()) + ADDED_TOKENS_SLACK

    def prompt_token_ids(self, kind: Kind, body, tool_set: ToolSet | None = None) -> list[int]:
        """The prompt as the engine gets it (server/prompts.py; the tools rendered for chat)."""
        if kind == "chat":
            return chat_prompt_ids(self.tokenizer, protocol.chat_messages(body), tool_set)
        return completion_prompt_ids(self.tokenizer, self.limits.vocab_size, body.prompt)


def _constraint(body, tool_set: ToolSet | None) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured-output constraint and the field it came from:
    its own, or the one a forced tool call brings (never both)."""
    own = protocol.structured_output_of(body)
    forced = tool_set.constraint() if tool_set is not None else None
    if own is not None and forced is not None:
        raise InvalidParameter(own.param, "cannot be combined with tool_choice 'required' or a named function")
    if own is not None:
        return own.output, own.param
    return forced, None if forced is None else "tools"


def deadline_of(headers: Mapping[str, str], arrival: float) -> float | None:
    """The request's deadline on the server's clock, from its relative header."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (0 < seconds < 1e6):
        raise APIError(400, f"{DEADLINE_HEADER} must be a number of seconds in (0, 1e6)", param=DEADLINE_HEADER)
    return arrival + seconds


