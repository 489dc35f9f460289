"""The OpenAI wire format: request models (pydantic, only at this boundary),
their translation to SamplingParams, and the response / SSE chunk shapes.

Unknown fields are accepted and ignored, as vLLM does, so clients that send
newer fields keep working; fields we cannot honour (echo, best_of > 1,
suffix) are refused with 400 rather than silently ignored.

Structured outputs come in three spellings that map onto one
`StructuredOutput`: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object})
and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`; a request names at most one constraint.

Known fields are typed as strictly as OpenAI's API types them: an integer
field takes a JSON integer only (not "64", true or 64.0), a boolean field a
JSON boolean only, a number field an integer or a finite float (not a
string, NaN or Infinity). Every string field must be text that UTF-8 can
encode: JSON may spell a lone UTF-16 surrogate (`"\\udfff"`), which no
tokenizer, log line or response can carry, so it is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from kvserve.admission.decision import Reason
from kvserve.contract import InvalidParameter, SamplingParams, StructuredOutput

# Priority classes: lower = more urgent; OpenAI's "flex" tier is a deferred
# lane one class below the request's own priority.
FLEX_PRIORITY_OFFSET = 1
MAX_TEMPERATURE = 100.0
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable_text(value: str) -> str:
    match = _LONE_SURROGATE.search(value)
    if match is not None:
        raise PydanticCustomError(
            "invalid_text", "must be valid Unicode text; it holds a lone UTF-16 surrogate "
                            "({code}) at character {position}",
            {"code": f"U+{ord(match.group()):04X}", "position": match.start()})
    return value


def _encodable_json(value: Any) -> Any:
    """Every key and string inside a free-form JSON value (a schema, a
    tool's parameters) must be encodable text too: they are hashed into the
    request's versions and compiled into grammars."""
    if isinstance(value, str):
        _encodable_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _encodable_text(key)
            _encodable_json(item)
    elif isinstance(value, list):
        for item in value:
            _encodable_json(item)
    return value


# A string field: text that UTF-8 can encode.
Text = Annotated[str, AfterValidator(_encodable_text)]
# A free-form JSON object field whose every string UTF-8 can encode.
JSONObject = Annotated[dict[str, Any], AfterValidator(_encodable_json)]


class _WireModel(BaseModel):
    # strict: no coercion ("64" -> 64, 1 -> True); ints are still accepted
    # for float fields, as OpenAI accepts them.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_WireModel):
    include_usage: bool | None = False


class JSONSchemaFormat(_WireModel):
    """response_format.json_schema: OpenAI's named schema."""

    name: Text | None = None
    description: Text | None = None
    # "schema" is the wire name; pydantic's BaseModel has a `schema` method.
    json_schema: JSONObject | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_WireModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: JSONObject | bool | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class _SamplingFields(_WireModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    max_tokens: int | None = Field(default=None, description="Most tokens to generate.")
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    response_format: ResponseFormat | None = None
    user: Text | None = None
    service_tier: Text | None = None
    # vLLM extensions that benchmark clients send.
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    repetition_penalty: float | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JSONObject | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: Text | None = None


class TextPart(_WireModel):
    type: Text
    text: Text | None = None


class FunctionCall(_WireModel):
    name: Text
    arguments: Text


class ToolCall(_WireModel):
    """A call the assistant made earlier in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_WireModel):
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None


class FunctionDefinition(_WireModel):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class Tool(_WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_WireModel):
    name: Text


class NamedToolChoice(_WireModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def requested_max_tokens(body: _SamplingFields) -> int | None:
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def refuse_unsupported(body: _SamplingFields, max_n: int) -> None:
    """400 for fields we would otherwise silently not honour."""
    _require(body.n is None or 1 <= body.n <= max_n, "n", f"must be in [1, {max_n}] on this server")
    _require(body.service_tier in (None, "auto", "default", "flex"), "service_tier",
             "must be one of 'auto', 'default', 'flex'")
    if isinstance(body, CompletionRequest):
        _require(not body.echo, "echo", "is not supported")
        _require(body.best_of in (None, 1, body.n or 1), "best_of",
                 "is supported only equal to n (each choice is returned)")
        _require(body.suffix in (None, ""), "suffix", "is not supported")


class Constraint(NamedTuple):
    """A request's structured-output constraint and the field it came from
    (the `param` of a 400 when it cannot be enforced)."""

    output: StructuredOutput
    param: str


def structured_output_of(body: _SamplingFields) -> Constraint | None:
    """The one constraint the body asks for in any of its spellings;
    InvalidParameter when it names more than one or a malformed one."""
    found = [c for c in (_from_response_format(body.response_format), _from_structured_outputs(body),
                         *_from_guided_fields(body)) if c is not None]
    _require(len(found) <= 1, found[-1].param if found else "structured_outputs",
             "only one structured-output constraint may be given (found: "
             f"{', '.join(c.param for c in found)})")
    return found[0] if found else None


def _constraint(kind: str, spec: Any, param: str) -> Constraint:
    try:
        return Constraint(StructuredOutput(kind, spec), param)
    except InvalidParameter as exc:
        raise InvalidParameter(param, str(exc).removeprefix("structured_output ")) from None


def _from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _constraint("json_object", None, "response_format")
    _require(fmt.json_schema is not None and fmt.json_schema.json_schema is not None,
             "response_format.json_schema.schema", "is required for type 'json_schema'")
    return _constraint("json", fmt.json_schema.json_schema, "response_format.json_schema.schema")


def _from_structured_outputs(body: _SamplingFields) -> Constraint | None:
    so = body.structured_outputs
    if so is None:
        return None
    given = [(kind, spec) for kind, spec in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                             ("grammar", so.grammar))
             if spec is not None]
    if so.json_object:
        given.append(("json_object", None))
    _require(len(given) == 1, "structured_outputs",
             "must hold exactly one of json, regex, choice, grammar, json_object")
    kind, spec = given[0]
    return _constraint(kind, spec, f"structured_outputs.{kind}")


def _from_guided_fields(body: _SamplingFields) -> list[Constraint | None]:
    fields = (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
              ("grammar", "guided_grammar"))
    return [_constraint(kind, getattr(body, name), name) for kind, name in fields
            if getattr(body, name) is not None]


def sampling_params(body: _SamplingFields, max_tokens: int, vocab_size: int,
                    structured_output: StructuredOutput | None = None) -> SamplingParams:
    """SamplingParams from the body; InvalidParameter names a bad field."""
    temperature = 1.0 if body.temperature is None else body.temperature
    _require(math.isfinite(temperature) and temperature <= MAX_TEMPERATURE, "temperature",
             f"must be a finite number in [0, {MAX_TEMPERATURE:g}]")
    top_k = 0 if body.top_k in (None, -1) else body.top_k  # vLLM: -1 disables top-k
    _require(top_k >= 0, "top_k", "must be >= 0, or -1 to disable")
    stop_token_ids = tuple(body.stop_token_ids or ())
    _require(all(0 <= t < vocab_size for t in stop_token_ids), "stop_token_ids",
             f"must be token ids in [0, {vocab_size})")
    _require(body.seed is None or -2**63 <= body.seed < 2**64, "seed", "must fit in 64 bits")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=min(top_k, vocab_size), seed=body.seed,
        stop=body.stop or (), stop_token_ids=stop_token_ids,
        ignore_eos=bool(body.ignore_eos), min_tokens=body.min_tokens or 0,
        logprobs=_num_logprobs(body),
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias, vocab_size), structured_output=structured_output)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; keys must name token ids of the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        _require(key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size))
                 and int(key) < vocab_size, "logit_bias",
                 f"keys must be token ids in [0, {vocab_size}), got {key!r}")
        pairs.append((int(key), value))
    return tuple(pairs)


def _num_logprobs(body: _SamplingFields) -> int | None:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if not body.logprobs:
        _require(body.top_logprobs in (None, 0), "top_logprobs", "requires logprobs=true")
        return None
    return body.top_logprobs or 0


def priority_of(body: _SamplingFields, tenant_priority: int | None) -> int:
    """Body priority (lower = more urgent), never more urgent than the
    tenant's floor; service_tier "flex" defers it one class."""
    priority = body.priority if body.priority is not None else (tenant_priority or 0)
    if tenant_priority is not None:
        priority = max(priority, tenant_priority)
    if body.service_tier == "flex":
        priority += FLEX_PRIORITY_OFFSET
    return priority


def chat_messages(body: ChatCompletionRequest | TokenizeChatRequest) -> list[dict]:
    """Messages as plain dicts for the chat template; text parts joined."""
    out = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            _require(all(p.type == "text" and p.text is not None for p in content),
                     f"messages[{i}].content", "only text parts are supported")
            content = "".join(p.text for p in content)
        entry: dict = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)


# ---- responses -------------------------------------------------------------

def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


# Refusals that are the client's own limit (not the server's load).
RATE_LIMITED_REASONS = frozenset({Reason.TENANT_QUOTA})


def refusal_type(status: int, reason: str | None) -> str:
    """The OpenAI error `type` of an admission refusal (the server's and the
    gateway's): 400 is the request's own fault, a tenant's quota a rate
    limit, anything else the service's load."""
    if status == 400:
        return "invalid_request_error"
    return "rate_limited" if reason in RATE_LIMITED_REASONS else "overloaded"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


class ResponseShape:
    """Builds the JSON of one request's response or stream chunks."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str,
                 fingerprint: str, token_text) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.fingerprint = fingerprint
        self.created = int(time.time())
        self._token_text = token_text  # token id -> its text, for logprobs

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: list | None,
               tool_calls: list[dict] | None = None) -> dict:
        """One choice of a whole response; a chat message's `content` is None
        when it holds only tool calls."""
        if self.kind == "completion":
            return {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                    "finish_reason": finish_reason}
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason}

    def body(self, choices: list[dict], usage_: dict) -> dict:
        body = self._envelope("text_completion" if self.kind == "completion" else "chat.completion", choices)
        body["usage"] = usage_
        return body

    def full(self, text: str, finish_reason: str | None, logprobs: list | None, usage_: dict) -> dict:
        return self.body([self.choice(0, text, finish_reason, logprobs)], usage_)

    def chunk_choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: list | None,
                     first: bool = False, text_offset: int = 0, tool_calls: list[dict] | None = None) -> dict:
        """One choice of an SSE event; `text` may hold several tokens (then
        `logprobs` has one entry per token). text_offset: where this chunk's
        tokens start in the completion (completions' logprobs.text_offset);
        tool_calls: tool-call deltas (chat)."""
        if self.kind == "completion":
            return {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs, text_offset),
                    "finish_reason": finish_reason}
        delta: dict = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": None if tool_calls and not text else (text or "")}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason}

    def chunks(self, choices: list[dict], with_usage_field: bool = False) -> str:
        """One SSE event of these chunk choices."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, choices)
        if with_usage_field:
            body["usage"] = None
        return sse(body)

    def chunk(self, text: str | None, finish_reason: str | None, logprobs: list | None,
              first: bool = False, with_usage_field: bool = False, text_offset: int = 0) -> str:
        """One SSE event of a single-choice response (see chunk_choice)."""
        return self.chunks([self.chunk_choice(0, text, finish_reason, logprobs, first, text_offset)],
                           with_usage_field)

    def usage_chunk(self, usage_: dict) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage_
        return sse(body)

    def text_length(self, items: list | None) -> int:
        """Characters of the tokens of these TokenLogprob items (0 for None)."""
        return sum(len(self._token_text(lp.token_id)) for lp in items) if items else 0

    def logprobs(self, items: list | None, text_offset: int = 0) -> dict | None:
        """OpenAI logprobs of the given TokenLogprob items, None when not asked."""
        if items is None:
            return None
        text = self._token_text
        if self.kind == "chat":
            return {"content": [{
                "token": text(lp.token_id), "logprob": lp.logprob,
                "bytes": list(text(lp.token_id).encode()),
                "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())}
                                 for t, v in lp.top]} for lp in items]}
        return {"tokens": [text(lp.token_id) for lp in items],
                "token_logprobs": [lp.logprob for lp in items],
                "top_logprobs": [{text(t): v for t, v in lp.top} for lp in items],
                "text_offset": _offsets([text(lp.token_id) for lp in items], text_offset)}


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    out, pos = [], start
    for tok in tokens:
        out.append(pos)
        pos += len(tok)
    return out


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---- /tokenize and /detokenize (vLLM's) ----------------------------------------

class TokenizeCompletionRequest(_WireModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_WireModel):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class DetokenizeRequest(_WireModel):
    model: Text | None = None
    tokens: list[int]


# The retry headers: the OpenAI SDK's retry count, or kvserve's own flag.
RETRY_HEADERS = ("x-stainless-retry-count", "x-kvserve-retry")


def is_retry(headers) -> bool:
    """Whether the client says this request is a retry (read the same way by
    the server and the gateway, whose retry budgets count these)."""
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


class LoadLoraAdapterRequest(_WireModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_WireModel):
    """vLLM's POST /v1/unload_lora_adapter body (its `lora_int_id` is accepted and ignored)."""

    lora_name: Text = Field(min_length=1, max_length=256)
