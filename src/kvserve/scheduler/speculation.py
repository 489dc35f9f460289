"""When to speculate: the per-step policy of speculative decoding.

Speculation is not free: verifying k drafts makes the step run k more
tokens, which pays only when enough of them are accepted, and costs most
where the step is already large. The rule, per step:

- no request speculates in a step that decodes more than
  `disable_by_batch_size` sequences (default 1: past batch 1 a CPU step is
  compute-bound, so each verified draft costs about a decode row of every
  sequence's step, and a chat answer's 0.3-0.4 acceptance no longer pays
  for it: 0.94x at batch 2, while a copying answer gains 1.43x;
  config.SpeculativeConfig has the figures);
- a request speculates while its own measured acceptance rate (an EWMA of
  accepted / proposed drafts over its verifications, starting at 1) is at
  least `min_acceptance_rate` (default 0.25: 1 + k x rate tokens per step beat
  the ~2-2.75x a k = 4 verification costs at batch 1); below it, it only
  probes, so a request whose text turns repetitive is picked up again. A
  probe verifies one draft, not k: its 2 rows cost little more than a decode
  (bandwidth-bound) where k + 1 rows cost 2-2.75x (compute-bound), and one
  accepted draft lifts the EWMA back over the threshold (0.5 x rate + 0.5).
  The first probe comes `probe_interval_steps` (16) steps after the
  request's last verification, and each failed probe doubles that wait (up
  to 16x: 256 steps), so a request that never repeats itself pays
  O(log steps) probes, not one in 16; a probe that recovers the rate resets
  the wait. A step whose proposer finds no draft does not use up the probe:
  it stays due until one is verified;
- never for a request whose sampling carries per-token state (a grammar,
  penalties, logit_bias) or has not reached min_tokens: the rejection
  rule's rows would need that state advanced per draft.

Pure Python: the engine drives it, and a simulator can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig

# Weight of the newest verification in a request's acceptance EWMA.
ACCEPTANCE_EWMA_WEIGHT = 0.5
# Drafts a probe verifies, and how far failed probes stretch the wait for the
# next (probe_interval_steps x 2^failed, at most this factor).
PROBE_DRAFTS = 1
MAX_PROBE_BACKOFF = 16


@dataclass
class _RequestAcceptance:
    rate: float = 1.0
    steps_since_verified: int = 0  # steps asked about since its last verification
    failed_probes: int = 0  # in a row, since its rate was last over the threshold


@dataclass
class SpeculationPolicy:
    config: SpeculativeConfig
    _requests: dict[str, _RequestAcceptance] = field(default_factory=dict)

    def step_allows(self, num_decode_seqs: int) -> bool:
        """Whether a step decoding `num_decode_seqs` sequences may speculate."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_decode_seqs <= limit

    def drafts_allowed(self, request_id: str, num_drafts: int) -> int:
        """How many of `num_drafts` drafts this request may propose for its
        next step: all while its rate is over the threshold, PROBE_DRAFTS on
        a probe step, else none. Asked once per step per decoding request."""
        state = self._requests.get(request_id)
        if state is None or state.rate >= self.config.min_acceptance_rate:
            return num_drafts
        state.steps_since_verified += 1
        wait = self.config.probe_interval_steps * min(2 ** state.failed_probes, MAX_PROBE_BACKOFF)
        return min(num_drafts, PROBE_DRAFTS) if state.steps_since_verified >= wait else 0

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome for a request."""
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        was_probe = state.rate < self.config.min_acceptance_rate
        state.rate += ACCEPTANCE_EWMA_WEIGHT * (num_accepted / num_proposed - state.rate)
        state.steps_since_verified = 0
        if state.rate >= self.config.min_acceptance_rate:
            state.failed_probes = 0
        elif was_probe:
            state.failed_probes += 1

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance_rate(self, request_id: str) -> float | None:
        state = self._requests.get(request_id)
        return None if state is None else state.rate
