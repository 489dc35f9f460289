"""The engine's speculative decoding: after each step, count what its
verifications did and propose the next step's drafts.

The step itself is unchanged: the scheduler gives a request that carries
drafts 1 + k tokens (scheduler/scheduler.py), the runner verifies them
(runner/rejection_sampler.py), update() appends what was accepted. Here,
once a step is applied: its verifications are counted (vLLM's spec_decode
counters, and each request's acceptance for the policy), then every running
request about to decode that the policy lets speculate
(scheduler/speculation.py) gets drafts from the proposer: prompt lookup
(runner/ngram_proposer.py) or a draft model (runner/draft_model.py); under
a simulated runner (`kvserve serve --simulate`), k copies of its placeholder
token, whose fate the runner draws at the simulated acceptance rate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import SpeculativeConfig
from kvserve.contract import Request
from kvserve.runner.ngram_proposer import NgramProposer
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput
from kvserve.scheduler.speculation import SpeculationPolicy

if TYPE_CHECKING:
    from torch import Tensor

    from kvserve.model.sampler import SamplerOutput
    from kvserve.runner.draft_model import DraftModelProposer


@dataclass
class SpecDecodeCounts:
    """Verifications counted as vLLM's `vllm:spec_decode_*` counters do: a
    draft is one request's drafts verified in one step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[j]: drafts accepted at position j (0-based) of a draft
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def merge(self, other: "SpecDecodeCounts") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for position, count in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[position] += count

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying request gains per step: its own plus the accepted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class Speculator:
    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler,
                 draft_model: "DraftModelProposer | None" = None, placeholder_token_id: int | None = None) -> None:
        """placeholder_token_id: a simulated runner's draft token, proposed in
        place of either proposer's drafts (method and model then unused)."""
        if placeholder_token_id is None and (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"method {config.method!r} needs a draft model exactly when it is draft_model")
        self.config = config
        self.placeholder_token_id = placeholder_token_id
        self.scheduler = scheduler
        self.policy = SpeculationPolicy(config)
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_model = draft_model
        self.totals = SpecDecodeCounts(config.num_speculative_tokens)
        self.propose_s = 0.0  # wall time spent proposing, in total (the draft overhead)
        # The longest draft asked of the proposer for the coming step: a draft
        # model's passes over the batch, run whatever the scheduler then trims
        # or drops (a simulated runner prices them, as sim/speculation.py does).
        self.num_draft_passes = 0
        # request_id -> [k, V]: the draft model's distributions of the drafts
        # now on its request, read by the next step's verification.
        self.draft_probs: dict[str, "Tensor"] = {}

    def count(self, scheduled: SchedulerOutput, sampled: "SamplerOutput") -> SpecDecodeCounts:
        """The step's verifications, added to the totals and to each request's
        acceptance (a request finished from outside before its verification
        is still counted: the target did verify its drafts)."""
        counts = SpecDecodeCounts(self.config.num_speculative_tokens)
        for chunk in scheduled.chunks:
            if not chunk.spec_token_ids:
                continue
            rid = chunk.request.request_id
            accepted = sampled.num_accepted.get(rid)
            if accepted is None:
                continue
            counts.add(len(chunk.spec_token_ids), accepted)
            self.policy.record(rid, len(chunk.spec_token_ids), accepted)
        self.totals.merge(counts)
        return counts

    def propose(self, sampling_states: Mapping[str, object]) -> None:
        """Drafts for the running requests about to decode whom the policy lets
        speculate (`sampling_states`: requests whose sampling keeps state)."""
        started_s = time.perf_counter()
        self.draft_probs = {}
        self.num_draft_passes = 0
        self._propose(sampling_states)
        self.propose_s += time.perf_counter() - started_s

    def _propose(self, sampling_states: Mapping[str, object]) -> None:
        decoding = [r for r in self.scheduler.running.values() if r.num_computed_tokens == r.num_tokens - 1]
        if not decoding or not self.policy.step_allows(len(decoding)):
            return
        chosen = [(r, k) for r in decoding
                  if (k := self.policy.drafts_allowed(r.request_id, self._num_drafts(r, sampling_states),
                                                      len(decoding))) > 0]
        self.num_draft_passes = max((k for _, k in chosen), default=0)
        if self.draft_model is not None:
            if chosen:
                self.draft_probs = self.draft_model.propose(chosen)
            return
        placeholder = self.placeholder_token_id
        for request, num_drafts in chosen:
            request.spec_token_ids = (self.ngram.propose(request.request_id, request.all_token_ids, num_drafts) if placeholder is None
                                      else [placeholder] * num_drafts)

    def _num_drafts(self, request: Request, sampling_states: Mapping[str, object]) -> int:
        params = request.sampling_params
        if request.request_id in sampling_states or request.num_output_tokens < params.min_tokens:
            return 0
        return min(self.config.num_speculative_tokens, self.scheduler.max_spec_tokens(request))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that finished: their acceptance, n-gram index and any
        draft-model KV go."""
        for rid in request_ids:
            self.policy.forget(rid)
            self.ngram.forget(rid)
            if self.draft_model is not None:
                self.draft_model.free(rid)
