"""Sampler behaviour on hand-made logits over a small vocabulary."""

import math

import pytest
import torch

from kvserve.contract import Request, SamplingParams
from kvserve.model.sampler import Sampler, SamplingState

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


# -- logit_bias and penalties (SamplingState carries their per-request state) --

def stateful(request_id: str, prompt: list[int], output: list[int], **params):
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=1000, **params), 0.0)
    request.output_token_ids.extend(output)
    return request, SamplingState()


@pytest.fixture(scope="module")
def tiny_model_logits():
    """Real logits of a tiny random model (vocab 256) for a few prompts: [3, 256]."""
    from tests.tiny_models import tiny_llama

    model = tiny_llama(seed=11)
    ids = torch.tensor([[3, 17, 17, 40, 9], [200, 1, 2, 3, 4], [9, 9, 9, 9, 9]])
    with torch.no_grad():
        return model(ids).logits[:, -1].float()


def test_presence_and_frequency_penalties_match_the_openai_formula(tiny_model_logits):
    logits = tiny_model_logits
    outputs = [[5, 5, 7, 9], [], [9, 9, 9]]
    params = [dict(presence_penalty=0.7, frequency_penalty=0.4), dict(frequency_penalty=1.5),
              dict(presence_penalty=-0.5, frequency_penalty=-0.25)]
    requests, states = zip(*(stateful(f"r{i}", [1, 2], out, **p) for i, (out, p) in enumerate(zip(outputs, params))))
    got = Sampler(device="cpu").process_logits(logits.clone(), list(requests),
                                               {r.request_id: s for r, s in zip(requests, states)})
    expected = logits.clone()
    for row, (out, p) in enumerate(zip(outputs, params)):
        for token in set(out):  # hand-computed: mu - c * freq - (c > 0) * presence
            expected[row, token] -= out.count(token) * p.get("frequency_penalty", 0.0)
            expected[row, token] -= p.get("presence_penalty", 0.0)
    torch.testing.assert_close(got, expected)


def test_penalty_counts_follow_the_output_as_it_grows(tiny_model_logits):
    logits = tiny_model_logits[:1]
    request, state = stateful("r", [1], [], frequency_penalty=1.0)
    sampler = Sampler(device="cpu")
    for new_tokens in ([4], [4, 8], [8]):  # tokens appended between steps
        request.output_token_ids.extend(new_tokens)
        got = sampler.process_logits(logits.clone(), [request], {"r": state})
        expected = logits.clone()
        for token in set(request.output_token_ids):
            expected[0, token] -= request.output_token_ids.count(token)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hugging_face(tiny_model_logits, penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    prompts = [[3, 17, 17, 40], [200, 1], [9]]
    outputs = [[5, 40], [], [9, 12, 12]]
    requests, states = zip(*(stateful(f"r{i}", p, o, repetition_penalty=penalty)
                             for i, (p, o) in enumerate(zip(prompts, outputs))))
    got = Sampler(device="cpu").process_logits(tiny_model_logits.clone(), list(requests),
                                               {r.request_id: s for r, s in zip(requests, states)})
    reference = RepetitionPenaltyLogitsProcessor(penalty)
    for row, (p, o) in enumerate(zip(prompts, outputs)):
        expected = reference(torch.tensor([p + o]), tiny_model_logits[row:row + 1].clone())
        torch.testing.assert_close(got[row:row + 1], expected)
    assert not torch.equal(got, tiny_model_logits)


def test_logit_bias_adds_to_the_named_tokens_only(tiny_model_logits):
    bias = {"3": 5.0, 100: -100.0}
    request, state = stateful("b", [1], [], logit_bias=bias)
    plain = Request("p", [1], SamplingParams(), 0.0)
    logits = tiny_model_logits[:2]
    got = Sampler(device="cpu").process_logits(logits.clone(), [request, plain], {"b": state})
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 100] -= 100.0
    torch.testing.assert_close(got, expected)


def test_bias_of_minus_100_bans_and_plus_100_forces_a_token():
    logits = fixed_logits(1)[0]
    favourite = int(logits.argmax())
    sampler = Sampler(seed=5, device="cpu")
    for bias, check in ((-100.0, lambda drawn: favourite not in drawn),
                        (100.0, lambda drawn: set(drawn) == {3})):
        token = favourite if bias < 0 else 3
        requests = [make_request(f"r{i}", temperature=1.5, seed=i, logit_bias={token: bias}) for i in range(2000)]
        out = sampler.sample(logits.expand(len(requests), VOCAB).clone(), requests,
                             {r.request_id: SamplingState() for r in requests})
        assert check([out.token_ids[r.request_id] for r in requests])


def test_rows_without_state_are_untouched(tiny_model_logits):
    request, state = stateful("pen", [1, 2], [5], frequency_penalty=2.0, logit_bias={7: 3.0})
    others = [Request(f"o{i}", [1, 2], SamplingParams(), 0.0) for i in range(2)]
    logits = tiny_model_logits
    got = Sampler(device="cpu").process_logits(logits.clone(), [others[0], request, others[1]], {"pen": state})
    torch.testing.assert_close(got[[0, 2]], logits[[0, 2]])


def test_row_argmax_picks_what_torch_argmax_picks():
    """The CPU fast path (numpy's argmax) keeps torch's rules: the first of
    equal maxima, a NaN counts as largest; other layouts take torch's."""
    from kvserve.model.sampler import row_argmax

    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 300, generator=gen)
    rows[1, 7] = rows[1, 200] = 1e9  # a tie: the first wins
    rows[2, 50] = rows[2, 10] = float("nan")
    rows[3] = 0.0  # all equal
    for view in (rows, rows[:, ::2], rows.t().contiguous().t(), rows.double()):
        assert torch.equal(row_argmax(view), view.argmax(dim=-1))
    assert row_argmax(rows)[1:4].tolist() == [7, 10, 0]
