"""Raw bytes at the POST endpoints of a live server: hypothesis builds bodies
with what json.dumps will not write (lone surrogate escapes, NaN, Infinity,
numbers past any range, nesting past the parser's depth), wrong types in
every known field, invalid UTF-8 and odd content types, and sends them as
bytes on one kept-alive connection. No input may get a 5xx, every answer
has the OpenAI error shape (or is a completion) with x-request-id and the
version headers, and the connection keeps serving afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import MODEL_NAME, live_server, tiny_core

MAX_BODY = 64 * 1024
VERSION_HEADERS = ("x-kvserve-model-revision", "x-kvserve-tokenizer-hash", "x-kvserve-chat-template-hash")


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as is (what json.dumps cannot produce)."""

    text: str


def to_json(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    # ensure_ascii spells a lone surrogate as a \\udXXX escape, allow_nan writes NaN / Infinity.
    return json.dumps(value, ensure_ascii=True, allow_nan=True)


hostile_text = st.one_of(
    st.text(max_size=12),  # hypothesis leaves surrogates out of text(): the next one has them
    # Lone surrogates, and a pair (valid: JSON spells U+10FC00 that way).
    st.lists(st.sampled_from(["\ud800", "\udfff", "\udbff\udc00", "a", "\x00", "\u00e9", "\U0001f600",
                              "\n", '"', "\\"]), max_size=8).map("".join),
)
hostile_numbers = st.one_of(
    st.integers(-3, 8),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([Raw("1e999"), Raw("-1e999"), Raw("1" + "0" * 5000), Raw("-0"), Raw("4.0"), Raw("1E2")]),
)
deep = st.integers(1, 3000).map(lambda n: Raw("[" * n + "]" * n))
scalars = st.one_of(st.none(), st.booleans(), hostile_numbers, hostile_text, deep)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(hostile_text, inner, max_size=3)),
                      max_leaves=8)

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
                     "stream_options", "stop", "seed", "logprobs", "echo", "best_of", "suffix", "user",
                     "presence_penalty", "frequency_penalty", "logit_bias", "service_tier", "min_tokens",
                     "ignore_eos", "stop_token_ids", "priority", "repetition_penalty", "response_format",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "best_of", "suffix", "logprobs")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls"]
TOKENIZE_FIELDS = ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs", "tools", "tokens"]


def valid_completion() -> dict:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}


def valid_chat() -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def hostile_text_body(draw):
    """A valid body with hostile text in one of its string fields: where a
    lone surrogate reaches the tokenizer, the template or a response."""
    text = draw(hostile_text)
    if draw(st.booleans()):
        body = valid_completion()
        field = draw(st.sampled_from(["prompt", "prompt-list", "stop", "stop-list", "model", "user", "suffix"]))
        name, _, as_list = field.partition("-")
        body[name] = [text] if as_list else text
        return "/v1/completions", body
    body = valid_chat()
    field = draw(st.sampled_from(["role", "content", "name", "part", "part-type", "stop"]))
    if field == "stop":
        body["stop"] = [text]
    elif field.startswith("part"):
        part = {"type": text, "text": "hi"} if field == "part-type" else {"type": "text", "text": text}
        body["messages"][0]["content"] = [part]
    else:
        body["messages"][0][field] = text
    return "/v1/chat/completions", body


@st.composite
def mutated_body(draw, base, fields):
    """A valid body with one or two fields (or a message's) set to hostile
    values of any type."""
    body = base()
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2)):
        body[name] = draw(values)
    if "messages" in body and isinstance(body["messages"], list) and draw(st.booleans()):
        field = draw(st.sampled_from(["role", "content", "name", "parts"]))
        value = draw(values)
        if field == "parts":
            value = [{"type": "text", "text": value}]
            field = "content"
        body["messages"] = [{"role": "user", "content": "hi", field: value}]
    return body


def _maybe_streamed(draw_stream: bool, path_body: tuple) -> tuple:
    path, body = path_body
    if draw_stream and isinstance(body, dict):
        body = {**body, "stream": True}
    return path, body


json_bodies = st.builds(_maybe_streamed, st.booleans(), st.one_of(
    hostile_text_body(), hostile_text_body(),  # twice: the most likely place for a 500
    mutated_body(valid_completion, COMPLETION_FIELDS).map(lambda b: ("/v1/completions", b)),
    mutated_body(valid_chat, CHAT_FIELDS).map(lambda b: ("/v1/chat/completions", b)),
    st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
              mutated_body(lambda: {"prompt": "hi", "tokens": [1, 2]}, TOKENIZE_FIELDS)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), values),
)).map(lambda pb: (pb[0], to_json(pb[1]).encode()))


@st.composite
def raw_bodies(draw):
    """Bytes that are not UTF-8 JSON: invalid UTF-8 inside a string, a cut-off
    body, or any bytes at all."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    _, body = draw(json_bodies)
    kind = draw(st.sampled_from(["bad-utf8", "truncated", "binary"]))
    if kind == "bad-utf8":
        cut = draw(st.integers(0, len(body)))
        body = body[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"])) + body[cut:]
    elif kind == "truncated":
        body = body[:draw(st.integers(0, max(0, len(body) - 1)))]
    else:
        body = draw(st.binary(max_size=64))
    return path, body


# Mostly JSON (so the body reaches validation), then the odd ones.
content_types = st.one_of(st.just(b"application/json"), st.sampled_from([
    b"application/json; charset=utf-8", b"application/json; charset=latin-1", b"application/vnd.api+json",
    b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
    b"application/\xffjson", None,
]))


@pytest.fixture(scope="module")
def client():
    core = tiny_core(num_blocks=64, max_model_len=256)
    with live_server(core, max_body_bytes=MAX_BODY, default_max_tokens=2) as srv:
        # One connection for the whole run: a response that broke it shows.
        with httpx.Client(base_url=srv.base_url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
            yield http


def _port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _send_and_check(client: httpx.Client, path: str, body: bytes, content_type: bytes | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post(path, content=body, headers=headers)
    where = (path, body[:300], content_type, response.status_code, response.text[:300])
    assert response.status_code < 500, where
    for name in (*VERSION_HEADERS, "x-request-id"):
        assert response.headers.get(name), (name, *where)
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "code", "param"} and error["message"], where
    follow_up = client.get("/health")
    assert follow_up.status_code == 200 and _port(follow_up) == _port(response), ("connection dropped", *where)


@given(request=json_bodies, content_type=content_types)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_json_never_gets_a_5xx_or_drops_the_connection(client, request, content_type):
    _send_and_check(client, *request, content_type)


@given(request=raw_bodies(), content_type=content_types)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_bytes_that_are_not_utf8_json_never_get_a_5xx_or_drop_the_connection(client, request, content_type):
    _send_and_check(client, *request, content_type)
