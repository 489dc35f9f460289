"""When to speculate: the per-step policy of speculative decoding.

Speculation is not free: verifying k drafts makes the step run k more
rows, which pays only when enough of them are accepted, and costs most
where the step is already large. The rule, per step:

- a request speculates in a step decoding b sequences while its own
  measured acceptance rate (an EWMA of accepted / proposed drafts over its
  verifications, starting at 1) is at least the break-even at b:

      threshold(b) = b m / (b m + 1 - m),   m = min_acceptance_rate

  From the step's cost: a step of n rows costs about W + n r (W: reading
  the weights, r: one row's compute; on a CPU a verified draft costs about
  one decode row once the step is compute-bound). A batch of b decodes pays
  (W + b r) / b per token; a draft costs r and brings `rate` tokens, so it
  pays from rate = b r / (W + b r). k cancels: each draft costs its row and
  is worth the request's rate, so the bar is the same for 1 draft or 16.
  m is the bar at batch 1 (r / (W + r)); measured, verifying 4 drafts at
  batch 1 costs ~2x a decode step, so W ~ 3 r and m = 0.25 (the default),
  giving 0.25, 0.40, 0.57, 0.73, 0.84 at batch 1, 2, 4, 8, 16: chat (an
  answer that does not repeat its prompt, acceptance 0.30-0.40) stops
  speculating from batch 2, where it lost (0.94x at 2, 0.92x at 4, 0.87x at
  8 with the batch-1 bar at every batch), while a copying answer (0.83)
  keeps speculating to batch 8 (it gained 1.43x, 1.15x, 1.10x there);
  docs/performance.md has the figures;
- below the bar a request only probes, so one whose text turns repetitive
  is picked up again. A probe verifies one draft, not k: its row costs
  little where k rows cost much, and one accepted draft lifts the EWMA by
  half the way to 1. The first probe comes `probe_interval_steps` (16) steps
  after the request's last verification, and each failed probe (its draft
  rejected) doubles that wait (up to 16x: 256 steps), so a request that
  never repeats itself pays O(log steps) probes, not one in 16; a probe that
  recovers the rate resets the wait. From batch 4 one accepted draft may not
  lift the rate over the bar (0.45 -> 0.72 against 0.73 at batch 8: a
  copying answer after one miss); the next probe then comes at the next
  step, not after another wait. A step whose proposer finds no draft does not use up the probe:
  it stays due until one is verified. A request under the bar at one batch
  speculates again as soon as the batch is small enough for its rate;
- no request speculates in a step that decodes more than
  `disable_by_batch_size` sequences (vLLM's key; default None: no limit, the
  threshold already rises with the batch);
- never for a request whose sampling carries per-token state (a grammar,
  penalties, logit_bias) or has not reached min_tokens: the rejection
  rule's rows would need that state advanced per draft.

Pure Python: the engine drives it (engine/speculative.py), and so does the
simulator (sim/speculation.py).
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
    probe_due: bool = False  # its last probe's draft was accepted, its rate still under: probe again now
    # The threshold of the step it last asked about: its next verification is
    # that step's, a probe if its rate was under it.
    threshold: float | None = None


@dataclass
class SpeculationPolicy:
    config: SpeculativeConfig
    _requests: dict[str, _RequestAcceptance] = field(default_factory=dict)

    def step_allows(self, num_decode_seqs: int) -> bool:
        """Whether a step decoding `num_decode_seqs` sequences may speculate
        at all (the hard limit, disable_by_batch_size)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_decode_seqs <= limit

    def acceptance_threshold(self, num_decode_seqs: int) -> float:
        """The acceptance rate a request must have to speculate in a step
        decoding `num_decode_seqs` sequences: where a draft's expected tokens
        pay for its row (module docstring)."""
        bar_at_batch_1 = self.config.min_acceptance_rate
        scaled = num_decode_seqs * bar_at_batch_1
        return scaled / (scaled + 1.0 - bar_at_batch_1)

    def drafts_allowed(self, request_id: str, num_drafts: int, num_decode_seqs: int) -> int:
        """How many of `num_drafts` drafts this request may propose for its
        next step, which decodes `num_decode_seqs` sequences: all while its
        rate is at least that batch's threshold, PROBE_DRAFTS on a probe
        step, else none. Asked once per step per decoding request."""
        threshold = self.acceptance_threshold(num_decode_seqs)
        state = self._requests.get(request_id)
        if state is None:
            return num_drafts
        state.threshold = threshold
        if state.rate >= threshold:
            return num_drafts
        state.steps_since_verified += 1
        wait = self.config.probe_interval_steps * min(2 ** state.failed_probes, MAX_PROBE_BACKOFF)
        due = state.probe_due or state.steps_since_verified >= wait
        return min(num_drafts, PROBE_DRAFTS) if due else 0

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome for a request (of the step it last
        asked drafts_allowed about)."""
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        threshold = self.config.min_acceptance_rate if state.threshold is None else state.threshold
        was_probe = state.rate < threshold
        state.rate += ACCEPTANCE_EWMA_WEIGHT * (num_accepted / num_proposed - state.rate)
        state.steps_since_verified = 0
        state.probe_due = False
        if state.rate >= threshold:
            state.failed_probes = 0
        elif was_probe and num_accepted == num_proposed:
            state.probe_due = True
        elif was_probe:
            state.failed_probes += 1

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance_rate(self, request_id: str) -> float | None:
        state = self._requests.get(request_id)
        return None if state is None else state.rate
