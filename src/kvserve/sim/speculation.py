"""Speculative decoding in the simulator: the real scheduler verifies drafts
whose fate an acceptance rate decides.

Capacity planning asks what speculation buys at a load: that depends on how
many drafts are accepted (a property of the workload and proposer, given
here as `acceptance_rate`: each draft position is accepted with that
probability while the ones before it were), on what proposing costs
(`proposer_cost_s` per draft token position: one draft-model pass over the
batch; ~0 for prompt lookup), and on what verification costs (the cost
model prices the step's 1 + k tokens per speculating request). Drafts are
given to the running requests by the engine's own policy
(scheduler/speculation.py: each request's acceptance against a bar that
rises with the batch, the batch-size limit) and scheduled, allocated and
released by the real scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.config import SpeculativeConfig
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput
from kvserve.scheduler.speculation import SpeculationPolicy


@dataclass(frozen=True)
class SimSpeculation:
    """acceptance_rate: probability a draft is accepted given the ones before
    it were (0..1); proposer_cost_s: seconds a step gains per draft position
    proposed (a draft model's decode step over the batch); config: k and
    the when-not-to-speculate policy, as the engine's."""

    acceptance_rate: float
    proposer_cost_s: float = 0.0
    config: SpeculativeConfig = SpeculativeConfig()
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")
        if not self.proposer_cost_s >= 0:
            raise ValueError(f"proposer_cost_s must be >= 0 seconds, got {self.proposer_cost_s}")

    def num_accepted(self, rng: random.Random, num_drafts: int) -> int:
        """Drafts accepted of `num_drafts`: each with acceptance_rate, while
        the ones before it were."""
        n = 0
        while n < num_drafts and rng.random() < self.acceptance_rate:
            n += 1
        return n

    def proposer_time_s(self, longest_drafts: int) -> float:
        """The proposer's time for a step whose longest draft is this long:
        one draft position per pass over the batch."""
        return longest_drafts * self.proposer_cost_s


class SimulatedDrafts:
    """One replica's drafts: proposed after each step, judged when verified."""

    def __init__(self, speculation: SimSpeculation, draft_token_id: int) -> None:
        self.speculation = speculation
        self.policy = SpeculationPolicy(speculation.config)
        self.rng = random.Random(speculation.seed)
        self.draft_token_id = draft_token_id
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def judge(self, out: SchedulerOutput) -> dict[str, int]:
        """request_id -> drafts accepted, for the step's verifying chunks."""
        accepted = {}
        for chunk in out.chunks:
            drafts = len(chunk.spec_token_ids)
            if not drafts:
                continue
            n = self.speculation.num_accepted(self.rng, drafts)
            rid = chunk.request.request_id
            accepted[rid] = n
            self.policy.record(rid, drafts, n)
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += n
        return accepted

    def propose(self, scheduler: Scheduler) -> float:
        """Drafts for the running requests about to decode that the policy
        lets speculate; returns the proposer's time for them (seconds)."""
        decoding = [r for r in scheduler.running.values() if r.num_computed_tokens == r.num_tokens - 1]
        if not decoding or not self.policy.step_allows(len(decoding)):
            return 0.0
        longest = 0
        k = self.speculation.config.num_speculative_tokens
        for request in decoding:
            n = self.policy.drafts_allowed(request.request_id, min(k, scheduler.max_spec_tokens(request)),
                                           len(decoding))
            if n > 0:
                request.spec_token_ids = [self.draft_token_id] * n
                longest = max(longest, n)
        return self.speculation.proposer_time_s(longest)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
