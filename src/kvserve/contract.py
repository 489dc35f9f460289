"""The request contract shared by every layer: sampling parameters, the request
record with its single progress counter, the ordered status enum, and the one
constructor of requests (`RequestFactory`).

Pure Python: no torch; timestamps are stamped by callers from an injected
clock.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

from mypy_extensions import mypyc_attr

# Bounds on user-supplied stop strings: each one is checked against the tail
# of the generated text after every token, so they must stay small.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
# logit_bias: OpenAI's range per token, and a bound on the entries (each one is
# added to its row every step).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_OPENAI_PENALTY = 2.0
# A structured-output spec is compiled into a grammar: bound its size so one
# request cannot claim a compile worker for long.
MAX_STRUCTURED_SPEC_CHARS = 100_000
MAX_CHOICES = 1024


class RequestStatus(IntEnum):
    """Ordered lifecycle: every value >= FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# OpenAI `finish_reason` for each terminal state ("abort" is vLLM's extension).
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def finish_reason(status: RequestStatus) -> str | None:
    """The OpenAI finish_reason of a terminal status, None while unfinished."""
    return FINISH_REASONS.get(status)


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output, enforced token by token while decoding
    (vLLM's `structured_outputs`; OpenAI's `response_format` maps onto it):

    - `json`: `spec` is a JSON Schema (a dict, or its JSON text);
    - `json_object`: any JSON object (`spec` unused);
    - `regex`: `spec` is a regular expression the whole output matches;
    - `choice`: `spec` is a list of strings, the output is exactly one of them;
    - `grammar`: `spec` is a context-free grammar (Lark, or llama.cpp's GBNF).

    Validated here for shape only (types, sizes, JSON that parses); whether
    the grammar engine can enforce it is checked when it is compiled
    (kvserve.structured), which raises InvalidParameter naming the problem.
    `spec` is stored canonical (a JSON Schema as compact JSON text, choices as
    a tuple), so equal constraints have equal `hash`.
    """

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _canonical_spec(self.kind, self.spec))

    @property
    def hash(self) -> str:
        """sha256 of kind and canonical spec: the compile cache key and the
        schema hash in the versions."""
        text = json.dumps([self.kind, self.spec], ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _canonical_spec(kind: Any, spec: Any) -> Any:
    _require(kind in STRUCTURED_OUTPUT_KINDS, "structured_output",
             f"kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {kind!r}")
    if kind == "json_object":
        return None
    if kind == "json":
        return _canonical_schema(spec)
    if kind == "choice":
        _require(isinstance(spec, (list, tuple)) and 0 < len(spec) <= MAX_CHOICES, "structured_output",
                 f"choice needs a list of 1..{MAX_CHOICES} strings")
        _require(all(isinstance(c, str) and c for c in spec), "structured_output",
                 "each choice must be a non-empty string")
        _require(sum(len(c) for c in spec) <= MAX_STRUCTURED_SPEC_CHARS, "structured_output",
                 f"choices total more than {MAX_STRUCTURED_SPEC_CHARS} characters")
        return tuple(spec)
    _require(isinstance(spec, str) and 0 < len(spec) <= MAX_STRUCTURED_SPEC_CHARS, "structured_output",
             f"{kind} must be a string of 1..{MAX_STRUCTURED_SPEC_CHARS} characters")
    return spec


def _canonical_schema(spec: Any) -> str:
    """A JSON Schema as compact JSON text. Key order is kept: it is the order
    the properties are generated in, so it is part of the constraint."""
    if isinstance(spec, str):
        _require(len(spec) <= MAX_STRUCTURED_SPEC_CHARS, "structured_output",
                 f"the JSON schema is longer than {MAX_STRUCTURED_SPEC_CHARS} characters")
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidParameter("structured_output", f"the JSON schema is not valid JSON: {e}") from None
    _require(isinstance(spec, (dict, bool)), "structured_output",
             f"the JSON schema must be an object, got {type(spec).__name__}")
    try:
        text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidParameter("structured_output", f"the JSON schema is not JSON: {e}") from None
    _require(len(text) <= MAX_STRUCTURED_SPEC_CHARS, "structured_output",
             f"the JSON schema is longer than {MAX_STRUCTURED_SPEC_CHARS} characters")
    return text


# A plain Python class in the compiled core too, so its own checks name a
# wrong field (kvserve/compiled says why).
@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated at construction; a bad value raises
    ValueError naming the field, so the HTTP layer can answer 400 with it."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per output token
    # OpenAI's penalties over the generated tokens: presence subtracts once per
    # token that occurred, frequency once per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / Hugging Face's: over prompt and generated tokens, a seen token's
    # logit is divided by it when positive, multiplied when negative; 1 = off.
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit, in [-100, 100]; stored as sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # The fields as given, untyped: only the checks below make them what
        # the annotations say.
        given: Any = SimpleNamespace(**vars(self))
        # Accept any iterable (lists from JSON, a bare string) and store tuples
        # so the params stay hashable and immutable.
        given.stop = (given.stop,) if isinstance(given.stop, str) else tuple(given.stop or ())
        given.stop_token_ids = tuple(given.stop_token_ids or ())
        given.logit_bias = _logit_bias_pairs(given.logit_bias)
        self._validate(given)
        self._validate_penalties(given)
        object.__setattr__(self, "stop", given.stop)
        object.__setattr__(self, "stop_token_ids", given.stop_token_ids)
        object.__setattr__(self, "logit_bias", given.logit_bias)

    @staticmethod
    def _validate(given: Any) -> None:
        _require(_is_int(given.max_tokens) and given.max_tokens >= 1,
                 "max_tokens", f"must be an integer >= 1, got {given.max_tokens!r}")
        _require(_is_number(given.temperature) and given.temperature >= 0,
                 "temperature", f"must be >= 0, got {given.temperature!r}")
        _require(_is_number(given.top_p) and 0 < given.top_p <= 1,
                 "top_p", f"must be in (0, 1], got {given.top_p!r}")
        _require(_is_int(given.top_k) and given.top_k >= 0,
                 "top_k", f"must be an integer >= 0 (0 disables), got {given.top_k!r}")
        _require(given.seed is None or _is_int(given.seed),
                 "seed", f"must be an integer or null, got {given.seed!r}")
        _require(_is_int(given.min_tokens) and 0 <= given.min_tokens <= given.max_tokens,
                 "min_tokens", f"must be an integer in [0, max_tokens], got {given.min_tokens!r}")
        _require(len(given.stop) <= MAX_STOP_STRINGS,
                 "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(given.stop)}")
        for s in given.stop:
            _require(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS,
                     "stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        _require(len(given.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                 "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        _require(all(_is_int(t) and t >= 0 for t in given.stop_token_ids),
                 "stop_token_ids", "must be non-negative integers")
        _require(given.logprobs is None or (_is_int(given.logprobs) and 0 <= given.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {given.logprobs!r}")

    @staticmethod
    def _validate_penalties(given: Any) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(given, name)
            _require(_is_number(value) and -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY, name,
                     f"must be in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}], got {value!r}")
        _require(_is_number(given.repetition_penalty) and math.isfinite(given.repetition_penalty)
                 and given.repetition_penalty > 0, "repetition_penalty",
                 f"must be a finite number > 0 (1 disables), got {given.repetition_penalty!r}")
        _require(len(given.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                 f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(given.logit_bias)}")
        for token_id, bias in given.logit_bias:
            _require(_is_int(token_id) and token_id >= 0, "logit_bias",
                     f"keys must be non-negative token ids, got {token_id!r}")
            _require(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                     f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} "
                     f"for token {token_id}")
        _require(given.structured_output is None or isinstance(given.structured_output, StructuredOutput),
                 "structured_output", "must be a StructuredOutput or null")
        # A stop string or stop token would end the output before the constraint
        # completes, and "stop" would then name an output that does not parse.
        _require(given.structured_output is None or not (given.stop or given.stop_token_ids), "stop",
                 "cannot be combined with structured_output (the output ends when the constraint completes)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _logit_bias_pairs(bias: Any) -> tuple:
    """A {token_id: bias} mapping (JSON's string keys accepted) or pairs, as
    sorted (int, float) pairs; a key that is not an integer is left as is for
    the validation to name."""
    if not bias:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = []
    for key, value in items:
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        pairs.append((key, float(value) if _is_number(value) else value))
    return tuple(sorted(pairs, key=lambda pair: (str(type(pair[0])), pair[0])))


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


@dataclass(frozen=True)
class ResolvedVersions:
    """What actually ran, so a trace links to it: model revision (sha256 of
    the weights file or folder manifest), tokenizer hash, chat-template hash;
    per request (`for_request`), the hash of its structured-output constraint,
    and room for the tool-schema hash and the adapter's identity."""

    model_revision: str
    tokenizer_hash: str
    chat_template_hash: str
    structured_output_hash: str | None = None  # StructuredOutput.hash
    tool_schema_hash: str | None = None  # sha256 of the request's tool definitions
    adapter_id: str | None = None  # e.g. a LoRA adapter's file hash

    @property
    def fingerprint(self) -> str:
        """Short id for OpenAI's `system_fingerprint`; a request's own
        versions (schema, tools, adapter) are appended when it has them."""
        base = f"fp_{self.model_revision[:8]}_{self.tokenizer_hash[:6]}_{self.chat_template_hash[:6]}"
        extras = (self.adapter_id, self.structured_output_hash, self.tool_schema_hash)
        return "_".join([base, *(e[:6] for e in extras if e)])

    def for_request(self, params: SamplingParams, tool_schema_hash: str | None = None,
                    adapter_id: str | None = None) -> ResolvedVersions:
        """These versions plus what the request itself brings: its schema hash,
        when it has tools their hash, and the LoRA adapter it runs under."""
        constraint = params.structured_output
        return ResolvedVersions(self.model_revision, self.tokenizer_hash, self.chat_template_hash,
                                structured_output_hash=None if constraint is None else constraint.hash,
                                tool_schema_hash=tool_schema_hash or self.tool_schema_hash,
                                adapter_id=adapter_id or self.adapter_id)


@dataclass
class RequestTimestamps:
    """Raw, named timestamps (seconds on the engine's clock). Latencies are
    derived from these by `kvserve.latency.derive_latency`, nowhere else."""

    arrival: float
    queued: float | None = None  # entered the scheduler's waiting queue
    scheduled: float | None = None  # first scheduled (end of queue time)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """One generation request as the engine sees it.

    Progress is one counter: `num_computed_tokens` counts the tokens of
    `all_token_ids` whose KV is in the cache. A request needs a forward pass
    over `num_tokens - num_computed_tokens` tokens; when that pass reaches the
    last token, the model's output there is sampled. Prefill, chunked prefill,
    decode and recompute after preemption are all this one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # Any of these ends the request (unless ignore_eos): models ship several,
    # e.g. Llama 3 Instruct's <|eot_id|> beside <|end_of_text|>.
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower = more urgent
    tenant: str = "default"
    deadline: float | None = None  # absolute time on the engine clock
    # Isolation key for prefix caching: model revision, adapter, tenant key.
    # Requests share cached KV only when their namespaces are equal.
    cache_namespace: str = ""
    # The LoRA adapter it runs under (its file hash, model/lora.py); None: the base model.
    adapter_id: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    # Chained hashes of the full blocks of all_token_ids, filled lazily by the
    # KV cache manager; kept across preemption because tokens never change.
    block_hashes: list[bytes] = field(default_factory=list)
    # Draft tokens proposed to follow all_token_ids (speculative decoding):
    # the next step may verify them beside the last token. Never part of
    # the request's tokens until accepted; cleared when consumed or preempted.
    spec_token_ids: list[int] = field(default_factory=list)
    timestamps: RequestTimestamps = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidParameter("prompt", "must contain at least one token")
        self.timestamps = RequestTimestamps(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens this request can ever hold in the KV cache."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    def token_id(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.status)


class RequestFactory:
    """The one way a `Request` is built: one engine's facts applied by the
    same rules whoever builds it (the server, the simulator, the offline
    `LLM`, the warm-up).

    - EOS: the model's EOS token ids (`eos_token_ids`).
    - Prefix-cache namespace: `{namespace}:{tenant}`, where `namespace`
      names the weights (their revision): KV computed by other weights is
      never reused, and tenants never share cached KV (a prefix hit would
      reveal another tenant's prompt through timing). A request under a
      LoRA adapter gets `{namespace}+{adapter_id}:{tenant}`: the adapter
      changes every layer's K/V, so its blocks are never shared with the
      base model's or another adapter's.
    - Arrival: the given time, else now on the injected clock.
    - Id: the given one, else `{id_prefix}{n}` counting from 0.

    The prompt list is kept, not copied: a request never changes its prompt.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], namespace: str, clock: Callable[[], float],
                 id_prefix: str = "req-") -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.namespace = namespace
        self.clock = clock
        self.id_prefix = id_prefix
        self._num_built = 0
        # per (tenant, adapter): built once, not per request
        self._namespaces: dict[tuple[str, str | None], str] = {}

    def cache_namespace(self, tenant: str, adapter_id: str | None = None) -> str:
        key = (tenant, adapter_id)
        namespace = self._namespaces.get(key)
        if namespace is None:
            weights = self.namespace if adapter_id is None else f"{self.namespace}+{adapter_id}"
            namespace = self._namespaces[key] = f"{weights}:{tenant}"
        return namespace

    def build(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
              request_id: str | None = None, arrival_time: float | None = None, priority: int = 0,
              tenant: str = "default", deadline: float | None = None,
              adapter_id: str | None = None) -> Request:
        if request_id is None:
            request_id = f"{self.id_prefix}{self._num_built}"
        self._num_built += 1
        prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        return Request(request_id, prompt, sampling_params,
                       arrival_time=self.clock() if arrival_time is None else arrival_time,
                       eos_token_ids=self.eos_token_ids, priority=priority, tenant=tenant, deadline=deadline,
                       cache_namespace=self.cache_namespace(tenant, adapter_id), adapter_id=adapter_id)
