"""The serving pipeline's first stage: a parsed body -> one validated, typed
`PreparedRequest` (prompt token ids, max_tokens resolved once, sampling
params, deadline, priority, retry flag), or an `APIError` saying why not.

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
from dataclasses import dataclass
from typing import Literal

from kvserve.config import AdmissionConfig
from kvserve.contract import InvalidParameter, SamplingParams
from kvserve.server import protocol
from kvserve.server.errors import APIError, bad_request
from kvserve.server.tenants import Tenant

Kind = Literal["completion", "chat"]
# Tokens a completion prompt may gain beyond one per UTF-8 byte (BOS / EOS
# and a prefix space the tokenizer adds): every BPE or byte-fallback token
# covers at least one byte of the text.
ADDED_TOKENS_SLACK = 8
DEADLINE_HEADER = "x-kvserve-deadline-s"
RETRY_HEADERS = ("x-stainless-retry-count", "x-kvserve-retry")


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


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
    any request of that class would get now, or returns."""

    def __init__(self, tokenizer, limits: ModelLimits, admission_config: AdmissionConfig,
                 fits_cache: Callable[[int, int], bool], refuse_early: Callable[[RequestClass], None],
                 clock: Callable[[], float]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
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
        if body.model is not None and body.model != self.limits.name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{self.limits.name!r}", "invalid_request_error", "model_not_found", "model")
        try:
            protocol.refuse_unsupported(body)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        request_class = RequestClass(protocol.priority_of(body, tenant.priority), tenant.name,
                                     is_retry(headers), deadline_of(headers, arrival))
        bound = self._prompt_token_bound(kind, body)
        if bound is not None and self._size_cannot_be_refused(bound, body, tenant):
            self.refuse_early(request_class)
        try:
            prompt = self._prompt_token_ids(kind, body)
            max_tokens, defaulted = self._max_tokens(body, len(prompt))
            params = protocol.sampling_params(body, max_tokens, self.limits.vocab_size)
        except InvalidParameter as exc:
            raise bad_request(exc) from None
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return PreparedRequest(
            kind, f"{prefix}-{self._id_prefix}{next(self._id_counter):010x}", prompt, params, defaulted, arrival,
            request_class.priority, tenant, request_class.is_retry, request_class.deadline, bool(body.stream),
            bool(body.stream_options and body.stream_options.include_usage))

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
        vocab_size = self.limits.vocab_size
        return all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids)

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

    def _prompt_token_ids(self, kind: Kind, body) -> list[int]:
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
        if not self._in_vocab(prompt):
            raise InvalidParameter("prompt", f"token ids must be integers in [0, {self.limits.vocab_size})")
        return list(prompt)


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


def is_retry(headers: Mapping[str, str]) -> bool:
    """Whether the client says this is a retry (the OpenAI SDK's header, or ours)."""
    for name in RETRY_HEADERS:
        raw = (headers.get(name) or "").strip().lower()
        if raw in ("true", "yes"):
            return True
        try:
            if int(raw) > 0:
                return True
        except ValueError:
            continue
    return False
