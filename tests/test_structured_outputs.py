"""Structured outputs through the offline API: JSON Schema, regex, choice and
grammar constraints enforced while decoding, beside unconstrained requests.

A tiny random-weight Llama with SmolLM2's real tokenizer (vocab 49,152) keeps
these fast while the token masks are those of the default model's byte-level
BPE; the default model itself runs in the slow test at the end.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest
import torch

from kvserve.contract import InvalidParameter, SamplingParams, StructuredOutput
from tests.tiny_models import TEST_DEVICE, TINY_DIMS

jsonschema = pytest.importorskip("jsonschema")

VOCAB = 49152

# Bounded schemas: a random model stops only where the grammar closes, so
# every string has a maxLength and every array a maxItems.
SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
             "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                                       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "tags": {"type": "array", "maxItems": 3,
                                                               "items": {"type": "string", "maxLength": 4}}}}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": {"type": "object", "additionalProperties": False, "required": ["x"],
                                   "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]},
                             "kind": {"const": "shirt"}}},
    "required_and_optional": {"type": "object", "additionalProperties": False, "required": ["a", "c"],
                              "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "integer",
                                             "minimum": 0, "maximum": 9}, "c": {"type": ["boolean", "null"]}}},
    "refs": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                 "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
             "type": "object", "additionalProperties": False, "required": ["start", "end"],
             "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama over SmolLM2's tokenizer, as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.model_facts.source import load_tokenizer

    torch.manual_seed(21)
    dims = dict(TINY_DIMS, vocab_size=VOCAB)
    model = LlamaForCausalLM(LlamaConfig(**dims, eos_token_id=2, bos_token_id=None, pad_token_id=None)).eval()
    folder = tmp_path_factory.mktemp("tiny-smollm-tokenizer")
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer().save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"}))
    return folder


@pytest.fixture(scope="module")
def llm(tiny_folder):
    from kvserve import LLM

    # KVSERVE_TEST_DEVICE=cuda (benchmarks/cuda_check.sh) runs these on a GPU,
    # through the sampler's torch unpacking of the masks instead of numpy's.
    return LLM(model=str(tiny_folder), kv_cache_memory="32MiB", device=TEST_DEVICE, max_model_len=512)


def json_params(schema: dict, seed: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                          structured_output=StructuredOutput("json", schema), **fields)


def test_json_schema_outputs_parse_and_validate_when_stopped(llm):
    cases = [(name, seed) for name in SCHEMAS for seed in range(3)]
    outputs = llm.generate(["Answer in JSON:"] * len(cases), [json_params(SCHEMAS[n], s) for n, s in cases])
    stopped = {name: 0 for name in SCHEMAS}
    for (name, _), out in zip(cases, outputs):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
            stopped[name] += 1
    # Not vacuous: the constraint completes (and ends the request) for most of them.
    assert all(count >= 2 for count in stopped.values()), stopped


def test_greedy_json_is_the_same_alone_and_batched(llm):
    params = json_params(SCHEMAS["nested"], seed=0, top_p=1.0)
    greedy = SamplingParams(max_tokens=120, structured_output=params.structured_output)
    alone = llm.generate("Answer in JSON:", greedy)[0]
    batched = llm.generate(["Answer in JSON:", "Other text", "More"],
                           [greedy, SamplingParams(max_tokens=30), json_params(SCHEMAS["enums"], 3)])[0]
    assert batched.token_ids == alone.token_ids and alone.finish_reason == "stop"
    jsonschema.validate(json.loads(alone.text), SCHEMAS["nested"])


def test_unconstrained_neighbours_keep_their_greedy_tokens(llm):
    prompts = ["The weather today", "One two three", "Hello"]
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, plain)]
    neighbours = [json_params(SCHEMAS["flat"], 1), SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                  frequency_penalty=1.0, logit_bias={"11": 50}),
                  SamplingParams(max_tokens=20, structured_output=StructuredOutput("regex", "[a-z]{3,30}"))]
    mixed = llm.generate(prompts + ["Answer in JSON:", "x", "y"], [plain] * 3 + neighbours)
    assert [o.token_ids for o in mixed[:3]] == alone
    # ...and the neighbours were constrained (the batch did hold masks).
    assert re.fullmatch("[a-z]{3,30}", mixed[5].text)


def test_a_completed_constraint_ends_the_request_even_when_eos_is_ignored(llm):
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=2, ignore_eos=True,
                            structured_output=StructuredOutput("choice", ["left", "right"]))
    (out,) = llm.generate("Pick:", params)
    assert out.finish_reason == "stop" and out.text in ("left", "right")
    assert not set(out.token_ids) & set(llm.engine.eos_token_ids)  # ended at once, no EOS padding


def test_regex_choice_and_grammar_are_honoured(llm):
    specs = [("regex", r"[0-9]{3}-[0-9]{4}", lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ("choice", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
             ("grammar", 'root ::= "yes" | "no" | "maybe"', lambda t: t in ("yes", "no", "maybe")),
             ("grammar", 'start: "n=" NUM\nNUM: /[1-9][0-9]?/', lambda t: re.fullmatch(r"n=[1-9][0-9]?", t)),
             ("json_object", None, lambda t: isinstance(json.loads(t), dict))]
    cases = [(check, SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                    structured_output=StructuredOutput(kind, spec)))
             for kind, spec, check in specs for seed in range(2)]
    outputs = llm.generate(["Say:"] * len(cases), [p for _, p in cases])
    for (check, params), out in zip(cases, outputs):
        if params.structured_output.kind != "json_object":
            assert out.finish_reason == "stop", (params.structured_output, out.text)
        if out.finish_reason == "stop":
            assert check(out.text), (params.structured_output, out.text)
    choices = {o.text for (_, p), o in zip(cases, outputs) if p.structured_output.kind == "choice"}
    assert choices <= {"positive", "negative", "neutral"}


@pytest.mark.parametrize("kind,spec,message", [
    ("json", {"type": "strnig"}, "Invalid type: strnig"),
    ("json", {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "nope"),
    ("json", {"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ("json", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    ("regex", "(ab", "unclosed group"),
    ("grammar", 'root ::= ( "a"', "grammar"),
])
def test_an_unenforceable_constraint_raises_invalid_parameter_and_queues_nothing(llm, kind, spec, message):
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput(kind, spec))
    with pytest.raises(InvalidParameter, match=re.escape(message)) as caught:
        llm.generate(["a", "b"], [good, bad])
    assert caught.value.param == "structured_output"
    assert not llm.engine.has_unfinished()
    assert llm.generate("a", good)[0].finish_reason == "length"


def test_malformed_constraints_are_refused_at_construction():
    with pytest.raises(InvalidParameter, match="not valid JSON"):
        StructuredOutput("json", "{type: object")
    with pytest.raises(InvalidParameter, match="kind must be one of"):
        StructuredOutput("yaml", "a: b")
    with pytest.raises(InvalidParameter, match="choice"):
        StructuredOutput("choice", [])
    with pytest.raises(InvalidParameter, match="stop"):
        SamplingParams(stop=["}"], structured_output=StructuredOutput("json_object"))


def test_a_compiling_grammar_delays_only_its_own_request(llm):
    """The engine keeps stepping the others while a constraint compiles off
    its thread; the constrained request starts once the compile is done."""
    engine = llm.engine
    constraint = StructuredOutput("choice", ["alpha", "beta"])
    pending: Future = Future()
    real_submit = engine.structured.submit
    engine.structured.submit = lambda c: pending if c == constraint else real_submit(c)
    try:
        waiting = engine.new_request([5, 6, 7], SamplingParams(max_tokens=10, structured_output=constraint))
        other = engine.new_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
        engine.add_request(waiting)
        engine.add_request(other)
        steps = [engine.step().outputs for _ in range(3)]
        assert [o.request_id for step in steps for o in step] == [other.request_id] * 3
        assert engine.has_unfinished() and waiting.output_token_ids == []
        dropped = engine.new_request([5], SamplingParams(max_tokens=10, structured_output=constraint))
        engine.add_request(dropped)  # aborted while its grammar compiles
        assert engine.abort(dropped.request_id).finish_reason == "abort"
        assert engine.abort(dropped.request_id) is None
        pending.set_result(real_submit(constraint).result())
        final = {}
        while engine.has_unfinished():
            final.update({o.request_id: o for o in engine.step().outputs if o.finished})
        assert final[waiting.request_id].text in ("alpha", "beta")
        assert final[waiting.request_id].finish_reason == "stop"
        # Ended by the completed constraint, not by sampling EOS.
        assert not set(final[waiting.request_id].token_ids) & set(engine.eos_token_ids)
    finally:
        engine.structured.submit = real_submit


def test_a_compile_that_fails_late_aborts_its_request(llm):
    engine = llm.engine
    failed: Future = Future()
    real_submit = engine.structured.submit
    engine.structured.submit = lambda c: failed
    try:
        request = engine.new_request([5, 6], SamplingParams(structured_output=StructuredOutput("json_object")))
        engine.add_request(request)
        failed.set_exception(InvalidParameter("structured_output", "cannot be enforced"))
        (out,) = engine.step().outputs
        assert out.finished and out.finish_reason == "abort" and out.token_ids == []
        assert not engine.has_unfinished()
    finally:
        engine.structured.submit = real_submit


def test_each_constraint_is_compiled_once_and_the_cache_is_bounded(tiny_folder):
    from kvserve.model_facts.source import load_tokenizer
    from kvserve.structured import GrammarCompiler

    compiler = GrammarCompiler(load_tokenizer(tiny_folder), VOCAB, max_cached=2)
    a = StructuredOutput("json", {"type": "object", "properties": {"a": {"type": "integer"}}})
    a_as_text = StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    first = compiler.submit(a)
    assert compiler.submit(a_as_text) is first  # same canonical schema, same compile
    compiler.submit(StructuredOutput("regex", "x+"))
    compiler.submit(StructuredOutput("regex", "y+"))  # evicts `a`, the least recently used
    assert compiler.submit(a) is not first
    assert first.result().constraint_hash == a.hash
    compiler.shutdown()


def test_the_versions_carry_the_schema_hash(llm):
    params = json_params(SCHEMAS["flat"], seed=0)
    versions = llm.versions.for_request(params)
    assert versions.structured_output_hash == params.structured_output.hash
    assert versions.model_revision == llm.versions.model_revision
    assert versions.fingerprint.startswith(llm.versions.fingerprint)
    assert versions.fingerprint != llm.versions.fingerprint
    other = llm.versions.for_request(json_params(SCHEMAS["enums"], seed=0))
    assert other.fingerprint != versions.fingerprint
    assert llm.versions.for_request(SamplingParams()) == llm.versions


def test_key_order_is_part_of_the_constraint():
    forward = StructuredOutput("json", {"properties": {"a": {}, "b": {}}})
    backward = StructuredOutput("json", {"properties": {"b": {}, "a": {}}})
    assert forward.hash != backward.hash
    assert forward.hash == StructuredOutput("json", json.dumps({"properties": {"a": {}, "b": {}}}, indent=2)).hash


@pytest.mark.slow
def test_default_model_answers_validate_for_many_schemas():
    """SmolLM2-135M-Instruct, greedy, one batch of chat requests (one per
    schema) beside an unconstrained one whose tokens must not change."""
    from kvserve import LLM

    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024)
    schemas = dict(SCHEMAS, person={"type": "object", "required": ["name", "age"], "additionalProperties": False,
                                    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}})
    ask = [{"role": "user", "content": "Reply with a JSON object that fits the schema."}]
    plain = SamplingParams(max_tokens=20)
    alone = llm.chat(ask, plain)[0]
    params = [SamplingParams(max_tokens=100, structured_output=StructuredOutput("json", s)) for s in schemas.values()]
    outputs = llm.chat([ask] * (len(params) + 1), params + [plain])
    for (name, schema), out in zip(schemas.items(), outputs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert outputs[-1].token_ids == alone.token_ids


def test_seeded_penalised_requests_are_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=77, frequency_penalty=0.8, presence_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={"13": 4.0}, ignore_eos=True)
    alone = llm.generate("Tell me", seeded)[0].token_ids
    neighbours = [json_params(SCHEMAS["enums"], 5), SamplingParams(max_tokens=9, temperature=0.7),
                  SamplingParams(max_tokens=12, repetition_penalty=0.8)]
    batched = llm.generate(["x y", "Tell me", "z", "w"], [neighbours[0], seeded, neighbours[1], neighbours[2]])
    assert batched[1].token_ids == alone


def test_logit_bias_bans_and_forces_tokens_through_the_engine(llm):
    favourite = llm.generate("Hello", SamplingParams(max_tokens=1))[0].token_ids[0]
    banned = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, logit_bias={favourite: -100}) for s in range(8)]
    for out in llm.generate(["Hello"] * 8, banned):
        assert favourite not in out.token_ids
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=1, logit_bias={"1234": 100}, ignore_eos=True)
    assert llm.generate("Hello", forced)[0].token_ids == [1234] * 6
