"""Grammar engines for structured outputs, side by side on the default model's tokenizer.

Measures xgrammar and llguidance (whichever are installed; kvserve depends on
llguidance only, see docs/structured-outputs.md) on SmolLM2's byte-level BPE
(vocab 49,152):
- compile time per JSON schema (simple, nested, arrays, enums, required, large),
  first compile and a second one of the same schema (the engine's own cache);
- per-token mask time while a matcher walks a valid answer token by token, at
  batch 1 and batch 16 (16 matchers, the engine's parallel batch call);
- feature coverage: per JSON Schema keyword and per vLLM `structured_outputs`
  kind (json / regex / choice / grammar), a valid and an invalid instance fed as
  the model's tokens: "enforced" (valid accepted, invalid refused), "ignored"
  (both accepted), "refused" (the compile fails), "wrong" (valid refused);
- how invalid schemas / regexes / grammars are reported (the message text).

    .venv/bin/pip install xgrammar==0.2.9    # not a kvserve dependency; pulls transformers, triton
    .venv/bin/python benchmarks/grammar_engines.py  # table + benchmarks/results/grammar_engines.json
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvserve.model_facts.source import load_tokenizer

RESULTS = Path(__file__).parent / "results" / "grammar_engines.json"
REPEATS = 3


def large_schema(num_properties: int = 60) -> dict:
    """An object of many typed, partly nested properties with $defs (an order form)."""
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0},
             {"type": "number"}, {"type": "boolean"}, {"enum": ["red", "green", "blue"]},
             {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
             {"$ref": "#/$defs/address"}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)[: num_properties // 2],
            "additionalProperties": False,
            "$defs": {"address": {"type": "object", "additionalProperties": False,
                                  "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                 "pattern": "^[0-9]{5}$"}},
                                  "required": ["street", "zip"]}}}


def large_instance(num_properties: int = 60) -> dict:
    values = ["abc", 3, 1.5, True, "green", [1, 2], {"street": "Main", "zip": "12345"}]
    return {f"field_{i}": values[i % len(values)] for i in range(num_properties)}


# name -> (schema, a valid instance walked for the mask timing)
SCHEMAS: dict[str, tuple[dict, object]] = {
    "simple": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "additionalProperties": False, "required": ["user"],
                "properties": {"user": {"type": "object", "additionalProperties": False,
                                        "required": ["id", "profile"],
                                        "properties": {"id": {"type": "integer"},
                                                       "profile": {"type": "object",
                                                                   "additionalProperties": False,
                                                                   "properties": {
                                                                       "city": {"type": "string"},
                                                                       "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
                                                                   "required": ["city"]}}}}},
               {"user": {"id": 7, "profile": {"city": "Paris", "tags": ["a", "bc"]}}}),
    "arrays": ({"type": "object", "additionalProperties": False, "required": ["points"],
                "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 8,
                                          "items": {"type": "object", "additionalProperties": False,
                                                    "properties": {"x": {"type": "number"},
                                                                   "y": {"type": "number"}},
                                                    "required": ["x", "y"]}}}},
               {"points": [{"x": 1.5, "y": -2}, {"x": 0, "y": 3.25}, {"x": 10, "y": 11}]}),
    "enums": ({"type": "object", "additionalProperties": False, "required": ["color", "size"],
               "properties": {"color": {"enum": ["red", "green", "blue"]},
                              "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                              "kind": {"const": "shirt"}}},
              {"color": "green", "size": "XL", "kind": "shirt"}),
    "required": ({"type": "object", "additionalProperties": False, "required": ["a", "c"],
                  "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"},
                                 "d": {"type": ["string", "null"]}}},
                 {"a": "x", "c": False, "d": None}),
    "large_60_properties": (large_schema(), large_instance()),
}

# JSON Schema keyword -> (schema, valid instance, invalid instance)
FEATURES: dict[str, tuple[dict, object, object]] = {
    "type_string": ({"type": "string"}, "hi", 5),
    "type_integer": ({"type": "integer"}, 12, 1.5),
    "type_array_of_types": ({"type": ["integer", "null"]}, None, "x"),
    "enum": ({"enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": 42}, 42, 41),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 {"a": 1}, {}),
    "additionalProperties_false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties_schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    {"k": 1}, {"k": "v"}),
    "minLength_maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "abc-12"),
    "format_date": ({"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    "format_email": ({"type": "string", "format": "email"}, "a@b.co", "not an email"),
    "minimum_maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, 5, 12),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minItems_maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                          [1, 2], [1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                     "items": False}, ["a", 1], [1, "a"]),
    "ref_defs": ({"$defs": {"p": {"type": "integer"}}, "type": "object",
                  "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]}, {"a": 1}, {"a": "x"}),
    "recursive_ref": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"w": 2}]}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", [1]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              {"a": 1, "b": 2}, {"a": 1}),
    "not": ({"not": {"type": "string"}}, 1, "x"),
    "if_then_else": ({"type": "object", "if": {"properties": {"k": {"const": "n"}}},
                      "then": {"properties": {"v": {"type": "integer"}}}}, {"k": "n", "v": 1},
                     {"k": "n", "v": "x"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "minProperties": ({"type": "object", "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
}

# vLLM structured_outputs kinds -> (spec, valid text, invalid text)
KINDS: dict[str, tuple[tuple[str, str], str, str]] = {
    "json_object": (("json", json.dumps({"type": "object"})), '{"a": [1, 2]}', "[1, 2]"),
    "regex": (("regex", r"[0-9]{3}-[0-9]{4}"), "555-1234", "55-1234"),
    "choice": (("choice", json.dumps(["positive", "negative", "neutral"])), "negative", "bad"),
    "grammar_ebnf": (("grammar", 'root ::= "yes" | "no" | "maybe"'), "maybe", "perhaps"),
    "grammar_lark": (("lark", 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'), "123", "abc"),
}

INVALID: dict[str, tuple[str, str]] = {
    "not_a_type": ("json", json.dumps({"type": "strnig"})),
    "properties_not_object": ("json", json.dumps({"type": "object", "properties": 5})),
    "dangling_ref": ("json", json.dumps({"$ref": "#/$defs/missing"})),
    "bad_pattern": ("json", json.dumps({"type": "string", "pattern": "([a-z]"})),
    "min_above_max": ("json", json.dumps({"type": "integer", "minimum": 5, "maximum": 1})),
    "not_json": ("json", "{type: object"),
    "bad_regex": ("regex", "(ab"),
    "bad_grammar": ("grammar", "root ::= ( \"a\""),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch

        self.ll, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids))
        self.executor = llguidance.LLExecutor()
        self.version = llguidance.__version__

    def grammar(self, kind: str, text: str) -> str:
        return self.ll.grammar_from("lark" if kind == "lark" else kind, text)

    def compile(self, kind: str, text: str):
        """A fresh matcher: llguidance compiles as it builds the matcher (lazily, per state)."""
        grammar = self.grammar(kind, text)
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def accepts_ids(self, compiled, ids: list[int]) -> bool:
        matcher = self.matcher(compiled)
        return matcher.consume_tokens(ids) and matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=list(tokenizer.eos_token_ids))
        self.info = info
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.uncached = lambda: xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        from importlib.metadata import version
        self.version = version("xgrammar")

    def compile(self, kind: str, text: str, compiler=None):
        compiler = compiler or self.compiler
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in json.loads(text))
            return compiler.compile_grammar(ebnf)
        if kind == "lark":
            return compiler.compile_lark(text)
        return compiler.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def accepts_ids(self, compiled, ids: list[int]) -> bool:
        matcher = self.matcher(compiled)
        return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()


def engines(tokenizer, vocab_size: int) -> list:
    found = []
    for cls in (Llguidance, Xgrammar):
        try:
            found.append(cls(tokenizer, vocab_size))
        except ImportError as e:
            print(f"# {cls.name}: not installed ({e}); skipped", file=sys.stderr)
    return found


def time_compile(engine, schema: dict) -> dict:
    text = json.dumps(schema)
    firsts = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        if engine.name == "xgrammar":
            engine.compile("json", text, engine.uncached())
        else:
            engine.compile("json", text)
        firsts.append(time.perf_counter() - start)
    return {"compile_ms": round(1e3 * statistics.median(firsts), 3)}


def time_masks(engine, tokenizer, schema: dict, instance: object, batch: int) -> dict:
    """Median and p99 time of one step's mask fill for `batch` matchers walking the instance."""
    ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    compiled = engine.compile("json", json.dumps(schema))
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (engine_vocab(tokenizer) + 31) // 32), -1, dtype=torch.int32)
    times = []
    ok = True
    for token_id in ids:
        start = time.perf_counter()
        engine.fill(matchers, bitmask)
        times.append(time.perf_counter() - start)
        allowed = bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)
        ok = ok and allowed and all(engine.accept(m, token_id) for m in matchers)
    times.sort()
    return {"mask_ms_median": round(1e3 * statistics.median(times), 4),
            "mask_ms_p99": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 4),
            "tokens": len(ids), "walk_accepted": ok}


def engine_vocab(tokenizer) -> int:
    return tokenizer.vocab_size


def coverage(engine, tokenizer, kind: str, spec: str, valid: str, invalid: str) -> str:
    try:
        compiled = engine.compile(kind, spec)
    except Exception:  # noqa: BLE001 - any refusal is the data point
        return "refused"
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    good = engine.accepts_ids(compiled, encode(valid))
    bad = engine.accepts_ids(compiled, encode(invalid))
    return {(True, False): "enforced", (True, True): "ignored"}.get((good, bad), "wrong")


def invalid_message(engine, kind: str, text: str) -> str:
    try:
        engine.compile(kind, text)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return "ACCEPTED (no error)"


def main() -> None:
    tokenizer = load_tokenizer()
    vocab_size = tokenizer.vocab_size
    results: dict = {"machine": platform.processor() or platform.machine(), "torch_threads":
                     torch.get_num_threads(), "vocab_size": vocab_size, "engines": {}}
    for engine in engines(tokenizer, vocab_size):
        start = time.perf_counter()
        type(engine)(tokenizer, vocab_size)
        setup_s = time.perf_counter() - start
        record: dict = {"version": engine.version, "tokenizer_setup_s": round(setup_s, 3), "schemas": {},
                        "features": {}, "kinds": {}, "invalid": {}}
        for name, (schema, instance) in SCHEMAS.items():
            row = time_compile(engine, schema)
            for batch in (1, 16):
                row[f"batch{batch}"] = time_masks(engine, tokenizer, schema, instance, batch)
            record["schemas"][name] = row
        for name, (schema, valid, invalid) in FEATURES.items():
            record["features"][name] = coverage(engine, tokenizer, "json", json.dumps(schema),
                                                json.dumps(valid), json.dumps(invalid))
        for name, ((kind, spec), valid, invalid) in KINDS.items():
            record["kinds"][name] = coverage(engine, tokenizer, kind, spec, valid, invalid)
        for name, (kind, text) in INVALID.items():
            record["invalid"][name] = invalid_message(engine, kind, text)
        results["engines"][engine.name] = record
    print_table(results)
    # kvserve installs llguidance only (`pip install xgrammar` for the comparison):
    # a run without both must not overwrite the side-by-side record.
    names = sorted(results["engines"])
    out = RESULTS if names == ["llguidance", "xgrammar"] else RESULTS.with_name(f"grammar_engines_{'_'.join(names)}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def print_table(results: dict) -> None:
    names = list(results["engines"])
    print(f"{'schema':<22}" + "".join(f"| {n:<48}" for n in names))
    print(f"{'':<22}" + "".join(f"| {'compile ms':>10} {'mask ms b1 med/p99':>19} {'b16 med':>8}    "
                                for _ in names))
    for schema in SCHEMAS:
        line = f"{schema:<22}"
        for n in names:
            row = results["engines"][n]["schemas"][schema]
            b1, b16 = row["batch1"], row["batch16"]
            line += (f"| {row['compile_ms']:>10.2f} {b1['mask_ms_median']:>9.3f}/{b1['mask_ms_p99']:<9.3f}"
                     f" {b16['mask_ms_median']:>8.3f}{'' if b1['walk_accepted'] else ' !'}    ")
        print(line)
    for section in ("features", "kinds", "invalid"):
        print(f"\n{section:<28}" + "".join(f"| {n:<40}" for n in names))
        for key in results["engines"][names[0]][section]:
            print(f"{key:<28}" + "".join(f"| {results['engines'][n][section][key][:40]:<40}" for n in names))


if __name__ == "__main__":
    main()
