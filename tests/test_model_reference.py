"""kvserve's model and engine against Hugging Face transformers on the same weights.

Tiny random-weight Llama (plain and Llama-3 rope scaling) and Qwen2 models run
by default; the SmolLM2 default model has one default greedy test and slow
tests for batching, chunking, prefix caching and preemption.
"""

import os

import pytest
import torch

from kvserve.contract import Request, SamplingParams
from kvserve.runner.step_batch import build_step_batch
from kvserve.scheduler.scheduler import ScheduledChunk
from tests.tiny_models import (LLAMA3_ROPE, hf_greedy, random_prompts, run_to_completion, tiny_engine,
                               tiny_llama, tiny_qwen2)

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)

TINY_MODELS = {
    "llama": lambda: tiny_llama(seed=0),
    "llama3-rope": lambda: tiny_llama(seed=1, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "qwen2": lambda: tiny_qwen2(seed=2),
}


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def hf_model(request):
    return TINY_MODELS[request.param]()


def assert_matches_hf(hf, prompts, outputs, max_new_tokens=MAX_NEW_TOKENS):
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf, prompt, max_new_tokens), f"prompt of {len(prompt)} tokens"


def test_first_step_logits_match_hf(hf_model):
    engine = tiny_engine(hf_model)
    prompt = random_prompts([37], seed=10)[0]
    runner = engine.runner
    request = Request("x", prompt, GREEDY, 0.0)
    chunk = ScheduledChunk(request, 0, len(prompt), list(range(10)), samples=True)
    batch = build_step_batch([chunk], runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model.forward(batch.token_ids, runner.kv_caches, batch.meta)
        logits = runner.model.compute_logits(hidden)  # every position, not only the sampled one
        expected = hf_model(torch.tensor([prompt])).logits[0]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits.cpu(), expected, atol=1e-3, rtol=0)


def test_one_prompt_greedy_matches_hf(hf_model):
    prompt = random_prompts([23], seed=11)[0]
    outputs = run_to_completion(tiny_engine(hf_model), [prompt], GREEDY)
    assert_matches_hf(hf_model, [prompt], list(outputs.values()))


def test_batch_of_mixed_lengths_matches_hf(hf_model):
    prompts = random_prompts([1, 5, 17, 64, 9, 33, 2, 48], seed=12)
    outputs = run_to_completion(tiny_engine(hf_model), prompts, GREEDY)
    assert_matches_hf(hf_model, prompts, list(outputs.values()))


def test_chunked_prefill_under_a_32_token_budget_matches_hf(hf_model):
    prompts = random_prompts([90, 45, 7], seed=13)
    engine = tiny_engine(hf_model, max_num_batched_tokens=32)
    requests = [engine.new_request(p, GREEDY) for p in prompts]
    for r in requests:
        engine.add_request(r)
    final, step_sizes = {}, []
    while engine.has_unfinished():
        result = engine.step()
        final.update({o.request_id: o for o in result.outputs if o.finished})
        step_sizes.append(result.scheduled.num_batched_tokens)
    # The 90-token prompt can only have run in chunks of at most 32 tokens.
    assert max(step_sizes) == 32
    assert_matches_hf(hf_model, prompts, [final[r.request_id] for r in requests])


def test_prefix_cache_hit_gives_the_same_tokens(hf_model):
    prefix = random_prompts([40], seed=14)[0]
    prompts = [prefix + [3, 4, 5], prefix + [9]]
    engine = tiny_engine(hf_model)
    first = run_to_completion(engine, prompts[:1], GREEDY)
    second = run_to_completion(engine, prompts[1:], GREEDY)
    (out,) = second.values()
    assert out.num_cached_tokens >= 36  # 9 full blocks of 4 tokens of the shared prefix
    assert engine.scheduler.stats().prefix_cache_hits >= 36
    assert_matches_hf(hf_model, prompts, list(first.values()) + [out])


def test_forced_preemption_gives_the_same_tokens(hf_model):
    # 4 requests of 20 + 12 tokens need 8 blocks each; 16 blocks hold two.
    prompts = random_prompts([20, 19, 18, 20], seed=15)
    engine = tiny_engine(hf_model, num_blocks=16, enable_prefix_caching=False)
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert engine.scheduler.stats().num_preemptions > 0
    assert_matches_hf(hf_model, prompts, list(outputs.values()))


# ---- the SmolLM2 default model --------------------------------------------------

SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
                "1, 2, 3, 4,", "Water boils at", "The quick brown fox",
                "In machine learning, a transformer is", "Hello"]


@pytest.fixture(scope="module")
def smol():
    """(kvserve LLM, HF model) over the embedded SmolLM2 GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from kvserve import LLM
    from kvserve.model_facts.default_model import default_model_path

    path = default_model_path()
    llm = LLM(kv_cache_memory="256MiB", device="cpu", quantization="none")  # the float reference path
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return llm, hf


def smol_greedy(llm, hf, prompts, max_new_tokens):
    """kvserve's and HF's greedy tokens; HF's are cut after its first EOS like kvserve's."""
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outputs = llm.generate(ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    expected = [hf_greedy_until_eos(hf, prompt, max_new_tokens, llm.tokenizer.eos_token_id) for prompt in ids]
    return [o.token_ids for o in outputs], expected


def hf_greedy_until_eos(hf, prompt, max_new_tokens, eos_token_id):
    tokens = hf_greedy(hf, prompt, max_new_tokens)
    return tokens[:tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens


def test_smollm2_greedy_and_logits_match_hf(smol):
    llm, hf = smol
    got, expected = smol_greedy(llm, hf, SMOL_PROMPTS[:1], 10)
    assert got == expected
    prompt = llm.tokenizer.encode(SMOL_PROMPTS[0])
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0]
    with torch.no_grad():
        expected_logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == expected_logprobs.topk(5).indices.tolist()
    for token_id, value in top:
        assert abs(value - float(expected_logprobs[token_id])) < 1e-3


@pytest.mark.slow
def test_smollm2_batch_of_8_matches_hf(smol):
    got, expected = smol_greedy(*smol, SMOL_PROMPTS, 24)
    assert got == expected


@pytest.mark.slow
def test_smollm2_chunked_prefix_cached_and_preempted_match_hf(smol):
    llm, hf = smol
    long_prefix = " ".join(SMOL_PROMPTS) * 2
    other_long = " ".join(reversed(SMOL_PROMPTS)) * 2
    prompts = [long_prefix + " Summary:", long_prefix + " In short,", other_long, "Tell me a joke."]
    # A small engine over the same weights: a 32-token budget and a 12-block cache
    # that holds one long prompt (about 150 tokens with its output) but not two.
    from kvserve.engine.core import EngineConfig, EngineCore
    from kvserve.model.loader import load_model

    loaded = load_model(None)
    engine = EngineCore(loaded.config, loaded.weights, loaded.tokenizer,
                        EngineConfig(kv_cache_memory_bytes=12 * 16 * loaded.config.kv_bytes_per_token(4),
                                     max_num_batched_tokens=32, device="cpu", kv_cache_dtype="float32"),
                        versions=loaded.versions)
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    first = run_to_completion(engine, ids[:1], params)
    rest = run_to_completion(engine, ids[1:], params)
    outputs = list(first.values()) + list(rest.values())
    assert outputs[1].num_cached_tokens > 0
    assert engine.scheduler.stats().num_preemptions > 0
    for prompt, output in zip(ids, outputs):
        assert output.token_ids == hf_greedy_until_eos(hf, prompt, 16, loaded.tokenizer.eos_token_id)
