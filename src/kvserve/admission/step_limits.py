"""Step limits: the running-batch cap and the token budget of the next step
that keep the measured step time inside the TPOT target, and short enough
for the TTFT target (a step may take at most 1 / STEPS_PER_TTFT of it).

Admitting one more sequence slows every sequence already decoding, so the
running batch is capped where the fitted decode step (step_time.py) reaches
the target (with headroom), and a step's prefill is cut to the tokens that
fit beside its decodes. The scheduler applies them as it builds the step
(`Scheduler.set_step_limits`).

Pure Python.
"""

from __future__ import annotations

import math
from typing import Final, NamedTuple

from kvserve.admission.step_time import StepFit, StepTimeModel

# The step limits keep a step at this share of the TPOT target, leaving room
# for the fit's error and for the minimum prefill chunk.
TPOT_HEADROOM: Final = 0.9
# Prefill tokens a step may always carry, even when the decodes fill the step
# budget: otherwise a full batch would stall every waiting prompt (TTFT grows
# without bound). At least one KV block, so each chunk completes a block the
# prefix cache can register.
MIN_PREFILL_CHUNK_TOKENS: Final = 16
# A step may take at most this fraction's inverse of the TTFT target: an
# arrival waits for the step in flight, then its prefill runs (one or more
# chunks) before its first token comes. With a loose TPOT target (e.g.
# 1000 s) the TTFT target is what bounds the batch.
STEPS_PER_TTFT: Final = 4


class StepLimits(NamedTuple):
    """What `Scheduler.set_step_limits` takes; None = the config's budget."""

    max_running: int
    max_batched_tokens: int | None
    cap_idle_steps: bool = True  # the budget binds steps without a decode too


class StepLimiter:
    """The limits of the next step, read from a step-time model (which the
    admission loop feeds) against the TPOT target."""

    def __init__(self, step_model: StepTimeModel, tpot_slo_s: float, block_size: int, max_num_seqs: int,
                 ttft_slo_s: float = math.inf) -> None:
        self.step_model = step_model
        self.tpot_slo_s = tpot_slo_s
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # The longest step the targets allow, with headroom for the fit's error.
        self.step_budget_s = min(tpot_slo_s, ttft_slo_s / STEPS_PER_TTFT) * TPOT_HEADROOM

    def _decode_step_fit(self) -> tuple[StepFit | None, float | None]:
        """The decode step's fit and the mean batch it was measured at: the
        decode-only steps' own fit once there are enough of them, the joint
        fit before."""
        decode = self.step_model.decode_fit()
        if decode is not None:
            return decode, self.step_model.mean_decode_only_seqs
        return self.step_model.fit(), self.step_model.mean_decode_seqs

    def running_cap(self) -> int:
        """Largest running batch B whose predicted decode step
        (intercept + per_decode_seq * B) fits the step budget (the TPOT
        target, or the TTFT target's share when tighter) with headroom;
        at least 1, at most max_num_seqs (also while nothing is measured)."""
        budget_s = self.step_budget_s
        fit, mean_seqs = self._decode_step_fit()
        if fit is None:
            return self.max_num_seqs
        if fit.per_decode_seq_s is None:
            return self._cap_from_one_batch_size(fit.intercept_s, budget_s, mean_seqs)
        if fit.per_decode_seq_s == 0:  # no cost per sequence over the sizes seen
            return self.max_num_seqs if fit.intercept_s <= budget_s else 1
        cap = math.floor((budget_s - fit.intercept_s) / fit.per_decode_seq_s)
        return max(1, min(self.max_num_seqs, cap))

    def _cap_from_one_batch_size(self, decode_step_s: float, budget_s: float, mean_seqs: float | None) -> int:
        """One decode batch size seen (`mean_seqs` sequences); its step
        (without prefill) took `decode_step_s`. No decodes at all: nothing
        measured, no cap. Too slow: scale the batch down in proportion. Fast
        enough: let it grow by one sequence, not to max_num_seqs at once, so
        a burst cannot start before the next batch size is measured."""
        if mean_seqs is None or mean_seqs < 0.5:
            return self.max_num_seqs
        if decode_step_s > budget_s:
            cap = math.floor(mean_seqs * budget_s / decode_step_s)
        else:
            cap = round(mean_seqs) + 1
        return max(1, min(self.max_num_seqs, cap))

    def prefill_token_budget(self, num_decode_seqs: int) -> int | None:
        """Prefill tokens that fit the step budget beside `num_decode_seqs`
        decodes, at least the minimum chunk; None while no prefill was
        measured or its cost does not bind (the scheduler's own budget)."""
        budget_s = self.step_budget_s
        min_chunk = max(self.block_size, MIN_PREFILL_CHUNK_TOKENS)
        fit = self.step_model.fit()
        if fit is None or fit.per_prefill_token_s is None:
            # Not fitted yet: charge each step's whole time to its prefill
            # tokens, an upper bound on their cost. Without it the first
            # full-size chunks (seconds on a slow machine) let a burst of
            # arrivals start before the running cap is measured.
            per_token_s = self.step_model.upper_bound_per_prefill_token_s
            if per_token_s is None:
                return None
            return max(min_chunk, math.floor(budget_s / per_token_s))
        if fit.per_prefill_token_s == 0:
            return None
        decode = self._decode_step_fit()[0] or fit  # the decode step as the running cap predicts it
        left_s = budget_s - decode.intercept_s - (decode.per_decode_seq_s or 0.0) * num_decode_seqs
        return max(min_chunk, math.floor(left_s / fit.per_prefill_token_s))

    def step_limits(self, num_running: int) -> StepLimits:
        """Limits for the next step when `num_running` sequences are running:
        every one of them may decode, so the token budget is num_running plus
        the prefill that fits beside them (None: the scheduler's own).

        Once step times are fitted the budget binds only steps that decode
        someone: a step with no decode delays no one's next token, and a lone
        prompt then runs in the scheduler's own chunks instead of TPOT-sized
        ones. Before the fit it binds every step (see prefill_token_budget)."""
        prefill = self.prefill_token_budget(num_running)
        return StepLimits(self.running_cap(), None if prefill is None else num_running + prefill,
                          cap_idle_steps=self.step_model.fit() is None)
