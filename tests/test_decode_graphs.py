"""Decode steps through DecodeGraphs: padded batch and context buckets, static
input buffers, the scratch KV slot. Without a GPU the same padded forward runs
eagerly (use_cuda_graphs=False); the CUDA test captures real graphs."""

import pytest
import torch

from kvserve.contract import Request, SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.runner import decode_graphs
from kvserve.runner.decode_graphs import DecodeGraphs, bucket_for, context_buckets
from kvserve.runner.step_batch import build_step_batch
from kvserve.scheduler.scheduler import ScheduledChunk
from tests.test_model_reference import GREEDY, TINY_MODELS, assert_matches_hf
from tests.tiny_models import hf_greedy, random_prompts, run_to_completion, tiny_engine


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_model(request):
    return TINY_MODELS[request.param]()


def static_graphs(engine, max_num_seqs: int = 64) -> DecodeGraphs:
    """The padded static-buffer decode path, run eagerly (any device)."""
    runner = engine.runner
    return DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                        scratch_slot=runner.scratch_slot, max_num_seqs=max_num_seqs,
                        max_model_len=runner.max_model_len, use_cuda_graphs=False)


def run_staggered(engine, prompts, max_tokens):
    """Greedy requests ending at different steps, so the batch shrinks through
    several sizes; request_id -> token ids."""
    requests = [engine.new_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, max_tokens)]
    for request in requests:
        engine.add_request(request)
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step().outputs if o.finished})
    return [final[r.request_id] for r in requests]


def assert_staggered_match_hf(hf, prompts, max_tokens, outputs):
    for prompt, n, tokens in zip(prompts, max_tokens, outputs):
        assert tokens == hf_greedy(hf, prompt, n), f"prompt of {len(prompt)} tokens, {n} new"


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
    # Six requests ending two steps apart: 6 and 5 decode eagerly, 4..1 through graphs.
    prompts = random_prompts([6] * 6, seed=23)
    max_tokens = [2, 4, 6, 8, 10, 12]
    outputs = run_staggered(engine, prompts, max_tokens)
    assert_staggered_match_hf(hf_model, prompts, max_tokens, outputs)
    assert {batch for batch, _ in graphs._graphs} == {1, 2, 4}


def test_contexts_past_the_graph_limit_decode_eagerly(hf_model, monkeypatch):
    monkeypatch.setattr(decode_graphs, "MAX_GRAPH_CONTEXT", 64)
    engine = tiny_engine(hf_model)
    graphs = engine.runner.decode_graphs = static_graphs(engine)
    assert graphs.context_buckets == (64,)
    # Contexts 59..70 and 10..21: the long one leaves the graphs at position 64.
    prompts = random_prompts([58, 9], seed=25)
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert_matches_hf(hf_model, prompts, list(outputs.values()))
    assert set(graphs._graphs) == {(2, 64)}
    request = Request("a", [1] * 70, GREEDY, 0.0)
    assert not graphs.accepts([ScheduledChunk(request, 64, 1, list(range(17)), samples=True)])


def test_steps_that_capture_a_graph_are_flagged_and_left_out_of_the_warm_up_fit(hf_model):
    engine = tiny_engine(hf_model)
    graphs = engine.runner.decode_graphs = static_graphs(engine)
    captured = []
    for prompt, max_tokens in zip(random_prompts([5, 9, 58], seed=26), [3, 6, 12]):
        engine.add_request(engine.new_request(
            prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished():
        captured.append(engine.step().captured_graph)
    # (4, 64) at 3 sequences, (2, 64), (1, 64), then (1, 128) past position 63:
    # exactly the steps that captured are flagged.
    assert set(graphs._graphs) == {(4, 64), (2, 64), (1, 64), (1, 128)}
    assert sum(captured) == 4 and len(captured) > 4
    # The warm-up times the same steps with and without graphs; with them, the
    # steps that captured are not measured.
    plain = AsyncEngine(tiny_engine(hf_model)).warm_up()
    engine = tiny_engine(hf_model)
    graphs = engine.runner.decode_graphs = static_graphs(engine)
    graphed = AsyncEngine(engine).warm_up()
    assert graphs.num_captured > 0
    assert len(graphed) == len(plain) - graphs.num_captured


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
    # Staggered ends: the batch shrinks 8 -> 1 through padded buckets (5 -> 8,
    # 3 -> 4), and the long prompt crosses from the 64- to the 128-token bucket.
    prompts = random_prompts([1, 5, 17, 60, 9, 33, 2, 48], seed=12)
    max_tokens = [2, 3, 5, 12, 7, 4, 9, 6]
    engine = tiny_engine(hf_model, device="cuda")
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.use_cuda_graphs
    graphed = run_staggered(engine, prompts, max_tokens)
    assert {(8, 64), (4, 128), (1, 128)} <= set(engine.runner.decode_graphs._graphs)
    eager_engine = tiny_engine(hf_model, device="cuda", enforce_eager=True)
    assert eager_engine.runner.decode_graphs is None
    assert run_staggered(eager_engine, prompts, max_tokens) == graphed
    assert_staggered_match_hf(hf_model, prompts, max_tokens, graphed)


def test_a_failing_or_unfit_attention_kernel_falls_back_to_the_torch_path(monkeypatch, caplog):
    """attention._cuda_decode_attention: None (the torch path) for shapes the kernel
    refuses, and for good after its first failure, with one log line."""
    from types import SimpleNamespace

    from kvserve.model import attention

    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("Triton could not build its launcher")

    kernel = SimpleNamespace(supports=lambda q, kv, slots: q.shape[-1] == 64, decode_attention=failing)
    monkeypatch.setattr(attention, "_triton_kernel", lambda: kernel)
    monkeypatch.setattr(attention, "_triton_failed", False)
    meta = SimpleNamespace(context_slots=torch.zeros(1, 4, dtype=torch.int64),
                           context_lens=torch.ones(1, dtype=torch.int64))
    kv_cache = torch.zeros(8, 2, 1, 64)
    assert attention._cuda_decode_attention(torch.zeros(1, 2, 32), kv_cache, meta, 0.1) is None
    assert calls == []  # refused by supports(), never launched
    assert attention._cuda_decode_attention(torch.zeros(1, 2, 64), kv_cache, meta, 0.1) is None
    assert attention._cuda_decode_attention(torch.zeros(1, 2, 64), kv_cache, meta, 0.1) is None
    assert len(calls) == 1  # disabled after the first failure
    assert sum("Triton decode attention failed" in r.message for r in caplog.records) == 1
    monkeypatch.setenv("KVSERVE_TORCH_ATTENTION", "1")
    monkeypatch.setattr(attention, "_triton_failed", False)
    assert attention._cuda_decode_attention(torch.zeros(1, 2, 64), kv_cache, meta, 0.1) is None
    assert len(calls) == 1
