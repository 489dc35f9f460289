"""When to speculate: the per-step policy of speculative decoding.

Speculation is not free: verifying k drafts makes the step run k more
tokens, which pays only when enough of them are accepted, and costs most
where the step is already large. The rule, per step:

- no request speculates in a step that decodes more than
  `disable_by_batch_size` sequences (default 3: a large batch is
  compute-bound, extra tokens slow every sequence's step instead of riding
  on spare bandwidth; on a CPU each verified draft costs about a decode
  row, so with k = 4 batch 4's step costs ~4x, more than it gains);
- a request speculates while its own measured acceptance rate (an EWMA of
  accepted / proposed drafts over its steps, starting at 1) is at least
  `min_acceptance_rate` (default 0.25: 1 + k x rate tokens per step beat
  the ~2x a k = 4 verification costs at batch 1); below it, only one probe step in every
  `probe_interval_steps`, so a request whose text turns repetitive is
  picked up again;
- never for a request whose sampling carries per-token state (a grammar,
  penalties, logit_bias) or has not reached min_tokens: the rejection
  rule's rows would need that state advanced per draft.

Pure Python: the engine drives it, and a simulator can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig

# Weight of the newest step in a request's acceptance EWMA.
ACCEPTANCE_EWMA_WEIGHT = 0.5


@dataclass
class _RequestAcceptance:
    rate: float = 1.0
    steps_below: int = 0  # steps since it fell below the threshold


@dataclass
class SpeculationPolicy:
    config: SpeculativeConfig
    _requests: dict[str, _RequestAcceptance] = field(default_factory=dict)

    def step_allows(self, num_decode_seqs: int) -> bool:
        """Whether a step decoding `num_decode_seqs` sequences may speculate."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_decode_seqs <= limit

    def request_allows(self, request_id: str) -> bool:
        """Whether this request proposes drafts for its next step (a probe
        step counts as allowed)."""
        state = self._requests.get(request_id)
        if state is None or state.rate >= self.config.min_acceptance_rate:
            return True
        state.steps_below += 1
        if state.steps_below >= self.config.probe_interval_steps:
            state.steps_below = 0
            return True
        return False

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome for a request."""
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        state.rate += ACCEPTANCE_EWMA_WEIGHT * (num_accepted / num_proposed - state.rate)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance_rate(self, request_id: str) -> float | None:
        state = self._requests.get(request_id)
        return None if state is None else state.rate
