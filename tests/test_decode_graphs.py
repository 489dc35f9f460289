"""Decode steps through DecodeGraphs: padded batch and context buckets, static
input buffers, the scratch KV slot. Without a GPU the same padded forward runs
eagerly (use_cuda_graphs=False); the CUDA test captures real graphs."""

import pytest
import torch

from kvserve.contract import Request, SamplingParams
from kvserve.decode_graphs import DecodeGraphs, bucket_for, context_buckets
from kvserve.runner import build_step_batch
from kvserve.scheduler.scheduler import ScheduledChunk
from tests.test_model_reference import GREEDY, TINY_MODELS, assert_matches_hf
from tests.tiny_models import random_prompts, run_to_completion, tiny_engine


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_model(request):
    return TINY_MODELS[request.param]()


def static_graphs(engine, max_num_seqs: int = 64) -> DecodeGraphs:
    """The padded static-buffer decode path, run eagerly (any device)."""
    runner = engine.runner
    return DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                        scratch_slot=runner.scratch_slot, max_num_seqs=max_num_seqs,
                        max_model_len=runner.max_model_len, use_cuda_graphs=False)


def test_buckets():
    assert context_buckets(512) == (64, 128, 256, 512)
    assert context_buckets(600) == (64, 128, 256, 512, 600)
    assert context_buckets(40) == (40,)
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_padded_decode_logits_equal_the_eager_step(hf_model):
    """Three sequences (batch bucket 4: one padding row) of lengths on both sides
    of the 64-token context bucket, decoded once both ways."""
    engine = tiny_engine(hf_model)
    runner = engine.runner
    graphs = static_graphs(engine)
    prompts = random_prompts([5, 40, 70], seed=21)
    chunks, next_block = [], 0
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            request = Request(f"r{i}", prompt + [7], GREEDY, 0.0)
            blocks = list(range(next_block, next_block + len(prompt) // 4 + 2))
            next_block = blocks[-1] + 1
            prefill = ScheduledChunk(request, 0, len(prompt), blocks, samples=False)
            batch = build_step_batch([prefill], runner.block_size, runner.device)
            runner.model.forward(batch.token_ids, runner.kv_caches, batch.meta)
            chunks.append(ScheduledChunk(request, len(prompt), 1, blocks, samples=True))
        # The padded path first: if its padding wrote into a request's blocks, the
        # eager step after it would read the damage.
        padded = graphs.run(chunks).clone()
        batch = build_step_batch(chunks, runner.block_size, runner.device)
        eager = runner.model.compute_logits(runner.model.forward(batch.token_ids, runner.kv_caches, batch.meta))
    assert graphs.num_captured == 1 and (4, 128) in graphs._graphs
    assert padded.shape == eager.shape == (3, hf_model.config.vocab_size)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)


def test_engine_decodes_through_the_padded_path_with_the_same_tokens_as_hf(hf_model):
    # 5 sequences (bucket 8) whose contexts cross the 64-token bucket while decoding.
    prompts = random_prompts([3, 17, 50, 58, 9], seed=22)
    engine = tiny_engine(hf_model)
    engine.runner.decode_graphs = static_graphs(engine)
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert_matches_hf(hf_model, prompts, list(outputs.values()))
    assert {(8, 64), (8, 128)} <= set(engine.runner.decode_graphs._graphs)


def test_preempted_and_prefix_cached_requests_decode_correctly_through_the_padded_path(hf_model):
    prompts = random_prompts([20, 19, 18, 20], seed=15)
    engine = tiny_engine(hf_model, num_blocks=16, enable_prefix_caching=False)
    engine.runner.decode_graphs = static_graphs(engine)
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert engine.scheduler.stats().num_preemptions > 0
    assert_matches_hf(hf_model, prompts, list(outputs.values()))

    prefix = random_prompts([40], seed=14)[0]
    cached = [prefix + [3, 4, 5], prefix + [9]]
    engine = tiny_engine(hf_model)
    engine.runner.decode_graphs = static_graphs(engine)
    first = run_to_completion(engine, cached[:1], GREEDY)
    second = run_to_completion(engine, cached[1:], GREEDY)
    assert engine.scheduler.stats().prefix_cache_hits >= 36
    assert_matches_hf(hf_model, cached, list(first.values()) + list(second.values()))


def test_steps_the_graphs_cannot_take_run_eagerly(hf_model):
    """A prefill chunk in the step, or more sequences than the largest bucket."""
    engine = tiny_engine(hf_model, max_num_seqs=8)
    graphs = engine.runner.decode_graphs = static_graphs(engine, max_num_seqs=4)
    assert graphs.batch_buckets == (1, 2, 4)
    request = Request("a", [1, 2, 3], GREEDY, 0.0)
    decode = ScheduledChunk(request, 2, 1, [0], samples=True)
    assert graphs.accepts([decode] * 4)
    assert not graphs.accepts([decode] * 5)
    assert not graphs.accepts([decode, ScheduledChunk(request, 0, 3, [0], samples=True)])
    assert not graphs.accepts([ScheduledChunk(request, 0, 1, [0], samples=False)])
    prompts = random_prompts([6] * 6, seed=23)
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert_matches_hf(hf_model, prompts, list(outputs.values()))
    assert {batch for batch, _ in graphs._graphs} <= {1, 2, 4}


def test_sampled_and_seeded_requests_through_the_padded_path(hf_model):
    """The graph returns logits; sampling (seeds, top-k) is unchanged by it."""
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    prompts = random_prompts([9, 30, 4], seed=24)
    eager = run_to_completion(tiny_engine(hf_model), prompts, params)
    engine = tiny_engine(hf_model)
    engine.runner.decode_graphs = static_graphs(engine)
    padded = run_to_completion(engine, prompts, params)
    assert [o.token_ids for o in padded.values()] == [o.token_ids for o in eager.values()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_tokens_of_the_eager_engine_and_of_hf(hf_model):
    prompts = random_prompts([1, 5, 17, 64, 9, 33, 2, 48], seed=12)
    engine = tiny_engine(hf_model, device="cuda")
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.use_cuda_graphs
    graphed = run_to_completion(engine, prompts, GREEDY)
    assert engine.runner.decode_graphs.num_captured >= 1
    eager_engine = tiny_engine(hf_model, device="cuda", enforce_eager=True)
    assert eager_engine.runner.decode_graphs is None
    eager = run_to_completion(eager_engine, prompts, GREEDY)
    assert [o.token_ids for o in graphed.values()] == [o.token_ids for o in eager.values()]
    assert_matches_hf(hf_model, prompts, list(graphed.values()))
