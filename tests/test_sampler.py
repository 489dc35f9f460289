"""Sampler behaviour on hand-made logits over a small vocabulary."""

import math

import pytest
import torch

from kvserve.contract import Request, SamplingParams
from kvserve.model.sampler import Sampler

VOCAB = 16


def make_request(request_id: str, num_output_tokens: int = 0, eos_token_ids: tuple[int, ...] = (),
                 **params) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=1000, **params), 0.0,
                      eos_token_ids=eos_token_ids)
    request.output_token_ids.extend([5] * num_output_tokens)
    return request


def fixed_logits(num_rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    row = torch.randn(VOCAB, generator=generator) * 2.0
    return row.expand(num_rows, VOCAB).clone()


def draw(sampler: Sampler, logits_row: torch.Tensor, num_draws: int, **params) -> list[int]:
    requests = [make_request(f"r{i}", **params) for i in range(num_draws)]
    out = sampler.sample(logits_row.expand(num_draws, VOCAB).clone(), requests)
    return [out.token_ids[r.request_id] for r in requests]


def test_greedy_picks_the_argmax_per_row():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    requests = [make_request(f"r{i}") for i in range(4)]
    out = Sampler(device="cpu").sample(logits.clone(), requests)
    assert [out.token_ids[r.request_id] for r in requests] == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_k_most_likely_tokens():
    logits = fixed_logits(1)[0]
    allowed = set(logits.topk(3).indices.tolist())
    drawn = draw(Sampler(seed=1, device="cpu"), logits, 3000, temperature=1.5, top_k=3)
    assert set(drawn) == allowed  # all three reachable, nothing else


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / (VOCAB - 3)] * (VOCAB - 3))
    logits = probs.log()
    drawn = draw(Sampler(seed=2, device="cpu"), logits, 3000, temperature=1.0, top_p=0.75)
    assert set(drawn) == {0, 1}
    share_of_0 = drawn.count(0) / len(drawn)
    assert abs(share_of_0 - 0.5 / 0.8) < 0.05  # renormalised inside the nucleus


def test_temperature_sampling_follows_the_softmax():
    logits = fixed_logits(1)[0]
    temperature = 2.0
    drawn = draw(Sampler(seed=3, device="cpu"), logits, 8000, temperature=temperature)
    expected = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB).float() / len(drawn)
    # 8000 draws: a standard error under 0.006 per token.
    assert (counts - expected).abs().max() < 0.03


def test_seeded_request_is_independent_of_the_batch_around_it():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5))
    seeded = make_request("seeded", num_output_tokens=7, temperature=1.0, seed=42)
    alone = Sampler(seed=0, device="cpu").sample(logits[2:3].clone(), [seeded]).token_ids["seeded"]
    others = [make_request(f"o{i}", temperature=1.0) for i in range(4)]
    batch = others[:2] + [seeded] + others[2:]
    for sampler_seed in range(5):
        out = Sampler(seed=sampler_seed, device="cpu").sample(logits.clone(), batch)
        assert out.token_ids["seeded"] == alone


def test_seeded_tokens_vary_with_output_position():
    logits = torch.zeros(1, VOCAB)  # uniform: a fixed generator would repeat one token
    sampler = Sampler(device="cpu")
    requests = [make_request("s", num_output_tokens=n, temperature=1.0, seed=9) for n in range(40)]
    tokens = {sampler.sample(logits.clone(), [r]).token_ids["s"] for r in requests}
    assert len(tokens) > 5


def test_unseeded_sampling_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    draw(Sampler(seed=4, device="cpu"), fixed_logits(1)[0], 50, temperature=1.0, top_p=0.9)
    assert torch.equal(torch.get_rng_state(), state)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0  # EOS is by far the most likely
    logits[:, 8] = 9.0  # then a stop token
    logits[:, 9] = 9.5  # and the model's second EOS
    early = make_request("early", num_output_tokens=1, eos_token_ids=(7, 9), min_tokens=3, stop_token_ids=(8,))
    done = make_request("done", num_output_tokens=3, eos_token_ids=(7, 9), min_tokens=3, stop_token_ids=(8,))
    out = Sampler(device="cpu").sample(logits.clone(), [early, done])
    assert out.token_ids["early"] not in (7, 8, 9)
    assert out.token_ids["done"] == 7


def test_logprobs_are_of_the_raw_distribution_with_the_top_n():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    request = make_request("lp", temperature=0.5, top_k=2, logprobs=4, seed=1)
    out = Sampler(device="cpu").sample(logits.clone(), [request])
    record = out.logprobs["lp"]
    assert record.token_id == out.token_ids["lp"]
    top_ids = [t for t, _ in record.top]
    assert top_ids == logits[0].argsort(descending=True)[:4].tolist()
    # Raw distribution: temperature and top-k do not change the reported numbers,
    # and probabilities over the whole vocabulary would sum to one.
    values = [v for _, v in record.top]
    assert values == sorted(values, reverse=True)
    assert math.isclose(values[0] - values[1], float(logits[0, top_ids[0]] - logits[0, top_ids[1]]),
                        rel_tol=1e-4)
    assert sum(math.exp(v) for v in values) < 1.0
    assert record.logprob == pytest.approx(dict(record.top).get(record.token_id, record.logprob))


def test_requests_without_logprobs_get_none():
    out = Sampler(device="cpu").sample(torch.randn(1, VOCAB), [make_request("x")])
    assert out.logprobs == {}
