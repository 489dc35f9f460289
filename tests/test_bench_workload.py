"""Workloads: seeded token-count specs, mixes, prefix groups, traces, prompts."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvserve.bench.prompts import PromptBuilder, load_tokenizer
from kvserve.bench.workload import (NAMED_MIXES, PrefixGroup, RequestSpec,
                                    WorkloadSpec, generate_requests, load_trace,
                                    parse_length_classes, parse_length_dist, parse_weights,
                                    requests_from_trace)


def _spec(classes="short", **kw) -> WorkloadSpec:
    return WorkloadSpec(parse_length_classes(classes), **kw)


def test_same_seed_same_requests_and_lengths_independent_of_tenant_mix():
    a = generate_requests(_spec("chat"), 200, seed=5)
    assert a == generate_requests(_spec("chat"), 200, seed=5)
    assert a != generate_requests(_spec("chat"), 200, seed=6)
    b = generate_requests(_spec("chat", tenants=(("x", 1.0), ("y", 1.0))), 200, seed=5)
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in b]


@pytest.mark.parametrize("name", sorted(NAMED_MIXES))
def test_named_mixes_stay_in_their_bounds(name):
    bounds = [(c.prompt.param("min", 1), c.prompt.param("max", 1e9),
               c.output.param("min", 1), c.output.param("max", 1e9)) for c in NAMED_MIXES[name]]
    for r in generate_requests(_spec(name), 500, seed=1):
        assert any(p0 <= r.prompt_tokens <= p1 and o0 <= r.output_tokens <= o1
                   for p0, p1, o0, o1 in bounds)


def test_rag_is_long_prompt_short_answer_and_codegen_long_answer():
    rag = generate_requests(_spec("rag"), 400, seed=2)
    code = generate_requests(_spec("codegen"), 400, seed=2)
    assert sum(r.prompt_tokens for r in rag) > 5 * sum(r.output_tokens for r in rag)
    assert sum(r.output_tokens for r in code) > sum(r.prompt_tokens for r in code)


def test_custom_distributions():
    fixed = generate_requests(_spec("prompt=fixed:100;output=uniform:min=5,max=9"), 300)
    assert {r.prompt_tokens for r in fixed} == {100}
    assert {r.output_tokens for r in fixed} == set(range(5, 10))
    table = parse_length_dist("table:10=3,20=1")
    import random
    rng = random.Random(0)
    counts = Counter(table.sample(rng) for _ in range(4000))
    assert set(counts) == {10, 20}
    assert counts[10] / 4000 == pytest.approx(0.75, abs=0.03)
    bounded = parse_length_dist("normal:mean=100,std=500,min=50,max=120")
    assert all(50 <= bounded.sample(rng) <= 120 for _ in range(500))


def test_joint_table_csv_keeps_pairs(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("prompt_tokens,output_tokens,weight\n1000,10,1\n50,500,1\n")
    pairs = {(r.prompt_tokens, r.output_tokens)
             for r in generate_requests(_spec(f"table:{path}"), 100)}
    assert pairs == {(1000, 10), (50, 500)}


def test_tenant_priority_mix_and_cancel_share():
    spec = _spec(tenants=parse_weights("a:3,b:1"), priorities=parse_weights("0:1,2:1", int),
                 cancel_rate=0.2, cancel_after_s=(0.5, 1.0))
    reqs = generate_requests(spec, 4000, seed=9)
    tenants = Counter(r.tenant for r in reqs)
    assert tenants["a"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert set(Counter(r.priority for r in reqs)) == {0, 2}
    cancelled = [r.cancel_after_s for r in reqs if r.cancel_after_s is not None]
    assert len(cancelled) / 4000 == pytest.approx(0.2, abs=0.02)
    assert all(0.5 <= c <= 1.0 for c in cancelled)


def test_prefix_groups():
    spec = _spec("prompt=fixed:20;output=fixed:4", num_prefix_groups=2, prefix_tokens=30,
                 prefix_share=0.5)
    reqs = generate_requests(spec, 400, seed=1)
    grouped = [r for r in reqs if r.prefix_group]
    assert len(grouped) / 400 == pytest.approx(0.5, abs=0.06)
    assert {r.prefix_group.group_id for r in grouped} == {0, 1}
    assert all(r.prompt_tokens >= 31 for r in grouped)  # prefix + at least one own token


@pytest.mark.parametrize("bad, message", [
    ("bogus", "unknown workload"),
    ("prompt=fixed:abc;output=fixed:3", "fixed length needs a number"),
    ("prompt=normal:mean=3;output=fixed:3", "needs std="),
    ("prompt=weird:1;output=fixed:3", "unknown length distribution"),
])
def test_bad_workloads_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_length_classes(bad)


def test_invalid_workload_spec():
    with pytest.raises(ValueError, match="prefix_share"):
        _spec(prefix_share=0.5)
    with pytest.raises(ValueError, match="weights"):
        _spec(tenants=(("a", 0.0),))


def test_trace_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in [
        {"timestamp": 12.5, "input_tokens": 30, "output_tokens": 5, "tenant": "b"},
        {"timestamp": 10.0, "input_tokens": 10, "output_tokens": 7, "priority": 1}]))
    rows = load_trace(jsonl)
    assert [r.timestamp_s for r in rows] == [10.0, 12.5]
    specs = requests_from_trace(rows)
    assert [(s.prompt_tokens, s.output_tokens, s.tenant, s.priority) for s in specs] == \
        [(10, 7, "default", 1), (30, 5, "b", 0)]
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("timestamp_ms,prompt_tokens,completion_tokens\n1500,3,4\n")
    assert load_trace(csv_path)[0].timestamp_s == 1.5
    bad = tmp_path / "bad.csv"
    bad.write_text("when,input_tokens\n1,2\n")
    with pytest.raises(ValueError, match="need timestamp"):
        load_trace(bad)


def test_prompt_approximation_one_word_per_token_and_shared_prefixes():
    builder = PromptBuilder(seed=3)
    group = PrefixGroup(0, 40)
    a = builder.build(RequestSpec(0, 100, 5, prefix_group=group))
    b = builder.build(RequestSpec(1, 60, 5, prefix_group=group))
    c = builder.build(RequestSpec(2, 100, 5))
    assert len(a.split()) == 100 and len(b.split()) == 60
    assert a.split()[:40] == b.split()[:40]
    assert a.split()[40:45] != b.split()[40:45]
    assert a.split()[:10] != c.split()[:10]


@pytest.fixture(scope="module")
def bpe_tokenizer_file(tmp_path_factory):
    """A small BPE trained here, so many words split into several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the people of the world work in the city every day"] * 50
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_shared_prefix_is_exact_with_a_tokenizer(bpe_tokenizer_file):
    tok = load_tokenizer(bpe_tokenizer_file)
    builder = PromptBuilder(tok, seed=2)
    group = PrefixGroup(3, 25)
    a = builder.build(RequestSpec(0, 80, 4, prefix_group=group))
    b = builder.build(RequestSpec(1, 50, 4, prefix_group=group))
    assert len(tok.encode(a)) == 80 and len(tok.encode(b)) == 50
    prefix_ids = tok.encode(a)[:25]
    assert tok.encode(b)[:25] == prefix_ids


@pytest.mark.parametrize("target", [1, 7, 64, 333])
def test_prompt_exact_length_with_a_tokenizer(bpe_tokenizer_file, target):
    tok = load_tokenizer(bpe_tokenizer_file)
    builder = PromptBuilder(tok, seed=1)
    assert builder.exact
    text = builder.build(RequestSpec(0, target, 4))
    assert len(tok.encode(text)) == target
    # Words split under this tokenizer, so plain word counting would be wrong.
    assert target == 1 or len(text.split()) != target


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")


def test_weighted_draws_are_those_of_random_choices():
    # The mix draws with precomputed cumulative weights; the same seed must
    # give what random.choices(population, weights) gives, draw for draw.
    import random

    from kvserve.bench.workload import _WeightedChoice

    for trial in range(20):
        setup = random.Random(trial)
        population = list(range(setup.randint(1, 6)))
        weights = [setup.choice([0.0, 0.1, 1.0, 3.0, 7.5]) + (i == 0) for i in population]
        ours, reference = random.Random(f"x{trial}"), random.Random(f"x{trial}")
        choice = _WeightedChoice(population, weights)
        assert [choice.draw(ours) for _ in range(200)] == \
            [reference.choices(population, weights)[0] for _ in range(200)]
    with pytest.raises(ValueError, match="sum"):
        _WeightedChoice(["a"], [0.0])


def test_feature_mix_by_weight_leaves_the_lengths_alone():
    classes = parse_length_classes("chat")
    plain = generate_requests(WorkloadSpec(classes), 400, seed=5)
    mixed = generate_requests(WorkloadSpec(classes, features=(("plain", 2.0), ("json", 1.0), ("tools", 1.0))),
                              400, seed=5)
    assert [(r.prompt_tokens, r.output_tokens) for r in mixed] == [(r.prompt_tokens, r.output_tokens)
                                                                   for r in plain]
    assert {r.feature for r in plain} == {"plain"}
    counts = {f: sum(r.feature == f for r in mixed) for f in ("plain", "json", "tools")}
    assert 160 < counts["plain"] < 240 and 70 < counts["json"] < 130 and 70 < counts["tools"] < 130
    only = generate_requests(WorkloadSpec(classes, features=(("json", 1.0),)), 5)
    assert {r.feature for r in only} == {"json"}
    with pytest.raises(ValueError, match="unknown request features"):
        WorkloadSpec(classes, features=(("lora", 1.0),))
