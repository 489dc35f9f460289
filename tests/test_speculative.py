"""Speculative decoding end to end on tiny random models: greedy output is
token-identical with and without it (both proposers; batches, chunked
prefill, prefix hits, preemption), sampled output keeps the target's
distribution under the exact rule (and a naive rule is caught), stops stay
exact when several tokens land at once, and the counters say what ran."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.contract import SamplingParams
from tests.tiny_models import (TINY_DIMS, random_prompts, run_to_completion, tiny_engine, tiny_llama, weights_of,
                                word_tokenizer)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def folders(hf, tmp_path_factory):
    """The target, and a draft that agrees with it often but not always (the
    target's weights perturbed), saved as HF folders."""
    out = {}
    for name, model in (("target", hf), ("near", perturbed(hf, 0.3, seed=1))):
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(folder, safe_serialization=True)
        word_tokenizer()._backend.save(str(folder / "tokenizer.json"))
        out[name] = str(folder)
    return out


def repetitive_prompts(lengths, seed=0):
    """Prompts whose second half repeats the first: prompt lookup finds drafts."""
    return [p + p for p in random_prompts([n // 2 for n in lengths], seed=seed)]


def token_ids(results) -> list[list[int]]:
    return [o.token_ids for o in results.values()]


def run(hf, prompts, params, spec=None, **fields):
    engine = tiny_engine(hf, speculative_config=spec, **fields)
    results = run_to_completion(engine, prompts, params)
    engine.scheduler.kv_cache.check_integrity()
    assert engine.scheduler.kv_cache.usage() == 0
    return engine, results


GREEDY_CASES = {
    "single": dict(lengths=[24], fields={}),
    "mixed batch": dict(lengths=[8, 30, 17, 44, 12], fields={}),
    "chunked prefill": dict(lengths=[40, 22, 60], fields={"max_num_batched_tokens": 7}),
    "preemption": dict(lengths=[30, 28, 26, 24], fields={"num_blocks": 40}),
    # verification in the one native decode call (quantized weights)
    "quantized": dict(lengths=[8, 30, 17], fields={"quantization": "q8_0"}),
}


@pytest.mark.parametrize("case", GREEDY_CASES, ids=list(GREEDY_CASES))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_token_identical_with_speculation(hf, folders, case, method):
    lengths, fields = GREEDY_CASES[case]["lengths"], GREEDY_CASES[case]["fields"]
    prompts = repetitive_prompts(lengths)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = NGRAM if method == "ngram" else {**NGRAM, "method": "draft_model", "model": folders["near"]}
    plain_engine, plain = run(hf, prompts, params, **fields)
    engine, speculated = run(hf, prompts, params, spec, **fields)
    assert token_ids(speculated) == token_ids(plain)
    totals = engine.speculator.totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0  # speculation did run, and paid
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0


def test_greedy_output_is_identical_across_prefix_cache_hits(hf):
    shared = random_prompts([16], seed=3)[0]
    prompts = [shared + p for p in repetitive_prompts([10, 14, 18], seed=4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, plain = run(hf, prompts, params)
    engine = tiny_engine(hf, speculative_config=NGRAM)
    first = run_to_completion(engine, prompts, params)
    again = run_to_completion(engine, prompts, params)
    assert engine.scheduler.kv_cache.prefix_cache_hits > 0
    assert token_ids(first) == token_ids(plain) == token_ids(again)


def test_a_draft_identical_to_the_target_accepts_every_token(hf, folders):
    prompts = random_prompts([12, 20])
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    spec = {**NGRAM, "method": "draft_model", "model": folders["target"]}
    _, plain = run(hf, prompts, params)
    engine, speculated = run(hf, prompts, params, spec)
    assert token_ids(speculated) == token_ids(plain)
    totals = engine.speculator.totals
    assert totals.num_draft_tokens > 0
    assert totals.num_accepted_tokens == totals.num_draft_tokens


def test_a_quantized_gguf_draft_computes_quantized_like_the_target(tmp_path):
    """A draft model given as a Q8_0 GGUF, under the target's quantization
    "auto" (the default), keeps the file's blocks: its resident weights are
    under a third of the float32 draft's that quantization "none" loads, its
    decode steps run the one native call, and greedy output is still the
    target's own."""
    import gguf

    from tests.test_loader import _randomize, tiny_hf_model, write_tiny_gguf

    target = tiny_hf_model("llama")
    _randomize(target)
    path = tmp_path / "draft-q8_0.gguf"
    write_tiny_gguf(path, target, gguf.GGMLQuantizationType.Q8_0)
    spec = {**NGRAM, "method": "draft_model", "model": str(path)}
    prompts = random_prompts([12, 20, 9], vocab_size=target.config.vocab_size)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, plain = run(target, prompts, params)
    engine, speculated = run(target, prompts, params, spec)
    float_engine, float_speculated = run(target, prompts, params, spec, quantization="none")
    draft, float_draft = engine.speculator.draft_model.draft, float_engine.speculator.draft_model.draft
    assert "q8_0" in draft.model.weight_formats() and draft.model.native_decode is not None
    assert set(float_draft.model.weight_formats()) == {"float32"}
    assert draft.weight_bytes < float_draft.weight_bytes / 3
    assert engine.memory_bytes()["weights"] == engine.runner.weight_bytes + draft.weight_bytes
    assert token_ids(speculated) == token_ids(plain) == token_ids(float_speculated)
    assert engine.speculator.totals.num_accepted_tokens > 0


def test_seeded_sampled_output_does_not_depend_on_the_batch(hf, folders):
    prompt = repetitive_prompts([20], seed=5)[0]
    params = SamplingParams(max_tokens=30, temperature=0.3, seed=7, ignore_eos=True)
    for spec in (NGRAM, {**NGRAM, "method": "draft_model", "model": folders["near"]}):
        _, alone = run(hf, [prompt], params, spec)
        engine = tiny_engine(hf, speculative_config=spec)
        mine = engine.new_request(prompt, params)
        others = [engine.new_request(p, SamplingParams(max_tokens=20, temperature=0.5, ignore_eos=True))
                  for p in repetitive_prompts([9, 31, 14], seed=6)]
        for request in [*others[:2], mine, others[2]]:
            engine.add_request(request)
        while engine.has_unfinished():
            engine.step()
        assert mine.output_token_ids == list(alone.values())[0].token_ids
        assert engine.speculator.totals.num_accepted_tokens > 0


# -- stops stay exact when several tokens are accepted at once --------------------

def accepting_engine(hf, folders, **fields):
    """Speculation with the target as its own draft: every draft is accepted,
    so each verification appends k + 1 tokens and any stop lands mid-draft."""
    return tiny_engine(hf, speculative_config={**NGRAM, "method": "draft_model", "model": folders["target"]},
                       **fields)


def test_stop_token_and_max_tokens_cut_a_multi_token_step(hf, folders):
    prompt = random_prompts([10], seed=8)[0]
    free = run_to_completion(tiny_engine(hf), [prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    reference = list(free.values())[0].token_ids
    stop_token = reference[6]
    first_stop = reference.index(stop_token)
    for params, expected, reason in (
            (SamplingParams(max_tokens=30, stop_token_ids=[stop_token]), reference[:first_stop + 1], "stop"),
            (SamplingParams(max_tokens=7, ignore_eos=True), reference[:7], "length")):
        engine = accepting_engine(hf, folders)
        out = list(run_to_completion(engine, [prompt], params).values())[0]
        assert out.token_ids == expected and out.finish_reason == reason
        assert engine.speculator.totals.num_accepted_tokens > 0
        assert len(out.timestamps.token_times) == len(expected)


def test_stop_string_inside_accepted_drafts_ends_the_text_there(hf, folders):
    prompt = random_prompts([10], seed=9)[0]
    reference = list(run_to_completion(tiny_engine(hf), [prompt],
                                       SamplingParams(max_tokens=30, ignore_eos=True)).values())[0]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[f" t{reference.token_ids[5]} "])
    plain = list(run_to_completion(tiny_engine(hf), [prompt], params).values())[0]
    engine = accepting_engine(hf, folders)
    out = list(run_to_completion(engine, [prompt], params).values())[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 30
    assert out.token_ids == plain.token_ids and out.text == plain.text and out.finish_reason == "stop"
    assert len(out.timestamps.token_times) == len(out.token_ids)
    assert engine.speculator.totals.num_accepted_tokens > 0


def test_logprobs_are_exact_for_every_accepted_token(hf, folders):
    prompt = random_prompts([12], seed=10)[0]
    params = SamplingParams(max_tokens=15, ignore_eos=True, logprobs=3)
    plain = list(run_to_completion(tiny_engine(hf), [prompt], params).values())[0]
    engine = accepting_engine(hf, folders)
    out = list(run_to_completion(engine, [prompt], params).values())[0]
    assert engine.speculator.totals.num_accepted_tokens > 0
    assert out.token_ids == plain.token_ids
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for mine, reference in zip(out.logprobs, plain.logprobs):
        assert mine.logprob == pytest.approx(reference.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in reference.top]


def test_streamed_deltas_add_up_with_multi_token_steps(hf, folders):
    engine = accepting_engine(hf, folders)
    request = engine.new_request(random_prompts([10], seed=11)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request(request)
    tokens, text, sizes = [], "", []
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens += output.new_token_ids
            text += output.new_text
            sizes.append(len(output.new_token_ids))
    assert max(sizes) > 1
    assert tokens == output.token_ids and text == output.text


# -- the distribution of sampled tokens -------------------------------------------

SMALL_VOCAB = 8


def small_vocab_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    dims = {**TINY_DIMS, "vocab_size": SMALL_VOCAB, "initializer_range": 0.08}
    return LlamaForCausalLM(LlamaConfig(**dims, eos_token_id=None, bos_token_id=None,
                                        pad_token_id=None)).eval()


def target_marginals(model, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """The target's exact distributions of output tokens 1, 2 and 3 (marginal
    over the tokens before), by enumerating every prefix."""
    marginals = []
    prefixes, weights = [prompt], torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()
            probs = torch.softmax(logits / temperature, dim=-1)  # [P, V]
            marginals.append((weights[:, None] * probs).sum(0))
            weights = (weights[:, None] * probs).reshape(-1)
            prefixes = [p + [t] for p in prefixes for t in range(SMALL_VOCAB)]
    return marginals


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def naive_rule(self, request, draft, p, q):
    """The naive rule: accept a draft when it is the target's argmax, else
    draw from the target. It skews output towards the argmax whenever the
    drafts are random: the distribution test must catch it."""
    from kvserve.runner.rejection_sampler import Verified

    position = request.num_output_tokens
    for j, token in enumerate(draft):
        if token != int(p[j].argmax()):
            return Verified(j, self._draw(p[j], self.sampler.generator_at(request, position + j)))
    return Verified(len(draft), self._draw(p[len(draft)], self.sampler.generator_at(request, position + len(draft))))


def sampled_token_counts(target, draft_folder, prompt, num_draws: int) -> list[torch.Tensor]:
    """Counts of output tokens 1..3 over `num_draws` seeded requests (token 1
    from the prefill; 2 and 3 through one verification of 2 drafts, whose
    bonus token is the 4th)."""
    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 2,
            "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    engine = tiny_engine(target, speculative_config=spec, max_num_seqs=512, max_num_batched_tokens=4096,
                         num_blocks=2048)
    requests = [engine.new_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=seed,
                                                          ignore_eos=True)) for seed in range(num_draws)]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator.totals.num_drafts >= num_draws  # every 2nd token came from a verification
    counts = []
    for position in range(3):
        tokens = torch.tensor([r.output_token_ids[position] for r in requests])
        counts.append(torch.bincount(tokens, minlength=SMALL_VOCAB).double())
    return counts


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with noise of `scale` x each weight's std added: a
    draft that agrees with it often, not always."""
    import copy

    copy_ = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in copy_.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    return copy_


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    target = small_vocab_llama(0)
    draft = perturbed(target, 0.5, seed=1)
    folder = tmp_path_factory.mktemp("small-vocab-draft")
    draft.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(SMALL_VOCAB)._backend.save(str(folder / "tokenizer.json"))
    return target, str(folder)


def test_speculative_sampling_keeps_the_target_distribution(small_models, monkeypatch):
    """Chi-square over 1500 seeded draws: tokens 2 and 3 (drawn through the
    exact rule with a different random draft model) follow the target's
    marginals; the same draws under the naive rule (`naive_rule`) do not."""
    target, draft_folder = small_models
    prompt = [1, 5, 2, 7, 3]
    expected = target_marginals(target, prompt, temperature=1.0)
    counts = sampled_token_counts(target, draft_folder, prompt, 1500)
    for position in range(3):
        assert chi_square_p_value(counts[position], expected[position]) > 1e-3, position
    from kvserve.runner.rejection_sampler import RejectionSampler

    monkeypatch.setattr(RejectionSampler, "_verify_sampled", naive_rule)
    naive = sampled_token_counts(target, draft_folder, prompt, 1500)
    assert min(chi_square_p_value(naive[p], expected[p]) for p in (1, 2)) < 1e-6


def test_speculative_config_takes_vllms_keys_and_names_bad_ones():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 5)
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "x"}).model == "x"
    for bad, words in (('{"method": "eagle"}', "method"), ('{"num_speculative_token": 3}', "unknown"),
                       ('{"method": "draft_model"}', "model"), ("{oops", "JSON"),
                       ('{"num_speculative_tokens": "4"}', "speculative config"), ("[1]", "object")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    assert math.isclose(SpeculativeConfig().min_acceptance_rate, 0.25)
    assert SpeculativeConfig().disable_by_batch_size is None


def test_a_requests_draft_stream_is_independent_of_its_target_stream():
    """The draft model draws with another stream of the request's seed; a CPU
    generator keeps only 32 bits of its seed, so the streams must differ
    there (with the same draws, a draft and the target's residual draw are
    correlated and the naive rule goes unnoticed)."""
    from kvserve.contract import Request
    from kvserve.model.sampler import Sampler
    from kvserve.runner.draft_model import DRAFT_STREAM

    sampler = Sampler()
    request = Request("r", [1], SamplingParams(temperature=1.0, seed=3), 0.0)
    target = torch.rand(8, generator=sampler.generator_at(request, 5))
    draft = torch.rand(8, generator=sampler.generator_at(request, 5, DRAFT_STREAM))
    assert torch.equal(target, torch.rand(8, generator=sampler.generator_at(request, 5)))
    assert not torch.allclose(target, draft)


# -- sleep and wake with a draft model ---------------------------------------------

@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_draft_models_kv_cache_too_and_wakes_to_the_same_output(hf, folders, level):
    prompt = random_prompts([12], seed=9)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = accepting_engine(hf, folders)
    before = list(run_to_completion(engine, [prompt], params).values())[0].token_ids
    draft = engine.speculator.draft_model.draft
    draft_kv_bytes = draft.kv_cache.numel() * draft.kv_cache.element_size()
    target_kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    assert engine.sleep(level) >= target_kv_bytes + draft_kv_bytes
    assert draft.kv_cache.numel() == 0  # the draft's cache went with the target's
    engine.wake_up(weights_of(hf) if level == 2 else None)
    accepted = engine.speculator.totals.num_accepted_tokens
    after = list(run_to_completion(engine, [prompt], params).values())[0].token_ids
    assert after == before
    assert engine.speculator.totals.num_accepted_tokens > accepted  # the draft drafts again after the wake
    assert engine.speculator.draft_model.sampler is engine.runner.sampler  # one seed rule, the new runner's


def test_automatic_kv_sizing_leaves_room_for_the_draft_models_weights_and_cache(hf, folders, monkeypatch):
    """--kv-cache-memory auto with a draft model: both models' resident
    weights and both caches fit the engine's memory, with no block more to
    spare, and the target keeps less than half the blocks it has alone (the
    draft's cache takes half, its weights some more)."""
    import kvserve.runner.model_runner as model_runner

    engine_memory = 8 * 2**20  # a tiny model's scale: the real 1.5 GiB would be ~750k tiny blocks
    monkeypatch.setattr(model_runner, "AUTO_ENGINE_MEMORY_BYTES", engine_memory)
    monkeypatch.setattr(model_runner, "MIN_AUTO_KV_BYTES", 2**20)
    alone = tiny_engine(hf, num_blocks=None)
    engine = tiny_engine(hf, num_blocks=None, speculative_config={**NGRAM, "method": "draft_model",
                                                                   "model": folders["near"]})
    target, draft = engine.runner, engine.speculator.draft_model.draft
    assert draft.weight_bytes > 0 and engine.memory_bytes()["weights"] == target.weight_bytes + draft.weight_bytes
    weights, blocks = engine.memory_bytes()["weights"], engine.num_kv_blocks
    per_block = target.kv_bytes_per_block + draft.kv_bytes_per_block
    assert draft.num_blocks == blocks == engine.scheduler.kv_cache.num_blocks
    assert weights + blocks * per_block <= engine_memory < weights + (blocks + 1) * per_block
    assert blocks < alone.num_kv_blocks // 2
    assert draft.kv_cache.shape[1] == blocks * draft.block_size + 1  # the draft's cache holds them all
    prompts = repetitive_prompts([20])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert token_ids(run_to_completion(engine, prompts, params)) == token_ids(run_to_completion(alone, prompts, params))
    assert engine.speculator.totals.num_accepted_tokens > 0


def test_the_kv_budget_pays_for_the_draft_models_cache_too(hf, folders, caplog):
    """--kv-cache-memory covers the draft model's cache as well as the
    target's: both hold the same number of blocks, split by bytes per block
    (the tiny draft has the target's shape: half the blocks each), and the
    start-up log states the split."""
    from kvserve.runner.model_runner import kv_bytes_per_block

    spec = {**NGRAM, "method": "draft_model", "model": folders["near"]}
    with caplog.at_level("INFO", logger="kvserve.engine.core"):
        engine = tiny_engine(hf, speculative_config=spec, num_blocks=64)
    target, draft = engine.runner, engine.speculator.draft_model.draft
    budget = engine.config.kv_cache_memory_bytes
    target_block = kv_bytes_per_block(target.config, target.block_size, target.dtype)
    draft_block = kv_bytes_per_block(draft.config, draft.block_size, draft.dtype)
    assert budget == 64 * target_block and draft_block == target_block
    assert target.num_blocks == draft.num_blocks == 32 == engine.scheduler.kv_cache.num_blocks
    assert target.num_blocks * target_block + draft.num_blocks * draft_block <= budget
    assert engine.memory_bytes()["kv_cache"] == sum(r.kv_cache.numel() * r.kv_cache.element_size()
                                                    for r in (target, draft))  # both caches resident
    split = [r.getMessage() for r in caplog.records if "shared by the target and its draft model" in r.getMessage()]
    mib = target_block * 32 / 2**20
    assert split == [f"KV cache budget {2 * mib:.1f} MiB shared by the target and its draft model: target "
                     f"{mib:.1f} MiB, draft {mib:.1f} MiB, 32 blocks of 4 tokens each"]
    prompts = repetitive_prompts([20])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert token_ids(run_to_completion(engine, prompts, params)) == token_ids(run(hf, prompts, params)[1])
