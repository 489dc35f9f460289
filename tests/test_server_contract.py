"""The whole request contract over HTTP, through the official `openai` client on
a live server: structured outputs (response_format, vLLM's structured_outputs
and guided_*), n > 1, penalties and logit_bias, logprobs on chat, tool calls,
/tokenize and /detokenize, and the versions of what shaped each answer; a
LoRA adapter with structured outputs and n > 1.

The model is a tiny random Llama over SmolLM2's real tokenizer (vocab 49,152)
with a ChatML template, so masks and prompts are the default model's while a
step stays cheap. A random model stops only where a grammar closes, so every
schema here is bounded (maxLength, maxItems).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import httpx  # noqa: E402

from kvserve.config import AdmissionConfig, ServerConfig  # noqa: E402
from kvserve.contract import StructuredOutput  # noqa: E402
from kvserve.server.serving import Serving  # noqa: E402
from tests.server_helpers import LiveServer  # noqa: E402
from tests.test_structured_outputs import SCHEMAS  # noqa: E402
from tests.tiny_models import TINY_DIMS  # noqa: E402

MODEL = "tiny-smollm"
ADAPTER = "tiny-lora"  # a LoRA adapter the server serves beside MODEL
VOCAB = 49152
MAX_N = 4
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12,
                                                               "maximum": 12}}}}}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.model_facts.source import load_tokenizer

    torch.manual_seed(20)
    dims = dict(TINY_DIMS, vocab_size=VOCAB)
    model = LlamaForCausalLM(LlamaConfig(**dims, eos_token_id=2, bos_token_id=None, pad_token_id=None)).eval()
    folder = tmp_path_factory.mktemp("tiny-contract")
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer().save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module")
def adapter_folder(tiny_folder, tmp_path_factory):
    """A PEFT LoRA adapter with random weights on the tiny model."""
    from transformers import LlamaForCausalLM

    from tests.tiny_models import tiny_peft_adapter

    folder = tmp_path_factory.mktemp("tiny-contract-lora")
    tiny_peft_adapter(LlamaForCausalLM.from_pretrained(tiny_folder).eval(), folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def server(tiny_folder, adapter_folder):
    from kvserve import LLM

    llm = LLM(model=str(tiny_folder), kv_cache_memory="32MiB", device="cpu", max_model_len=512, enable_lora=True,
              max_loras=2)
    llm.load_lora_adapter(ADAPTER, adapter_folder)
    # Generous waits: the tests measure answers, not admission (a loaded machine is slow).
    admission = AdmissionConfig(max_queue_wait_s=60.0, queue_timeout_s=120.0, tpot_slo_s=10.0)
    serving = Serving(llm.engine, admission, ServerConfig(served_model_name=MODEL, max_n=MAX_N,
                                                                  warm_up=False), versions=llm.versions)
    with LiveServer(serving) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, content: str = "hi", **fields):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          **fields)


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


# ---- structured outputs ------------------------------------------------------

def test_json_schema_answers_validate_when_stopped(client):
    stopped = 0
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for seed in (1, 2):
            out = chat(client, f"give me {name}", response_format=schema_format(name, schema),
                       max_tokens=160, temperature=1.0, seed=seed + 10 * i)
            choice = out.choices[0]
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), schema)
                stopped += 1
    assert stopped >= len(SCHEMAS)  # most answers close their JSON within max_tokens


def test_streamed_json_schema_answers_validate_and_equal_the_whole_answer(client):
    schema = SCHEMAS["nested"]
    fields = dict(response_format=schema_format("nested", schema), max_tokens=160, temperature=1.0, seed=5)
    whole = chat(client, "stream it", **fields).choices[0]
    chunks = list(chat(client, "stream it", stream=True, **fields))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        == [whole.finish_reason]
    if whole.finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)


def test_completions_take_response_format_and_the_vllm_spellings(client):
    out = client.completions.create(model=MODEL, prompt="json:", max_tokens=160, temperature=1.0, seed=3,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    regex = client.completions.create(model=MODEL, prompt="id:", max_tokens=20, temperature=1.0, seed=4,
                                      extra_body={"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]{2}"}})
    assert regex.choices[0].finish_reason == "stop"
    import re
    assert re.fullmatch("[a-c]{2,4}-[0-9]{2}", regex.choices[0].text)
    for body in ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                 {"guided_choice": ["yes", "no", "maybe"]}):
        pick = chat(client, "choose", max_tokens=10, temperature=1.0, seed=6, extra_body=body)
        assert pick.choices[0].message.content in {"yes", "no", "maybe"}
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    expr = chat(client, "expr", max_tokens=40, temperature=1.0, seed=7,
                extra_body={"guided_grammar": grammar})
    if expr.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", expr.choices[0].message.content)


def test_the_mask_leaves_unconstrained_neighbours_greedy_tokens_unchanged(client):
    def plain():
        return client.completions.create(model=MODEL, prompt="plain neighbour", max_tokens=24,
                                         temperature=0).choices[0].text

    alone = plain()
    results: dict[str, str] = {}

    def constrained(i: int) -> None:
        results[f"json{i}"] = chat(client, f"json {i}", response_format=schema_format("flat", SCHEMAS["flat"]),
                                   max_tokens=60, temperature=1.0, seed=i).choices[0].finish_reason

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    beside = plain()
    for t in threads:
        t.join()
    assert beside == alone
    assert len(results) == 4


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": schema_format("bad", {"type": "strnig"})}, "response_format.json_schema.schema",
     "strnig"),
    ({"response_format": schema_format("bad", {"type": "array", "uniqueItems": True})},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "required"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "structured_output"),
])
def test_constraints_that_cannot_be_enforced_are_400_naming_the_field(server, body, param, words):
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": "x"}], **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert set(error) == {"message", "type", "code", "param"}


# ---- n, penalties, logit_bias, logprobs ----------------------------------------

def test_n_choices_are_indexed_with_summed_usage_and_share_the_prompt_blocks(client, server):
    stats = server.serving.core.stats
    hits_before = stats().prefix_cache_hits
    prompt = "a prompt long enough to fill a few whole KV blocks of sixteen tokens each, " * 2
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(6 for _ in out.choices)
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    full_blocks = (out.usage.prompt_tokens - 1) // 16
    assert full_blocks >= 2
    # choices 1 and 2 found choice 0's prompt blocks cached (the one-token request after them too)
    assert stats().prefix_cache_hits - hits_before >= 3 * full_blocks * 16
    assert len({c.text for c in out.choices}) > 1  # seed + i: the choices differ


def test_seeded_n_is_reproducible_and_streams_with_per_choice_indices(client):
    fields = dict(model=MODEL, messages=[{"role": "user", "content": "three ways"}], n=3, max_tokens=8,
                  temperature=1.0, seed=42)
    first = client.chat.completions.create(**fields)
    again = client.chat.completions.create(**fields)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **fields):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == [c.message.content for c in first.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == first.usage.completion_tokens == 24


def test_n_above_the_server_limit_is_400(server):
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": MAX_N + 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def token_id(server, text: str) -> int:
    ids = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def test_logit_bias_bans_and_forces_tokens(client, server):
    free = client.completions.create(model=MODEL, prompt="ban", max_tokens=12, temperature=0,
                                     logprobs=1)
    greedy_ids = [token_id(server, t) for t in free.choices[0].logprobs.tokens[:1]]
    banned = {str(greedy_ids[0]): -100}
    for seed in range(6):
        out = client.completions.create(model=MODEL, prompt="ban", max_tokens=12, temperature=1.0, seed=seed,
                                        logprobs=0, logit_bias=banned)
        assert free.choices[0].logprobs.tokens[0] not in out.choices[0].logprobs.tokens
    forced = token_id(server, " cache")
    out = client.completions.create(model=MODEL, prompt="force", max_tokens=5, temperature=1.0, seed=1,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == " cache" * 5


def test_penalties_change_the_greedy_answer(client):
    def greedy(**fields):
        return client.completions.create(model=MODEL, prompt="repeat repeat repeat", max_tokens=40,
                                         temperature=0, **fields).choices[0].text

    plain = greedy()
    assert greedy(frequency_penalty=2.0) != plain
    assert greedy(presence_penalty=2.0) != plain
    assert greedy(extra_body={"repetition_penalty": 3.0}) != plain
    assert greedy(frequency_penalty=0.0) == plain


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ({"logit_bias": {"seven": 5}}, "logit_bias"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_out_of_range_sampling_fields_are_400(server, body, param):
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_chat_logprobs_have_the_top_n(client):
    out = chat(client, "lp", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == out.choices[0].message.content


# ---- tool calls --------------------------------------------------------------

def test_a_named_tool_choice_always_gives_arguments_that_validate(client):
    schema = WEATHER["function"]["parameters"]
    for seed in range(5):
        out = chat(client, "weather?", tools=[WEATHER, CLOCK], max_tokens=80, temperature=1.0, seed=seed,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert choice.message.content is None


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(client):
    fields = dict(tools=[WEATHER], max_tokens=80, temperature=1.0, seed=3,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(client, "stream a call", **fields).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, "stream a call", stream=True, **fields):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or delta.id
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = c.finish_reason or finish
    assert list(calls) == [0] and calls[0]["id"]
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert finish == "tool_calls"


def test_required_tool_choice_calls_one_of_the_tools_with_valid_arguments(client):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for seed in range(3):
        out = chat(client, "call something", tools=[WEATHER, CLOCK], tool_choice="required",
                   parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tool_choice_none_and_tools_change_the_prompt_and_the_versions(client, server):
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "t"}], max_tokens=2, temperature=0)
    with_tools = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "t"}], max_tokens=2, temperature=0, tools=[WEATHER])
    none = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "t"}], max_tokens=2, temperature=0, tools=[WEATHER],
        tool_choice="none")
    assert with_tools.parse().usage.prompt_tokens > plain.parse().usage.prompt_tokens
    assert none.parse().usage.prompt_tokens == plain.parse().usage.prompt_tokens
    assert "x-kvserve-tool-schema-hash" not in plain.headers
    tool_hash = with_tools.headers["x-kvserve-tool-schema-hash"]
    assert len(tool_hash) == 64 and tool_hash[:6] in with_tools.parse().system_fingerprint
    assert plain.parse().system_fingerprint == server.serving.versions.fingerprint


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tools_are_400(server, body, param):
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "x"}], **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_earlier_tool_calls_and_results_render_into_the_prompt(client):
    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3,
                                         temperature=0)
    shorter = client.chat.completions.create(model=MODEL, messages=messages[:1] + messages[2:], tools=[WEATHER],
                                             max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens > shorter.usage.prompt_tokens  # the call is in the prompt


# ---- /tokenize, /detokenize, versions ---------------------------------------------

def test_tokenize_counts_what_a_request_is_charged(client, server):
    prompt = "count these tokens"
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": prompt}).json()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == out.usage.prompt_tokens
    assert tok["max_model_len"] == 512
    messages = [{"role": "user", "content": "count the chat"}]
    chat_tok = post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": [WEATHER]}).json()
    chat_out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1)
    assert chat_tok["count"] == chat_out.usage.prompt_tokens
    back = post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": prompt}
    strs = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == tok["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {}, 400, None),
])
def test_bad_tokenize_bodies(server, path, body, status, param):
    resp = post(server, path, body)
    assert resp.status_code == status, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param


def test_the_schema_hash_is_in_the_headers_and_the_fingerprint(client, server):
    schema = SCHEMAS["enums"]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "v"}], max_tokens=40, temperature=0,
        response_format=schema_format("enums", schema))
    expected = StructuredOutput("json", schema).hash
    assert raw.headers["x-kvserve-structured-output-hash"] == expected
    assert raw.parse().system_fingerprint.endswith(expected[:6])
    assert raw.headers["x-kvserve-model-revision"] == server.serving.versions.model_revision


# ---- kvserve bench mixes them ------------------------------------------------------

def test_bench_mixes_features_by_weight_splits_the_report_and_records_versions(server, tmp_path):
    from kvserve import cli

    rc = cli.main(["bench", "--base-url", server.base_url, "--model", MODEL, "--endpoint", "chat",
                   "--workload", "prompt=uniform:min=8,max=24;output=fixed:6", "--features", "plain:1,json:1,tools:1",
                   "--rate", "20", "--num-requests", "12", "--timeout", "120", "--out", str(tmp_path),
                   "--no-progress", "--no-metrics", "--seed", "2"])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    by_feature = report["by_feature"]
    assert set(by_feature) == {"plain", "json", "tools"}
    assert sum(b["outcomes"]["success"] for b in by_feature.values()) == report["summary"]["outcomes"]["success"]
    assert report["summary"]["outcomes"]["error"] == 0
    revision = server.serving.versions.model_revision
    for r in report["requests"]:
        if r["outcome"] != "success":
            continue
        assert r["versions"]["model-revision"] == revision and r["versions"]["system_fingerprint"]
        assert ("structured-output-hash" in r["versions"]) == (r["feature"] != "plain")
        assert ("tool-schema-hash" in r["versions"]) == (r["feature"] == "tools")
        assert r["output_tokens"] >= 1


# ---- a LoRA adapter with the rest of the contract --------------------------------

def test_an_adapter_serves_json_schema_beside_the_base_and_names_both_in_the_versions(client, server):
    """The same constrained requests under the adapter and the base, sent
    together: every stopped answer validates, the adapter changes answers,
    and the adapter's id and the schema hash are both in what answered."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(model, name, seed) for name in ("flat", "nested") for seed in (1, 2) for model in (ADAPTER, MODEL)]

    def ask(job):
        model, name, seed = job
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"give me {name}"}], max_tokens=160,
            response_format=schema_format(name, SCHEMAS[name]), temperature=1.0, seed=seed)

    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(ask, jobs))
    for (model, name, _), out in zip(jobs, outs):
        assert out.model == model
        if out.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[name])
    answers = {job: out.choices[0].message.content for job, out in zip(jobs, outs)}
    assert any(answers[(ADAPTER, n, s)] != answers[(MODEL, n, s)] for _, n, s in jobs)
    adapter_id = server.serving.core.adapters.get(ADAPTER).adapter_id
    raw = post(server, "/v1/chat/completions", {
        "model": ADAPTER, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": schema_format("flat", SCHEMAS["flat"])})
    assert raw.headers["x-kvserve-adapter-id"] == adapter_id
    assert raw.headers["x-kvserve-structured-output-hash"]
    assert adapter_id[:6] in raw.json()["system_fingerprint"]


def test_n_choices_under_an_adapter_are_its_answers_and_share_its_prompt_blocks(client, server):
    stats = server.serving.core.stats
    prompt = "an adapter's prompt, long enough to fill a few whole KV blocks of sixteen tokens, " * 2
    hits_before = stats().prefix_cache_hits
    many = client.completions.create(model=ADAPTER, prompt=prompt, n=3, max_tokens=8, temperature=0)
    hits = stats().prefix_cache_hits - hits_before
    one = client.completions.create(model=ADAPTER, prompt=prompt, max_tokens=8, temperature=0)
    under_base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert many.model == ADAPTER and [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [one.choices[0].text] * 3  # greedy: each choice is the adapter's
    assert under_base.choices[0].text != one.choices[0].text
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens == one.usage.prompt_tokens
    full_blocks = (many.usage.prompt_tokens - 1) // 16
    assert full_blocks >= 2 and hits >= 2 * full_blocks * 16  # choices 1 and 2 hit choice 0's blocks
