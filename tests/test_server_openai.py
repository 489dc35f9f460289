"""The official `openai` client against a live kvserve on 127.0.0.1: the API
surface, usage counts, versions, and greedy output equal to the offline LLM."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from kvserve.config import ServerConfig  # noqa: E402
from kvserve.contract import SamplingParams  # noqa: E402
from kvserve.engine.llm import LLM  # noqa: E402
from tests.server_helpers import MODEL_NAME, live_server, tiny_core  # noqa: E402

DEFAULT_MAX_TOKENS = 7


def offline_llm(core) -> LLM:
    """The public LLM API over an already-built engine (the tiny model has
    no file for LLM(model=...) to load)."""
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm.versions = core, core.tokenizer, core.versions
    return llm


@pytest.fixture(scope="module")
def server():
    with live_server(default_max_tokens=DEFAULT_MAX_TOKENS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference():
    return offline_llm(tiny_core())


def test_completion_greedy_equals_offline_generate(client, reference, server):
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt="The cache is", max_tokens=12,
                                                      temperature=0)
    out = raw.parse()
    expected = reference.generate("The cache is", SamplingParams(max_tokens=12))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    versions = server.serving.versions
    assert out.system_fingerprint == versions.fingerprint
    assert raw.headers["x-kvserve-model-revision"] == versions.model_revision
    assert raw.headers["x-kvserve-tokenizer-hash"] == versions.tokenizer_hash
    assert raw.headers["x-kvserve-chat-template-hash"] == versions.chat_template_hash
    assert "x-kvserve-max-tokens" not in raw.headers


def test_streaming_completion_matches_and_reports_usage(client):
    full = client.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_greedy_equals_offline_chat_streaming_and_not(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    expected = reference.chat(messages, SamplingParams(max_tokens=9))[0]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=9,
                                         temperature=0)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 9


def test_token_id_prompt_and_default_max_tokens_is_echoed(client, reference):
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=[5, 17, 99, 3], temperature=0)
    out = raw.parse()
    assert raw.headers["x-kvserve-max-tokens"] == str(DEFAULT_MAX_TOKENS)
    assert out.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert out.usage.prompt_tokens == 4
    expected = reference.generate([[5, 17, 99, 3]], SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))[0]
    assert out.choices[0].text == expected.text


def test_stop_string_ends_the_completion(client):
    full = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].isprintable()
                and text.find(text[i:i + 2]) == i)
    out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.find(stop)]


def test_logprobs_completion_and_chat(client):
    out = client.completions.create(model=MODEL_NAME, prompt="log", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt="seed", max_tokens=8, temperature=1.0, seed=1234)
    a = client.completions.create(**kwargs, extra_body={"top_k": 50})
    b = client.completions.create(**kwargs, extra_body={"top_k": 50})
    assert a.choices[0].text == b.choices[0].text


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_unknown_model_is_404_and_n_above_the_limit_is_400(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=ServerConfig().max_n + 1)
    assert err.value.body["param"] == "n"
