"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds,
min_tokens and top-N logprobs, for the rows of one step's logits.

Random rows sample by an exponential race: argmax(probs / E) with E ~ Exp(1)
drawn from that request's own generator, which picks token i with
probability probs[i]. A seeded request's generator is derived from (seed,
output position), so its tokens do not depend on what else is in the batch,
nor on a preemption replaying the request. Unseeded rows draw from the
sampler's generator; the global RNG is never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.contract import Request
from kvserve.model.device import resolve_device

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads (seed, position) pairs apart
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives (log_softmax of
    the raw logits, before temperature, top-k/top-p or min_tokens masking)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class SamplerOutput:
    """request_id -> sampled token id, and its logprobs where requested."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        self.device = resolve_device(device)  # where the logits live
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(self, logits: Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: [S, vocab] float32, row i belongs to requests[i]. May modify logits."""
        logprob_rows = self._logprob_rows(logits, requests)
        _mask_until_min_tokens(logits, requests)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(logits[random_rows],
                                                         [requests[i] for i in random_rows])
        ids = token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(requests, ids)}
        logprobs = {rid: _pick(row, num_top, sampled[rid]) for rid, (row, num_top) in logprob_rows.items()}
        return SamplerOutput(sampled, logprobs)

    def _sample_random(self, logits: Tensor, requests: Sequence[Request]) -> Tensor:
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, request in enumerate(requests):
            noise[row].exponential_(generator=self._generator_for(request))
        # A zero draw would make 0/0; Exp(1) draws this small are vanishingly rare anyway.
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed * _SEED_MIX + request.num_output_tokens) & _SEED_MASK)
        return generator

    @staticmethod
    def _logprob_rows(logits: Tensor, requests: Sequence[Request]) -> dict[str, tuple[Tensor, int]]:
        """request_id -> (log_softmax row [V], number of top alternatives wanted)."""
        rows = {r.request_id: i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None}
        if not rows:
            return {}
        index = list(rows.values())
        table = torch.log_softmax(logits[index], dim=-1)
        return {rid: (table[j], requests[i].sampling_params.logprobs)
                for j, (rid, i) in enumerate(rows.items())}


def _pick(row: Tensor, num_top: int, token_id: int) -> TokenLogprob:
    values, indices = row.topk(num_top) if num_top else (row[:0], row[:0].long())
    top = tuple(zip(indices.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(row[token_id]), top)


def _mask_until_min_tokens(logits: Tensor, requests: Sequence[Request]) -> None:
    """Forbid EOS and stop_token_ids while a request has fewer than min_tokens outputs."""
    for row, request in enumerate(requests):
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids)
        banned.extend(request.eos_token_ids)
        if banned:
            logits[row, banned] = float("-inf")


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf.

    logits: [S, V]; top_k: [S] int (0 = no limit); top_p: [S] float in (0, 1].
    The most likely token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
