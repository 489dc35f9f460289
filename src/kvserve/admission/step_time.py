"""The step-time model: measured engine steps -> a least-squares fit of step
time over the step's shape (decode sequences, prefill tokens), from which
the step limits (admission/step_limits.py) are derived.

Pure Python; the steps are fed by the admission loop (admission/loop.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

# Fewer measured steps (decayed count) than this would fit three
# coefficients to the noise of the first few shapes.
MIN_FIT_STEPS: Final = 8
# A factor whose (decayed) variance is below this never varied: its slope is
# not identified by the steps seen (counts are integers, so real variation is
# far above it).
MIN_FACTOR_VARIANCE: Final = 1e-3
# Decode seqs and prefill tokens count as collinear when their correlation^2
# exceeds 1 - this.
COLLINEAR_TOLERANCE: Final = 1e-6


class StepFit(NamedTuple):
    """step_s ~= intercept_s + per_decode_seq_s * num_decode_seqs
    + per_prefill_token_s * num_prefill_tokens. A slope is None while the
    steps seen never varied its feature (unidentified), 0.0 when they did and
    showed no cost."""

    intercept_s: float
    per_decode_seq_s: float | None
    per_prefill_token_s: float | None


class StepTimeModel:
    """Two-factor least squares of measured engine steps on exponentially
    decayed sums (recent steps count most).

    Decode sequences and prefill tokens are separate factors because they
    cost very differently per token: a prefill token shares the weight read
    with a whole chunk, a decode sequence pays its own KV read and sampling.
    Fitting one slope over both lets 512-token prefill chunks flatten the
    slope and inflate the decode cap.

    The decode-only steps are also fitted on their own (`decode_fit`), for
    the running cap: prefill cost is convex in the chunk on a CPU (attention
    over the chunk; measured 2 ms per token at 25 tokens, 5 at 496), so a
    line through large chunks and decodes can come out with a negative
    intercept, be refitted through the origin, and charge the whole fixed
    step cost to each decode sequence (a cap of 2 where 5 fit)."""

    def __init__(self, decay: float = 0.98) -> None:
        self._decay = decay
        # Decayed sums: weight, then first and second moments of
        # (d = decode seqs, p = prefill tokens, y = step seconds).
        self._w = self._d = self._p = self._y = 0.0
        self._dd = self._pp = self._dp = self._dy = self._py = 0.0
        # The same of the decode-only steps (p = 0), decayed per such step.
        self._dec_w = self._dec_d = self._dec_y = self._dec_dd = self._dec_dy = 0.0
        self._decode_fit_is_current = False
        self._decode_fit: StepFit | None = None
        # The fit changes only when a step is observed, but admission asks
        # for it several times per request: solve once per observation.
        self._fit_is_current = False
        self._fit: StepFit | None = None
        # Decode sequences of the last measured step: whether prompts are now
        # prefilled beside decodes (in TPOT-sized steps) or alone.
        self.last_num_decode_seqs = 0

    def observe(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float) -> None:
        """One measured engine step; a step with no work, or a time that is
        negative or NaN, is not a measurement and is ignored."""
        if not (num_decode_seqs + num_prefill_tokens > 0 and step_s >= 0):
            return
        self.last_num_decode_seqs = num_decode_seqs
        k = self._decay
        d, p, y = float(num_decode_seqs), float(num_prefill_tokens), float(step_s)
        self._w = self._w * k + 1.0
        self._d, self._p, self._y = self._d * k + d, self._p * k + p, self._y * k + y
        self._dd, self._pp, self._dp = self._dd * k + d * d, self._pp * k + p * p, self._dp * k + d * p
        self._dy, self._py = self._dy * k + d * y, self._py * k + p * y
        self._fit_is_current = False
        if num_prefill_tokens == 0:
            self._dec_w = self._dec_w * k + 1.0
            self._dec_d, self._dec_y = self._dec_d * k + d, self._dec_y * k + y
            self._dec_dd, self._dec_dy = self._dec_dd * k + d * d, self._dec_dy * k + d * y
            self._decode_fit_is_current = False

    def observe_steps(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """`observe` of each (num_decode_seqs, num_prefill_tokens, step_s) in
        order, its rule for what is a measurement included: the same
        operations on local sums (a simulated hour feeds millions of decode
        steps)."""
        k = self._decay
        w, sd, sp, sy = self._w, self._d, self._p, self._y
        sdd, spp, sdp, sdy, spy = self._dd, self._pp, self._dp, self._dy, self._py
        dec_w, dec_d, dec_y, dec_dd, dec_dy = self._dec_w, self._dec_d, self._dec_y, self._dec_dd, self._dec_dy
        last_num_decode_seqs = self.last_num_decode_seqs
        for num_decode_seqs, num_prefill_tokens, step_s in steps:
            if not (num_decode_seqs + num_prefill_tokens > 0 and step_s >= 0):
                continue
            last_num_decode_seqs = num_decode_seqs
            d, p, y = float(num_decode_seqs), float(num_prefill_tokens), float(step_s)
            w = w * k + 1.0
            sd, sp, sy = sd * k + d, sp * k + p, sy * k + y
            sdd, spp, sdp = sdd * k + d * d, spp * k + p * p, sdp * k + d * p
            sdy, spy = sdy * k + d * y, spy * k + p * y
            if num_prefill_tokens == 0:
                dec_w = dec_w * k + 1.0
                dec_d, dec_y = dec_d * k + d, dec_y * k + y
                dec_dd, dec_dy = dec_dd * k + d * d, dec_dy * k + d * y
        self._w, self._d, self._p, self._y = w, sd, sp, sy
        self._dd, self._pp, self._dp, self._dy, self._py = sdd, spp, sdp, sdy, spy
        self._dec_w, self._dec_d, self._dec_y, self._dec_dd, self._dec_dy = dec_w, dec_d, dec_y, dec_dd, dec_dy
        self.last_num_decode_seqs = last_num_decode_seqs
        self._fit_is_current = self._decode_fit_is_current = False

    @property
    def mean_step_s(self) -> float | None:
        return self._y / self._w if self._w else None

    @property
    def mean_decode_seqs(self) -> float | None:
        return self._d / self._w if self._w else None

    @property
    def mean_decode_only_seqs(self) -> float | None:
        """Mean batch of the decode-only steps (decode_fit's steps)."""
        return self._dec_d / self._dec_w if self._dec_w else None

    @property
    def upper_bound_per_prefill_token_s(self) -> float | None:
        """Step seconds per prefill token with the whole step charged to its
        prefill; None before a step with prefill."""
        return self._y / self._p if self._p else None

    def fit(self) -> StepFit | None:
        """Least-squares coefficients, all >= 0; None before MIN_FIT_STEPS
        (solved once per observed step)."""
        if not self._fit_is_current:
            self._fit, self._fit_is_current = self._solve(), True
        return self._fit

    def decode_fit(self) -> StepFit | None:
        """intercept + per_decode_seq x B over the decode-only steps alone
        (per_prefill_token_s None); None before MIN_FIT_STEPS of them. The
        slope is at least the joint fit's prefill token cost, for the reason
        given in _solve."""
        if not self._decode_fit_is_current:
            self._decode_fit, self._decode_fit_is_current = self._solve_decode(), True
        return self._decode_fit

    def _solve_decode(self) -> StepFit | None:
        w = self._dec_w
        if w < MIN_FIT_STEPS:
            return None
        mean_d, mean_y = self._dec_d / w, self._dec_y / w
        raw_dd, raw_dy = self._dec_dd / w, self._dec_dy / w
        centred_dd, centred_dy = raw_dd - mean_d ** 2, raw_dy - mean_d * mean_y
        has_d = centred_dd > MIN_FACTOR_VARIANCE
        per_decode_s, _ = _nonnegative_slopes(has_d, False, centred_dd, 0.0, 0.0, centred_dy, 0.0)
        intercept_s = mean_y if per_decode_s is None else mean_y - per_decode_s * mean_d
        if intercept_s < 0:
            per_decode_s, _ = _nonnegative_slopes(has_d, False, raw_dd, 0.0, 0.0, raw_dy, 0.0)
            intercept_s = 0.0
        joint = self.fit()
        if per_decode_s is not None and joint is not None and joint.per_prefill_token_s is not None:
            per_decode_s = max(per_decode_s, joint.per_prefill_token_s)
        return StepFit(intercept_s, per_decode_s, None)

    def _solve(self) -> StepFit | None:
        """The least-squares fit of the decayed sums.

        Solves the normal equations of (1, d, p) in centred form (the
        intercept drops out, leaving 2x2). A factor whose variance is ~0 is
        left out (its slope None: unidentified). If the intercept comes out
        negative, the cost is not linear over the shapes seen (a small
        prefill costs what a decode does, a large one is compute-bound), and
        the slopes are refitted through the origin instead."""
        # Plain floats, not dicts keyed by factor: admission solves this at
        # every step start. The operations and their order are the
        # textbook ones: centred = raw - mean * mean.
        w = self._w
        if w < MIN_FIT_STEPS:
            return None
        mean_d, mean_p, mean_y = self._d / w, self._p / w, self._y / w
        raw_dd, raw_pp, raw_dp = self._dd / w, self._pp / w, self._dp / w
        raw_dy, raw_py = self._dy / w, self._py / w
        centred_dd, centred_pp = raw_dd - mean_d ** 2, raw_pp - mean_p ** 2
        centred_dp = raw_dp - mean_d * mean_p
        centred_dy, centred_py = raw_dy - mean_d * mean_y, raw_py - mean_p * mean_y
        has_d, has_p = centred_dd > MIN_FACTOR_VARIANCE, centred_pp > MIN_FACTOR_VARIANCE
        per_decode_s, per_prefill_s = _nonnegative_slopes(
            has_d, has_p, centred_dd, centred_pp, centred_dp, centred_dy, centred_py)
        explained_s = 0.0  # sum() of the identified factors' slope x mean, in factor order
        if per_decode_s is not None:  # has_d
            explained_s = explained_s + per_decode_s * mean_d
        if per_prefill_s is not None:  # has_p
            explained_s = explained_s + per_prefill_s * mean_p
        intercept_s = mean_y - explained_s
        if intercept_s < 0:
            per_decode_s, per_prefill_s = _nonnegative_slopes(
                has_d, has_p, raw_dd, raw_pp, raw_dp, raw_dy, raw_py)
            intercept_s = 0.0
        if per_decode_s is not None and per_prefill_s is not None:
            # A decode runs its token through the same weights a prefill token
            # does, plus its own KV read and sampling: never cheaper. Noisy
            # steps can fit a slope of ~0, which would lift the cap to
            # max_num_seqs at once.
            per_decode_s = max(per_decode_s, per_prefill_s)
        return StepFit(intercept_s, per_decode_s, per_prefill_s)


def _nonnegative_slopes(use_d: bool, use_p: bool, xx_dd: float, xx_pp: float, xx_dp: float,
                        xy_d: float, xy_p: float) -> tuple[float | None, float | None]:
    """Least-squares slopes (decode seqs, prefill tokens) of step time on the
    factors in use, from their second moments xx and xy; None for a factor
    not in use. A negative slope (a bigger batch is never faster) is set to
    0 and the rest refitted (of two negative ones the more negative goes
    first, decode on a tie); of two collinear factors prefill is dropped,
    since the running cap needs the decode slope."""
    slope_d = 0.0 if use_d else None
    slope_p = 0.0 if use_p else None
    if use_d and use_p:
        det = xx_dd * xx_pp - xx_dp ** 2
        if det <= COLLINEAR_TOLERANCE * xx_dd * xx_pp:
            use_p = False
        else:
            solved_d = (xy_d * xx_pp - xy_p * xx_dp) / det
            solved_p = (xy_p * xx_dd - xy_d * xx_dp) / det
            if solved_d >= 0 and solved_p >= 0:
                return solved_d, solved_p
            if solved_d < 0 and (solved_p >= 0 or solved_d <= solved_p):
                use_d = False
            else:
                use_p = False
    if use_d:
        solved_d = xy_d / xx_dd
        if solved_d >= 0:
            slope_d = solved_d
    elif use_p:
        solved_p = xy_p / xx_pp
        if solved_p >= 0:
            slope_p = solved_p
    return slope_d, slope_p
