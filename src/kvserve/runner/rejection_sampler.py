"""Verifying draft tokens: the exact acceptance rule of speculative sampling.

A speculating request's chunk runs its last token t and k drafts d_1..d_k
in one forward pass, giving the target's logits at k + 1 positions: row j
(0-based) predicts the token after d_j (d_0 = t). Row by row:

- greedy requests accept d_{j+1} while it equals row j's argmax; the first
  mismatch's argmax (or row k's, when every draft matched) is the step's
  own token. The output is exactly greedy decoding's.
- sampled requests accept d_{j+1} with probability min(1, p(d) / q(d)),
  p = row j's distribution (temperature, top-k / top-p of the target's
  logits), q = the distribution the draft was drawn from (a draft model's,
  or a point mass on the token for prompt lookup, whose drafts are not
  random: q(d) = 1). On the first rejection the step's token is drawn from
  the residual max(0, p - q) renormalised; when all k are accepted it is
  drawn from row k. This keeps every emitted token distributed exactly as
  plain sampling from the target would (Leviathan et al. 2023; Chen et al.
  2023), whatever the drafts.

Every draw at output position n + j of a request comes from
`Sampler.generator_at(request, n + j)`: one uniform for the acceptance
test, then exponentials for a residual or bonus draw. A seeded request's
tokens therefore depend on its seed, its own tokens and its drafts, never
on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from kvserve.model.sampler import Sampler, SamplerOutput, TokenLogprob, logprob_of, race, row_argmax

if TYPE_CHECKING:
    from kvserve.contract import Request


class Verified(NamedTuple):
    num_accepted: int
    token_id: int  # the step's own token: residual, bonus, or greedy argmax


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits: Tensor, requests: Sequence["Request"], drafts: Sequence[tuple[int, ...]],
               draft_probs: Mapping[str, Tensor] | None = None) -> SamplerOutput:
        """logits: [sum(k_i + 1), V], request i's k_i + 1 rows in order;
        drafts[i]: its k_i draft tokens; draft_probs: request_id -> [k_i, V]
        the draft model's distributions (absent: point masses). Returns each
        request's accepted count, its own token, and logprobs where asked
        (of the raw logits, every emitted token). May modify logits."""
        rows_of = []
        row = 0
        for draft in drafts:
            rows_of.append(range(row, row + len(draft) + 1))
            row += len(draft) + 1
        row_requests = [r for r, rows in zip(requests, rows_of) for _ in rows]
        wants_logprobs = [r.sampling_params.logprobs is not None for r in requests]
        table = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
        logits = self.sampler.process_logits(logits, row_requests)
        random = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        probs = _probs_by_request(self.sampler, logits, requests, rows_of, random)
        argmax = row_argmax(logits).tolist()
        out = SamplerOutput({}, {})
        for i, request in enumerate(requests):
            rows = rows_of[i]
            if i in probs:
                q = None if draft_probs is None else draft_probs.get(request.request_id)
                verified = self._verify_sampled(request, drafts[i], probs[i], q)
            else:
                verified = _verify_greedy(drafts[i], argmax[rows.start:rows.stop])
            rid = request.request_id
            out.token_ids[rid] = verified.token_id
            out.num_accepted[rid] = verified.num_accepted
            if table is not None and wants_logprobs[i]:
                emitted = (*drafts[i][:verified.num_accepted], verified.token_id)
                lps = _logprobs(table, rows.start, emitted, request.sampling_params.logprobs)
                out.accepted_logprobs[rid] = lps[:-1]
                out.logprobs[rid] = lps[-1]
        return out

    def _verify_sampled(self, request: "Request", draft: tuple[int, ...], p: Tensor,
                        q: Tensor | None) -> Verified:
        """p: [k + 1, V] target distributions; q: [k, V] draft ones or None."""
        position = request.num_output_tokens
        for j, token in enumerate(draft):
            generator = self.sampler.generator_at(request, position + j)
            p_token = float(p[j, token])
            q_token = 1.0 if q is None else float(q[j, token])
            uniform = float(torch.rand((), generator=generator, device=p.device))
            if uniform * q_token < p_token:
                continue  # accepted with probability min(1, p / q)
            return Verified(j, self._draw(_residual(p[j], q, j, token), generator))
        return Verified(len(draft), self._draw(p[len(draft)], self.sampler.generator_at(request, position + len(draft))))

    @staticmethod
    def _draw(probs: Tensor, generator: torch.Generator) -> int:
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int(race(probs, noise))


def _verify_greedy(draft: tuple[int, ...], argmax: list[int]) -> Verified:
    for j, token in enumerate(draft):
        if token != argmax[j]:
            return Verified(j, argmax[j])
    return Verified(len(draft), argmax[len(draft)])


def _residual(p: Tensor, q: Tensor | None, row: int, token: int) -> Tensor:
    """max(0, p - q) for a rejected draft (unnormalised: the draw's race is
    scale-free). A point-mass q removes the rejected token from p."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q[row]).clamp_min_(0.0)
    # Only rounding can empty it (a rejection needs p(d) < q(d), so p > q elsewhere).
    return residual if float(residual.sum()) > 0 else p


def _probs_by_request(sampler: Sampler, logits: Tensor, requests: Sequence["Request"],
                      rows_of: list[range], random: list[int]) -> dict[int, Tensor]:
    """Request index -> [k + 1, V] target distributions, for sampled requests."""
    if not random:
        return {}
    index = [row for i in random for row in rows_of[i]]
    row_requests = [requests[i] for i in random for _ in rows_of[i]]
    probs = sampler.probs(logits[index], row_requests)
    out, start = {}, 0
    for i in random:
        n = len(rows_of[i])
        out[i] = probs[start:start + n]
        start += n
    return out


def _logprobs(table: Tensor, first_row: int, emitted: tuple[int, ...], num_top: int) -> list[TokenLogprob]:
    return [logprob_of(table[first_row + j], num_top, token) for j, token in enumerate(emitted)]
