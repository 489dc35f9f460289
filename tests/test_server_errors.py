"""Bad input gets the right 4xx in the OpenAI error shape; fuzzing the
OpenAPI schema never produces a 5xx."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, settings

from kvserve.admission.tenants import TenantDirectory
from kvserve.config import ServerConfig
from kvserve.server.routes import router
from tests.server_helpers import MODEL_NAME, live_server, tiny_core

MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server():
    core = tiny_core(num_blocks=64, max_model_len=MAX_MODEL_LEN)
    with live_server(core, max_body_bytes=MAX_BODY, default_max_tokens=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize("body,param", [
    (completion(max_tokens=-5), "max_tokens"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens="many"), "max_tokens"),
    (completion(max_tokens=10**12), "max_tokens"),  # beyond the context
    (completion(prompt=""), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[1, 2, 10**6]), "prompt"),  # token id outside the vocabulary
    (completion(prompt="x" * (MAX_MODEL_LEN + 10)), "prompt"),  # too long for the context
    (completion(prompt=["a", "b"]), "prompt"),  # batched prompts
    (completion(temperature=-1), "temperature"),
    (completion(temperature="hot"), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=-3), "top_k"),
    (completion(n=ServerConfig().max_n + 1), "n"),
    (completion(n=0), "n"),
    (completion(logit_bias={"-1": 2}), "logit_bias"),
    (completion(best_of=3), "best_of"),
    (completion(stop=["x"] * 100), "stop"),
    (completion(logprobs=99), "logprobs"),
    (completion(stream="yes please"), "stream"),
    (completion(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
    (completion(min_tokens=50, max_tokens=4), "min_tokens"),
    (completion(service_tier="gold"), "service_tier"),
    (completion(echo=True), "echo"),
    ({"model": MODEL_NAME, "max_tokens": 4}, "prompt"),  # missing prompt
    # Types as strict as OpenAI's: no strings for numbers, no numbers for booleans.
    (completion(max_tokens="64"), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(max_tokens=64.5), "max_tokens"),
    (completion(stream="yes"), "stream"),
    (completion(stream=1), "stream"),
    (completion(temperature="0.5"), "temperature"),
    (completion(seed="7"), "seed"),
    (completion(prompt=[True, False]), "prompt[0]"),
    (completion(prompt=[[1, True]]), "prompt[0][1]"),
    (completion(stop=5), "stop"),
    (completion(stream_options={"include_usage": "yes"}, stream=True), "stream_options.include_usage"),
])
def test_bad_completion_fields_are_400_naming_the_field(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param=param)


def test_ints_are_numbers_as_openai_accepts(http):
    response = http.post("/v1/completions", json=completion(temperature=0, top_p=1))
    assert response.status_code == 200, response.text


# JSON that json.dumps will not write: lone surrogate escapes, NaN, Infinity.
_MESSAGE = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", r'{"prompt": "hi \udfff", "max_tokens": 4}', "prompt"),
    ("/v1/completions", r'{"prompt": ["\ud800"], "max_tokens": 4}', "prompt[0]"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 4, "stop": ["ok", "\udc00x"]}', "stop[1]"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 4, "stop": "\udfff"}', "stop"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 4, "user": "\udfff"}', "user"),
    ("/v1/completions", r'{"prompt": "hi", "model": "\udfff", "max_tokens": 4}', "model"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', "temperature"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 4, "top_p": Infinity}', "top_p"),
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 1e999}', "max_tokens"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \udfff"}], "max_tokens": 4}',
     "messages[0].content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "us\udfffer", "content": "hi"}], "max_tokens": 4}',
     "messages[0].role"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}',
     "messages[0].name"),
    ("/v1/chat/completions", '{' + _MESSAGE + r', "logit_bias": {"\udfff": 1}}', "logit_bias"),
    # Free-form JSON (schemas, tool parameters): keys and strings at any depth.
    ("/v1/completions", r'{"prompt": "hi", "max_tokens": 2, "guided_json": {"\ud800": null}}', "guided_json"),
    ("/v1/completions", r'{"prompt": "hi", "structured_outputs": {"json": {"enum": [["\udfff"]]}}}',
     "structured_outputs.json"),
    ("/v1/chat/completions", '{' + _MESSAGE + r', "response_format": {"type": "json_schema", '
     r'"json_schema": {"name": "x", "schema": {"type": "string", "pattern": "\udc00"}}}}',
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", '{' + _MESSAGE + r', "tools": [{"type": "function", "function": '
     r'{"name": "f", "parameters": {"properties": {"\udfff": {}}}}}]}', "tools[0].function.parameters"),
])
def test_unencodable_text_and_non_finite_numbers_are_400_naming_the_field(http, path, raw, param):
    response = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_error(response, 400, param=param)
    assert http.get("/health").status_code == 200  # and the connection still serves


@pytest.mark.parametrize("body", [
    {"model": MODEL_NAME, "messages": [], "max_tokens": 4},
    {"model": MODEL_NAME, "messages": "hi", "max_tokens": 4},
    {"model": MODEL_NAME, "messages": [{"content": "no role"}], "max_tokens": 4},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}], "max_tokens": 4},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
])
def test_bad_chat_requests_are_400(http, body):
    assert_error(http.post("/v1/chat/completions", json=body), 400)


def test_malformed_json_and_non_object_bodies_are_400(http):
    headers = {"content-type": "application/json"}
    assert_error(http.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400)
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    assert_error(http.post("/v1/completions", content=b"not json"), 400)
    assert_error(http.post("/v1/chat/completions", content=b"", headers=headers), 400)


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json=completion(model="gpt-9")), 404, param="model",
                 code="model_not_found")


def test_oversized_body_is_413(http):
    body = json.dumps(completion(prompt="x" * (MAX_BODY + 10))).encode()
    assert_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b" " * (MAX_BODY // 2)
        yield json.dumps(completion()).encode()

    assert_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413)


def test_unknown_route_and_method_keep_the_error_shape(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_bad_deadline_header_is_400(http):
    assert_error(http.post("/v1/completions", json=completion(), headers={"x-kvserve-deadline-s": "soon"}), 400)


# ---- x-request-id and the version headers on every response -------------------

VERSION_HEADERS = ("x-kvserve-model-revision", "x-kvserve-tokenizer-hash", "x-kvserve-chat-template-hash")
JSON = {"content-type": "application/json"}


def assert_traced(response: httpx.Response, request_id: str | None = None) -> str:
    for name in VERSION_HEADERS:
        assert response.headers.get(name), (name, response.status_code, dict(response.headers))
    got = response.headers.get("x-request-id")
    assert got, (response.status_code, dict(response.headers))
    if request_id is not None:
        assert got == request_id
    return got


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", json.dumps(completion()), 200),
    ("POST", "/v1/completions", json.dumps(completion(max_tokens=-5)), 400),
    ("POST", "/v1/completions", '{"prompt": "x",', 400),  # not JSON
    ("POST", "/v1/completions", json.dumps(completion(model="gpt-9")), 404),
    ("GET", "/v1/nothing", None, 404),  # the router's own 404
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", "x" * (MAX_BODY + 1), 413),
    ("GET", "/metrics", None, 200),
])
def test_every_response_carries_request_id_and_versions(http, method, path, body, status):
    content = None if body is None else body.encode()
    response = http.request(method, path, content=content, headers=JSON)
    assert response.status_code == status, response.text
    fresh = assert_traced(response)
    again = http.request(method, path, content=content, headers=JSON)
    assert assert_traced(again) != fresh  # one id per response
    echoed = http.request(method, path, content=content, headers={**JSON, "x-request-id": "client-7:A_b.c/d+e="})
    assert_traced(echoed, "client-7:A_b.c/d+e=")


@pytest.mark.parametrize("bad_id", [b"", b"x" * 129, b"has space", b'quo"te', b"caf\xc3\xa9", b"semi;colon"])
def test_a_malformed_client_request_id_is_replaced_by_a_fresh_one(http, bad_id):
    response = http.post("/v1/completions", json=completion(max_tokens=-5), headers={"x-request-id": bad_id})
    got = assert_traced(response)
    assert got.encode() != bad_id and re.fullmatch(r"[A-Za-z0-9._:/+=-]{1,128}", got)


def test_an_exception_in_a_route_is_a_500_with_headers_on_a_connection_that_still_works(server, http):
    serving = server.serving
    create = serving.create

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    serving.create = broken
    try:
        response = http.post("/v1/completions", json=completion(), headers={"x-request-id": "mine"})
    finally:
        serving.create = create
    assert_error(response, 500)
    assert_traced(response, "mine")
    after = http.get("/health")
    assert after.status_code == 200 and local_port(after) == local_port(response)  # same connection


# ---- authentication first --------------------------------------------------------

@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"sk-good": {"tenant": "alice", "max_concurrent": 4, "tokens_per_minute": 100}}))
    return keys


def test_wrong_or_missing_key_is_401_and_right_key_works(keys_file):
    with live_server(tiny_core(), tenants=TenantDirectory.from_file(keys_file)) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            assert_error(http.post("/v1/completions", json=completion()), 401, code="invalid_api_key")
            assert_error(http.post("/v1/completions", json=completion(),
                                   headers={"authorization": "Bearer sk-bad"}), 401)
            assert_error(http.get("/v1/models", headers={"authorization": "Bearer sk-bad"}), 401)
            assert_error(http.get("/v1/nothing"), 401)  # unknown routes are not open
            ok = http.post("/v1/completions", json=completion(), headers={"authorization": "Bearer sk-good"})
            assert ok.status_code == 200, ok.text
            assert_traced(ok)
            # Over the tenant's 100 tokens a minute: 429, with the headers too.
            over = http.post("/v1/completions", json=completion(max_tokens=90),
                             headers={"authorization": "Bearer sk-good", "x-request-id": "q-1"})
            assert_error(over, 429, code="tenant_quota")
            assert over.headers["retry-after"] and assert_traced(over, "q-1")


@pytest.mark.parametrize("body", [
    b'{"prompt": "x",',  # not JSON
    b'{"prompt": "hi \\udfff", "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": "lots"}',
    b"x" * (MAX_BODY + 1),  # over the body limit
])
def test_without_a_key_the_body_is_never_read(keys_file, body):
    # With keys configured, a bad body and no key is 401 (not a 400 or 413
    # that would tell an anonymous caller about the body), and the
    # connection serves the next request.
    with live_server(tiny_core(), tenants=TenantDirectory.from_file(keys_file), max_body_bytes=MAX_BODY) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            response = http.post("/v1/completions", content=body, headers=JSON)
            assert_error(response, 401, code="invalid_api_key")
            assert_traced(response)
            ok = http.post("/v1/completions", json=completion(), headers={"authorization": "Bearer sk-good"})
            assert ok.status_code == 200 and local_port(ok) == local_port(response)


@pytest.mark.parametrize("guarded", [False, True])
def test_metrics_and_docs_need_a_key_only_when_asked(keys_file, guarded):
    with live_server(tiny_core(), tenants=TenantDirectory.from_file(keys_file),
                     auth_metrics_and_docs=guarded) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            for path in ("/metrics", "/openapi.json", "/docs"):
                anonymous = http.get(path)
                assert anonymous.status_code == (401 if guarded else 200), (path, anonymous.text)
                keyed = http.get(path, headers={"authorization": "Bearer sk-good"})
                assert keyed.status_code == 200, path
            for path in ("/health", "/ready"):  # probes never need one
                assert http.get(path).status_code == 200


def test_strict_mode_requires_max_tokens():
    with live_server(tiny_core(), require_max_tokens=True) as srv:
        body = {"model": MODEL_NAME, "prompt": "hello"}
        assert_error(httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30), 400, param="max_tokens")


def test_keys_file_errors_are_clear(tmp_path):
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"sk": {"tenant": "a", "max_concurrent": 0}}))
    with pytest.raises(ValueError, match="max_concurrent"):
        TenantDirectory.from_file(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        TenantDirectory.from_file(bad)


# ---- fuzzing the OpenAPI schema ----------------------------------------------
# Schemathesis's phases (examples, coverage, fuzzing), each in both modes:
# positive (bodies the schema allows) and negative (bodies it does not),
# sent on one kept-alive connection to the live server. Raw bytes that no
# schema describes are fuzzed in test_server_fuzz.py.

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation.modes import GenerationMode  # noqa: E402


def _schema_app() -> FastAPI:
    app = FastAPI(title="kvserve")
    app.include_router(router)
    return app


schema = schemathesis.openapi.from_dict(_schema_app().openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@pytest.fixture(scope="module")
def kept_alive(server):
    with httpx.Client(base_url=server.base_url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def _send(client: httpx.Client, case) -> httpx.Response:
    kwargs = case.as_transport_kwargs()
    if "json" in kwargs:
        content = json.dumps(kwargs["json"]).encode()
    else:
        content = kwargs.get("data")
    headers = {k: v for k, v in kwargs["headers"].items() if k.lower() != "connection"}
    return client.request(kwargs["method"], case.formatted_path, params=kwargs.get("params"), headers=headers,
                          content=content)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_5xx_or_drop_the_connection(case, kept_alive):
    if case.body is not None and isinstance(case.body, dict) and case.operation.path.startswith("/v1/"):
        # Keep generations tiny so the fuzz stays fast; the fields stay fuzzed otherwise.
        case.body.setdefault("max_tokens", 2)
    response = _send(kept_alive, case)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    assert_traced(response)
    follow_up = kept_alive.get("/health")
    assert follow_up.status_code == 200 and local_port(follow_up) == local_port(response), "connection dropped"
