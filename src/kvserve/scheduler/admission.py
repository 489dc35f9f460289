"""Admission control: the front door that keeps the promise.

A request is admitted only if it can start soon enough to meet the TTFT
target. The controller keeps a ledger of admitted requests (their projected
KV blocks = ceil((prompt + max_tokens - prefix hit) / block_size)), measures
how fast that work drains (an EWMA over busy time of projected blocks and
requests released per second), and estimates a newcomer's wait from the work
queued ahead of it in its priority class. Over the class's limit it answers
429 with a Retry-After instead of letting the queue turn into timeouts.

It also owns tenant quotas (concurrency, tokens per minute), the retry
budget, degradation (cap max_tokens instead of refusing) and the step
limits (running batch cap, prefill tokens per step) that keep the measured
step time inside the TPOT target.

Pure Python, clock injected, no asyncio or HTTP: the server and the simulator
drive the same object. Not thread-safe: call it from one thread.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from kvserve.config import AdmissionConfig

# Constants are Final: the compiled core (kvserve/compiled) inlines them.
ADMIT: Final = "admit"
DEGRADE: Final = "degrade"
REJECT: Final = "reject"

# Reasons a request is refused or ended before starting (OpenAI error `code`).
KV_CACHE: Final = "kv_cache"
QUEUE_FULL: Final = "queue_full"
TENANT_QUOTA: Final = "tenant_quota"
RETRY_BUDGET: Final = "retry_budget"
NEVER_FITS: Final = "never_fits"
DEADLINE: Final = "deadline"
QUEUE_TIMEOUT: Final = "queue_timeout"

TPM_WINDOW_S: Final = 60.0
# A drain rate measured over less busy time than this is noise.
MIN_MEASURED_BUSY_S: Final = 0.05
# Waits predicted shorter than this calibrate the fixed start latency; longer
# ones the multiplicative error of the drain model.
SHORT_WAIT_S: Final = 0.05
CALIBRATION_WEIGHT: Final = 0.1  # EWMA weight of one observed start
MAX_WAIT_CORRECTION: Final = 4.0

# The step limits keep a step at this share of the TPOT target, leaving room
# for the fit's error and for the minimum prefill chunk.
TPOT_HEADROOM: Final = 0.9
# Prefill tokens a step may always carry, even when the decodes fill the step
# budget: otherwise a full batch would stall every waiting prompt (TTFT grows
# without bound). At least one KV block, so each chunk completes a block the
# prefix cache can register.
MIN_PREFILL_CHUNK_TOKENS: Final = 16
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


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission needs to know about one request (plain numbers)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_cached_tokens: int = 0  # prefix-cache hit known at the door
    priority: int = 0  # lower = more urgent
    tenant: str = "default"
    is_retry: bool = False
    deadline: float | None = None  # absolute, on the controller's clock


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """admit | degrade (admit with max_tokens capped) | reject (status, reason)."""

    outcome: str
    max_tokens: int | None = None  # what to run with when admitted
    status: int = 200
    reason: str | None = None
    retry_after_s: int | None = None  # whole seconds >= 1 on a 429
    expected_wait_s: float | None = None
    message: str = ""

    @property
    def admitted(self) -> bool:
        return self.outcome != REJECT


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """None = unlimited."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None


@dataclass(slots=True)
class _Ticket:
    request: AdmissionRequest
    max_tokens: int
    num_blocks: int
    start_by: float | None
    start_by_reason: str
    admitted_at: float
    predicted_wait_s: float | None
    started: bool = False


class BusyRate:
    """Amount per second, an exponentially weighted average over busy time.

    Time only counts while the system is busy, so an idle minute does not
    decay the estimate to zero and make the next burst look unservable.
    """

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._sum = 0.0
        self._busy_s = 0.0
        self._last: float | None = None
        self._busy = False
        self._seen = False

    def advance(self, now: float, busy: bool) -> None:
        """Move to `now`; `busy` says whether the coming interval is busy."""
        if self._last is not None and self._busy:
            dt = max(0.0, now - self._last)
            self._sum *= math.exp(-dt / self.tau_s)
            self._busy_s += dt
        self._last = now
        self._busy = busy

    def add(self, amount: float) -> None:
        self._sum += amount
        self._seen = True

    def rate(self, now: float) -> float | None:
        """Per-second rate, or None before anything was measured."""
        if not self._seen or self._last is None:
            return None
        dt = max(0.0, now - self._last) if self._busy else 0.0
        busy_s = self._busy_s + dt
        if busy_s < MIN_MEASURED_BUSY_S:
            return None
        total = self._sum * math.exp(-dt / self.tau_s)
        # Bias correction: early on the window is shorter than tau.
        return total / (self.tau_s * (1.0 - math.exp(-busy_s / self.tau_s)))


class StepLimits(NamedTuple):
    """What `Scheduler.set_step_limits` takes; None = the config's budget."""

    max_running: int
    max_batched_tokens: int | None
    cap_idle_steps: bool = True  # the budget binds steps without a decode too


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

    def observe(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float) -> None:
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
        order that has work and a time >= 0 (AdmissionController.observe_step's
        rule): the same operations on local sums (a simulated hour feeds
        millions of decode steps)."""
        k = self._decay
        w, sd, sp, sy = self._w, self._d, self._p, self._y
        sdd, spp, sdp, sdy, spy = self._dd, self._pp, self._dp, self._dy, self._py
        dec_w, dec_d, dec_y, dec_dd, dec_dy = self._dec_w, self._dec_d, self._dec_y, self._dec_dd, self._dec_dy
        for num_decode_seqs, num_prefill_tokens, step_s in steps:
            if not (num_decode_seqs + num_prefill_tokens > 0 and step_s >= 0):
                continue
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


class AdmissionController:
    """Decides admit / degrade / reject and keeps the ledger of admitted work.

    Lifecycle of a request: `check` (pure) -> `admit` (records it) ->
    `on_start` (the engine scheduled it) -> `on_finish` (done, aborted or
    expired). `expired(now)` lists admitted requests that did not start in time.
    """

    def __init__(self, config: AdmissionConfig, num_blocks: int, block_size: int,
                 max_num_seqs: int, clock: Callable[[], float],
                 tenant_limits: Mapping[str, TenantLimits] | None = None) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.tenant_limits = dict(tenant_limits or {})
        self._tickets: dict[str, _Ticket] = {}
        # The unstarted tickets (in admission order, as in _tickets) and the
        # started ones' blocks: the per-request questions (queue length,
        # work ahead, expiry) then read only the queue, not every ticket.
        self._queued: dict[str, _Ticket] = {}
        self._started_blocks = 0
        self._drain_blocks = BusyRate(config.drain_window_s)
        self._drain_requests = BusyRate(config.drain_window_s)
        self._admissions = BusyRate(config.drain_window_s)
        self.step_model = StepTimeModel()
        self._retry_tokens = config.retry_budget_burst
        # Calibration of expected_wait_s against the waits actually observed.
        self._wait_ratio = 1.0
        self._start_latency_s = 0.0
        # tenant -> deque of [time, request_id, tokens]; tokens refunded on finish.
        self._tpm: dict[str, deque[list]] = {}
        self._tpm_entry: dict[str, list] = {}

    # ---- questions -------------------------------------------------------

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, num_cached_tokens: int = 0) -> int:
        tokens = max(0, num_prompt_tokens + max_tokens - num_cached_tokens)
        return -(-tokens // self.block_size)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_started(self) -> int:
        return len(self._tickets) - len(self._queued)

    def num_inflight(self, tenant: str | None = None) -> int:
        return sum(1 for t in self._tickets.values() if tenant is None or t.request.tenant == tenant)

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
        (intercept + per_decode_seq * B) fits the TPOT target with headroom;
        at least 1, at most max_num_seqs (also while nothing is measured)."""
        budget_s = self.config.tpot_slo_s * TPOT_HEADROOM
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
        budget_s = self.config.tpot_slo_s * TPOT_HEADROOM
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

    def max_wait_s(self, priority: int) -> float:
        """The class's limit: deferred classes (priority > 0) wait longer."""
        return self.config.deferred_max_queue_wait_s if priority > 0 else self.config.max_queue_wait_s

    def expected_wait_s(self, request: AdmissionRequest, max_tokens: int | None = None) -> tuple[float, str]:
        """Expected seconds until `request` can start, and what binds it
        (KV_CACHE or QUEUE_FULL for the running-batch slots)."""
        now = self.clock()
        max_tokens = request.max_tokens if max_tokens is None else max_tokens
        need = self.blocks_needed(request.num_prompt_tokens, max_tokens, request.num_cached_tokens)
        blocks_ahead, seqs_ahead = self._work_ahead(request, need)
        running_cap = self.running_cap()
        excess_blocks = blocks_ahead + need - self.num_blocks
        excess_seqs = seqs_ahead + 1 - running_cap
        # Before anything drained, allow one more cache (or batch) worth of
        # queue and refuse beyond it.
        kv_wait = _wait_for(excess_blocks, self._block_drain_rate(now), self.num_blocks)
        seq_wait = _wait_for(excess_seqs, self._request_drain_rate(now), running_cap)
        wait_s, binding = (kv_wait, KV_CACHE) if kv_wait >= seq_wait else (seq_wait, QUEUE_FULL)
        return self._calibrated(wait_s), binding

    def _calibrated(self, model_wait_s: float) -> float:
        """The drain model's wait, corrected by how observed waits compared
        with earlier predictions (multiplicative for queueing, additive for
        the fixed latency of getting scheduled at all)."""
        if model_wait_s < SHORT_WAIT_S:
            return model_wait_s + self._start_latency_s
        return model_wait_s * self._wait_ratio + self._start_latency_s

    def _work_ahead(self, request: AdmissionRequest, need: int) -> tuple[int, int]:
        """(blocks, requests) that will be served before `request`: everything
        started, queued work of more urgent classes, and within its own class
        its tenant's queue plus, from each other tenant, at most as much as
        its own tenant has queued (the scheduler shares a class fairly)."""
        blocks, seqs = self._started_blocks, len(self._tickets) - len(self._queued)
        same_class: dict[str, list[int]] = {}
        for t in self._queued.values():
            if t.request.priority < request.priority:
                blocks, seqs = blocks + t.num_blocks, seqs + 1
            elif t.request.priority == request.priority:
                tenant = same_class.setdefault(t.request.tenant, [0, 0])
                tenant[0] += t.num_blocks
                tenant[1] += 1
        own_blocks, own_seqs = same_class.pop(request.tenant, (0, 0))
        blocks, seqs = blocks + own_blocks, seqs + own_seqs
        for other_blocks, other_seqs in same_class.values():
            blocks += min(other_blocks, own_blocks + need)
            seqs += min(other_seqs, own_seqs + 1)
        return blocks, seqs

    def _block_drain_rate(self, now: float) -> float | None:
        measured = self._drain_blocks.rate(now)
        if measured is not None:
            return measured
        service_s = self._modelled_service_s()
        return None if service_s is None else self.num_blocks / service_s

    def _request_drain_rate(self, now: float) -> float | None:
        measured = self._drain_requests.rate(now)
        if measured is not None:
            return measured
        service_s = self._modelled_service_s()
        return None if service_s is None else self.running_cap() / service_s

    def _modelled_service_s(self) -> float | None:
        """Before anything finished: a full cache (or batch) turns over in
        about mean(max_tokens) decode steps of the measured step time."""
        step_s = self.step_model.mean_step_s
        if step_s is None or not self._tickets:
            return None
        mean_tokens = sum(t.max_tokens for t in self._tickets.values()) / len(self._tickets)
        service_s = step_s * mean_tokens
        return service_s if service_s > 0 else None

    # ---- the decision ----------------------------------------------------

    def check(self, request: AdmissionRequest) -> AdmissionDecision:
        """Decide without changing any state."""
        now = self.clock()
        need = self.blocks_needed(request.num_prompt_tokens, request.max_tokens, request.num_cached_tokens)
        if need > self.num_blocks:
            return _reject(400, NEVER_FITS, None, (
                f"the request needs {need} KV blocks (prompt + max_tokens) but the whole cache "
                f"holds {self.num_blocks}; shorten the prompt or lower max_tokens"))
        refusal = self._check_tenant(request, now) or self._check_retry(request, now)
        if refusal is not None:
            return refusal
        if self.num_queued >= self.config.max_queue_len:
            return _reject(429, QUEUE_FULL, 1, f"the waiting queue is full ({self.config.max_queue_len})")
        return self._check_wait(request, now)

    def refusal_for_any_size(self, priority: int = 0, tenant: str = "default", is_retry: bool = False,
                             deadline: float | None = None) -> AdmissionDecision | None:
        """The 429 that `check` would give every request of this class and
        tenant, whatever its prompt and max_tokens; None when the answer
        depends on the request's size. No state change.

        Lets the server refuse before tokenizing under overload: the refusals
        that need no token count (tenant concurrency, retry budget, a full
        queue) and the expected wait of a request needing zero KV blocks,
        a lower bound on any real request's wait (more blocks never wait
        less). The caller must rule out `check`'s size-dependent 400s itself.
        The reason may say `queue_full` where `check` would have said
        `kv_cache` (with zero blocks the batch slots bind), and Retry-After
        is the lower bound's."""
        now = self.clock()
        probe = AdmissionRequest("", 0, 0, 0, priority, tenant, is_retry, deadline)
        refusal = self._check_concurrency(probe) or self._check_retry(probe, now)
        if refusal is not None:
            return refusal
        if self.num_queued >= self.config.max_queue_len:
            return _reject(429, QUEUE_FULL, 1, f"the waiting queue is full ({self.config.max_queue_len})")
        limit_s = self._wait_limit_s(probe, now)
        wait_s, binding = self.expected_wait_s(probe)
        return self._wait_refusal(probe, wait_s, binding, limit_s) if wait_s > limit_s else None

    def _wait_limit_s(self, request: AdmissionRequest, now: float) -> float:
        limit_s = self.max_wait_s(request.priority)
        if request.deadline is not None:
            limit_s = min(limit_s, request.deadline - now)
        return limit_s

    def _wait_refusal(self, request: AdmissionRequest, wait_s: float, binding: str,
                      limit_s: float) -> AdmissionDecision:
        reason = DEADLINE if request.deadline is not None and limit_s < self.max_wait_s(request.priority) \
            else binding
        # Unbounded means nothing is measured yet: it will be within seconds.
        retry_s = _whole_seconds(wait_s - limit_s) if math.isfinite(wait_s) else 1
        return _reject(429, reason, retry_s,
                       f"expected queue wait {_fmt_s(wait_s)} exceeds the limit of {limit_s:.2f} s "
                       f"({binding.replace('_', ' ')})", wait_s)

    def _check_wait(self, request: AdmissionRequest, now: float) -> AdmissionDecision:
        limit_s = self._wait_limit_s(request, now)
        wait_s, binding = self.expected_wait_s(request)
        cap = self.config.degrade_max_tokens
        degrade_wait_s = self.config.degrade_wait_s
        can_degrade = degrade_wait_s is not None and request.max_tokens > cap
        if wait_s > limit_s:
            if can_degrade:
                capped_wait_s, _ = self.expected_wait_s(request, cap)
                if capped_wait_s <= limit_s:
                    return AdmissionDecision(DEGRADE, cap, expected_wait_s=capped_wait_s)
            return self._wait_refusal(request, wait_s, binding, limit_s)
        # Degrade on queueing only: the fixed latency of being scheduled at
        # all is paid by every request, even one that starts at once, and
        # counting it would degrade requests that take a free slot.
        if degrade_wait_s is not None and can_degrade and wait_s - self._start_latency_s > degrade_wait_s:
            return AdmissionDecision(DEGRADE, cap, expected_wait_s=wait_s)
        return AdmissionDecision(ADMIT, request.max_tokens, expected_wait_s=wait_s)

    def _check_concurrency(self, request: AdmissionRequest) -> AdmissionDecision | None:
        limits = self.tenant_limits.get(request.tenant)
        if limits is None or limits.max_concurrent is None:
            return None
        if self.num_inflight(request.tenant) >= limits.max_concurrent:
            return _reject(429, TENANT_QUOTA, 1,
                           f"tenant {request.tenant!r} has {limits.max_concurrent} requests in flight (its limit)")
        return None

    def _check_tenant(self, request: AdmissionRequest, now: float) -> AdmissionDecision | None:
        refusal = self._check_concurrency(request)
        limits = self.tenant_limits.get(request.tenant)
        if refusal is not None or limits is None or limits.tokens_per_minute is None:
            return refusal
        charge = request.num_prompt_tokens + request.max_tokens
        if charge > limits.tokens_per_minute:
            return _reject(400, NEVER_FITS, None,
                           f"prompt + max_tokens = {charge} exceeds tenant {request.tenant!r}'s "
                           f"{limits.tokens_per_minute} tokens per minute")
        used = self._tpm_used(request.tenant, now)
        if used + charge <= limits.tokens_per_minute:
            return None
        return _reject(429, TENANT_QUOTA, self._tpm_retry_after(request.tenant, charge, limits, now),
                       f"tenant {request.tenant!r} is over its {limits.tokens_per_minute} tokens per minute")

    def _check_retry(self, request: AdmissionRequest, now: float) -> AdmissionDecision | None:
        if not request.is_retry or self._retry_tokens >= 1.0 - 1e-9:  # 10 x 0.1 is 0.999...
            return None
        rate = self._admissions.rate(now)
        earn_s = (1.0 - self._retry_tokens) / (self.config.retry_budget * rate) \
            if rate and self.config.retry_budget > 0 else 1.0
        return _reject(429, RETRY_BUDGET, _whole_seconds(earn_s),
                       "retries are over budget: a retry claims KV for its whole context again")

    # ---- the ledger ------------------------------------------------------

    def admit(self, request: AdmissionRequest, decision: AdmissionDecision) -> None:
        """Record an admitted request (after `check` said admit or degrade)."""
        if not decision.admitted:
            raise ValueError(f"cannot admit a rejected request ({decision.reason})")
        if request.request_id in self._tickets:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        now = self.clock()
        self._advance(now, busy=True)
        max_tokens = decision.max_tokens or request.max_tokens
        start_by, reason = now + self.config.queue_timeout_s, QUEUE_TIMEOUT
        if request.deadline is not None and request.deadline < start_by:
            start_by, reason = request.deadline, DEADLINE
        self._tickets[request.request_id] = self._queued[request.request_id] = _Ticket(
            request, max_tokens,
            self.blocks_needed(request.num_prompt_tokens, max_tokens, request.num_cached_tokens),
            start_by, reason, now, decision.expected_wait_s)
        self._charge_tenant(request, max_tokens, now)
        self._admissions.add(1.0)
        if request.is_retry:
            self._retry_tokens -= 1.0
        else:
            self._retry_tokens = min(self.config.retry_budget_burst,
                                     self._retry_tokens + self.config.retry_budget)

    def on_start(self, request_id: str) -> None:
        """The engine scheduled it; the actual wait calibrates the prediction."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.started:
            return
        ticket.started = True
        del self._queued[request_id]
        self._started_blocks += ticket.num_blocks
        predicted_s = ticket.predicted_wait_s
        if predicted_s is None or not math.isfinite(predicted_s):
            return
        actual_s = max(0.0, self.clock() - ticket.admitted_at)
        w = CALIBRATION_WEIGHT
        if predicted_s < SHORT_WAIT_S:
            self._start_latency_s = (1 - w) * self._start_latency_s + w * actual_s
        else:
            ratio = min(MAX_WAIT_CORRECTION, max(1 / MAX_WAIT_CORRECTION, actual_s / predicted_s))
            self._wait_ratio = (1 - w) * self._wait_ratio + w * ratio

    def on_finish(self, request_id: str, num_tokens: int | None = None) -> None:
        """Release a request. num_tokens (prompt + output actually held)
        refunds the tenant's tokens-per-minute charge to what was used."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        now = self.clock()
        self._advance(now, busy=bool(self._tickets))
        if ticket.started:
            self._started_blocks -= ticket.num_blocks
            self._drain_blocks.add(ticket.num_blocks)
            self._drain_requests.add(1.0)
        else:
            del self._queued[request_id]
        entry = self._tpm_entry.pop(request_id, None)
        if entry is not None and num_tokens is not None:
            entry[2] = min(entry[2], num_tokens)

    def expired(self) -> list[tuple[str, str]]:
        """(request_id, reason) of admitted requests not started in time; the
        caller aborts them and calls on_finish."""
        now = self.clock()
        return [(rid, t.start_by_reason) for rid, t in self._queued.items()
                if t.start_by is not None and now > t.start_by]

    def observe_step(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float) -> None:
        """Feed one measured engine step (for the running cap and the
        prefill token budget); empty steps are ignored."""
        if num_decode_seqs + num_prefill_tokens > 0 and step_s >= 0:
            self.step_model.observe(num_decode_seqs, num_prefill_tokens, step_s)

    def observe_steps(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """observe_step of each (num_decode_seqs, num_prefill_tokens, step_s)
        in order, in one call (a simulator's multi-step decode run)."""
        self.step_model.observe_steps(steps)

    def _advance(self, now: float, busy: bool) -> None:
        for rate in (self._drain_blocks, self._drain_requests, self._admissions):
            rate.advance(now, busy)

    # ---- tenants ---------------------------------------------------------

    def _charge_tenant(self, request: AdmissionRequest, max_tokens: int, now: float) -> None:
        limits = self.tenant_limits.get(request.tenant)
        if limits is None or limits.tokens_per_minute is None:
            return
        entry = [now, request.request_id, request.num_prompt_tokens + max_tokens]
        self._tpm.setdefault(request.tenant, deque()).append(entry)
        self._tpm_entry[request.request_id] = entry

    def _tpm_used(self, tenant: str, now: float) -> int:
        window = self._tpm.get(tenant)
        if not window:
            return 0
        while window and window[0][0] <= now - TPM_WINDOW_S:
            window.popleft()
        return sum(entry[2] for entry in window)

    def _tpm_retry_after(self, tenant: str, charge: int, limits: TenantLimits, now: float) -> int:
        """Seconds until enough of the window expires to fit `charge`."""
        used = self._tpm_used(tenant, now)
        for time, _, tokens in self._tpm.get(tenant, ()):
            used -= tokens
            if used + charge <= limits.tokens_per_minute:
                return _whole_seconds(time + TPM_WINDOW_S - now)
        return int(TPM_WINDOW_S)


def _reject(status: int, reason: str, retry_after_s: int | None, message: str,
            expected_wait_s: float | None = None) -> AdmissionDecision:
    return AdmissionDecision(REJECT, None, status, reason, retry_after_s, expected_wait_s, message)


def _wait_for(excess: float, rate: float | None, cold_allowance: float) -> float:
    """Seconds to drain `excess` at `rate`; with no rate yet, zero within the
    allowance and unbounded beyond it."""
    if excess <= 0:
        return 0.0
    if rate is None:
        return 0.0 if excess <= cold_allowance else math.inf
    return excess / rate if rate > 0 else math.inf


def _whole_seconds(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 60


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if math.isfinite(seconds) else "unbounded (no measured drain)"
