"""Tool calls without a model: ToolSet's validation, prompt, constraint and
parser, and the streamed deltas, which must join to what the whole output
parses to however the text is split."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.contract import InvalidParameter
from kvserve.server.tools import ToolSet

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def tools(choice="auto", parallel=None) -> ToolSet:
    tool_set = ToolSet.of_request([WEATHER, CLOCK], choice, parallel)
    assert tool_set is not None
    return tool_set


AUTO_OUTPUTS = [
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Rome"}}</tool_call> done',
    'no call here, just <tool text',
    '<tool_call>{"name": broken json}</tool_call>',
    'cut short <tool_call>{"name": "get_time", "arguments": {}}',
]


def test_auto_parses_tagged_calls_and_keeps_the_rest_as_content():
    parsed = tools().parse(AUTO_OUTPUTS[0])
    assert parsed.content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo"})]
    two = tools().parse(AUTO_OUTPUTS[1])
    assert [c.name for c in two.calls] == ["get_time", "get_weather"] and two.content == " done"
    assert tools().parse(AUTO_OUTPUTS[2]) == (AUTO_OUTPUTS[2], [])
    assert tools().parse(AUTO_OUTPUTS[3]).calls == []  # not a call object: stays content
    assert tools().parse(AUTO_OUTPUTS[3]).content == AUTO_OUTPUTS[3]
    assert [c.name for c in tools().parse(AUTO_OUTPUTS[4]).calls] == ["get_time"]


def joined(tool_set: ToolSet, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """Stream `text` in random pieces; (content, [(name, arguments)]) as a client reassembles them."""
    stream = tool_set.stream()
    content, calls = "", {}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    results = [stream.push(p) for p in pieces] + [stream.finish()]
    for text_delta, deltas in results:
        content += text_delta
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            call[0] += d["function"].get("name", "")
            call[1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text", AUTO_OUTPUTS)
def test_streamed_auto_deltas_join_to_the_whole_parse(text):
    whole = tools().parse(text)
    for seed in range(20):
        content, calls = joined(tools(), text, random.Random(seed))
        assert calls == [(c.name, c.arguments) for c in whole.calls]
        assert (content or None) == whole.content


def test_content_before_a_tag_streams_at_once_and_a_partial_tag_is_held_back():
    stream = tools().stream()
    assert stream.push("Hello <tool") == ("Hello ", [])
    assert stream.push("_call>{") == ("", [])
    other = tools().stream()
    assert other.push("a <to") == ("a ", [])
    assert other.push("day") == ("<today", [])


def test_a_named_function_streams_its_arguments_as_they_come():
    tool_set = ToolSet.of_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    stream = tool_set.stream()
    _, first = stream.push('{"ci')
    assert first[0]["id"].startswith("call_") and first[0]["function"] == {"name": "get_weather",
                                                                           "arguments": '{"ci'}
    assert stream.push('ty": "X"}') == ("", [{"index": 0, "function": {"arguments": 'ty": "X"}'}}])
    assert stream.finish() == ("", [])
    assert tool_set.parse('{"city": "X"}').calls[0].arguments == '{"city": "X"}'


def test_required_constrains_to_an_array_of_known_calls():
    schema = json.loads(tools("required").constraint().spec)
    valid = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tools("required", parallel=False).constraint().spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, single)
    parsed = tools("required").parse(json.dumps(valid))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo"}),
                                                                           ("get_time", {})]
    assert tools().constraint() is None


def test_the_prompt_shows_the_tools_to_a_template_without_them():
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
    shown, template_vars = tools().prompt(messages, "{{ messages }}")
    assert template_vars == {} and shown[0]["role"] == "system"
    assert shown[0]["content"].startswith("be terse") and '"get_weather"' in shown[0]["content"]
    assert shown[1:] == messages[1:]
    same, template_vars = tools().prompt(messages, "{% if tools %}{{ tools }}{% endif %}")
    assert same == messages and template_vars["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("tool_list, choice, param", [
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_bad_tool_sets_name_the_field(tool_list, choice, param):
    with pytest.raises(InvalidParameter) as info:
        ToolSet.of_request(tool_list, choice, None)
    assert info.value.param == param


def test_no_tools_or_none_build_no_tool_set_and_the_hash_follows_the_tools():
    assert ToolSet.of_request(None, None, None) is None
    assert ToolSet.of_request([WEATHER], "none", None) is None
    assert tools().schema_hash == tools().schema_hash != ToolSet.of_request([WEATHER], None, None).schema_hash
