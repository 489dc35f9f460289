"""The request contract shared by every layer: sampling parameters, the request
record with its single progress counter, and the ordered status enum.

Pure Python: no torch, no clock (timestamps are stamped by callers from an
injected clock).
"""

from __future__ import annotations

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


# A plain Python class also when kvserve is compiled (kvserve/compiled): it
# takes whatever a caller passes (a list for a tuple, a string for an int)
# and names the wrong field, where a compiled class would refuse the type
# before its own checks run.
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

    def __post_init__(self) -> None:
        # The fields as given, untyped: only the checks below make them what
        # the annotations say (compiled code would check a typed read first).
        given: Any = SimpleNamespace(**vars(self))
        # Accept any iterable (lists from JSON, a bare string) and store tuples
        # so the params stay hashable and immutable.
        given.stop = (given.stop,) if isinstance(given.stop, str) else tuple(given.stop or ())
        given.stop_token_ids = tuple(given.stop_token_ids or ())
        self._validate(given)
        object.__setattr__(self, "stop", given.stop)
        object.__setattr__(self, "stop_token_ids", given.stop_token_ids)

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


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
    the weights file or folder manifest), tokenizer hash, chat-template hash."""

    model_revision: str
    tokenizer_hash: str
    chat_template_hash: str

    @property
    def fingerprint(self) -> str:
        """Short id for OpenAI's `system_fingerprint`."""
        return f"fp_{self.model_revision[:8]}_{self.tokenizer_hash[:6]}_{self.chat_template_hash[:6]}"


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

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    # Chained hashes of the full blocks of all_token_ids, filled lazily by the
    # KV cache manager; kept across preemption because tokens never change.
    block_hashes: list[bytes] = field(default_factory=list)
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
