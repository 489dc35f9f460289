"""The default model (SmolLM2-135M-Instruct) behind `kvserve serve`, through the
official openai client: greedy output equals LLM.generate / LLM.chat."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from kvserve.config import AdmissionConfig, ServerConfig  # noqa: E402
from kvserve.contract import SamplingParams  # noqa: E402
from kvserve.server.serving import Serving  # noqa: E402
from tests.server_helpers import LiveServer  # noqa: E402


@pytest.mark.slow
def test_default_model_greedy_equals_llm_generate():
    from kvserve.engine.llm import LLM

    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    params = SamplingParams(max_tokens=12)
    expected_text = llm.generate("The capital of France is", params)[0].text
    messages = [{"role": "user", "content": "Name a colour."}]
    expected_chat = llm.chat(messages, params)[0].text
    serving = Serving(llm.engine, AdmissionConfig(), ServerConfig(served_model_name="smollm2"),
                      versions=llm.versions)
    with LiveServer(serving) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        out = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == expected_text
        chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == expected_chat
        assert chat.system_fingerprint == llm.versions.fingerprint


@pytest.mark.slow
def test_default_model_json_schema_and_a_named_tool_call_through_the_openai_client():
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from kvserve.engine.llm import LLM
    from tests.test_structured_outputs import SCHEMAS

    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    serving = Serving(llm.engine, AdmissionConfig(max_queue_wait_s=60.0), ServerConfig(served_model_name="smollm2"),
                      versions=llm.versions)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}}}}}
    with LiveServer(serving) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        for name in ("flat", "nested", "enums"):
            out = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Give me a {name} JSON example."}],
                max_tokens=120, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[name])
        call = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60, temperature=0).choices[0]
        assert call.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.message.tool_calls[0].function.arguments),
                            tool["function"]["parameters"])
