"""Step time of one forward pass, in place of the torch runner.

A step's cost depends on its shape: how many new tokens go through the
weights (prefill chunks, one per decoding sequence), how much KV it reads
(every chunk attends to its whole context) and how many query-key pairs the
attention computes. Two models answer `step_time_s(shape)`:

- `RooflineCostModel` (plan/roofline.py, which `kvserve plan`'s service
  time estimate uses too): a named accelerator's peaks. A step takes the
  longer of its compute (2 x params per token + attention FLOPs) and its
  memory traffic (all weights once + the KV read), each at an achieved
  fraction of peak, plus a fixed per-step overhead (launches, the
  scheduler, sampling).
- `LinearCostModel`: coefficients fitted by `kvserve profile` to timed steps
  of the real engine on the local machine, optionally with a measured curve
  of step time over the tokens a step passes through the weights (on a CPU
  that curve is far from a line: a GEMM of 8 rows can cost more than one of
  24, and a few prefill tokens ride on the weight read of a decode step).

A fitted model predicts a step's typical (median) time, but a real machine
does not repeat a step in the same time: on a shared CPU one step in a
hundred takes twice its median. `kvserve profile` records that spread (each
repeat of a timed shape over the median of its repeats), and
`JitteredCostModel` multiplies each simulated step by a ratio drawn from
it, so a simulated tail (p99 TTFT is about one step at low load) carries
the machine's variation and not only the model's. A shared machine's speed
also moves over time (neighbours, frequency, memory traffic beside the
engine): a batch-1 decode step timed back to back runs 1.5-1.8x its median
in stretches of 50-200 ms, and 0.8x-1.3x for a second or more, which
per-step draws average away inside one request (a short request's decode
lasts about 100 ms). The profile records that drift too (`SpeedDrift`: the
mean step per 50 ms over the whole trace's mean), and the jittered model
replays stretches of it against simulated time, so requests that decode in
a slow stretch get the slow TPOT they get live.

A served step costs more than the step: between two steps the server's
engine thread hands the step's outputs to the event loop that streams them
(async_engine.py), and the two threads share the GIL, so the engine waits
while the event loop turns the outputs into SSE, between steps and inside
them. `kvserve profile` times a token's period through the same AsyncEngine
loop with a consumer reading every stream, against the fitted steps, and
`LinearCostModel.serving_overhead_s` charges the difference to every
simulated step.
"""

from __future__ import annotations

import bisect
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvserve.latency import percentile
from kvserve.model_facts.config import ModelConfig
from kvserve.plan.hardware import HardwareProfile, hardware_preset
from kvserve.plan.roofline import RooflineCostModel, StepShape


def chunk_shape(chunks) -> StepShape:
    """Shape of a batch of `ScheduledChunk`s; decode vs prefill is
    `ScheduledChunk.is_decode` (the same rule the server's step model uses)."""
    prefill = decode = kv_read = pairs = 0
    for chunk in chunks:
        n, start = chunk.num_new_tokens, chunk.start
        if chunk.is_decode:
            decode += 1
            prefill += len(chunk.spec_token_ids)  # drafts verified: priced as prefill tokens
        else:
            prefill += n
        kv_read += start + n
        pairs += n * start + n * (n + 1) // 2
    return StepShape(prefill, decode, kv_read, pairs)


class CostModel(Protocol):
    def step_time_s(self, shape: StepShape) -> float: ...

    def describe(self) -> dict: ...


def step_time_at_s(model: CostModel, shape: StepShape, start_s: float) -> float:
    """A step's time when it starts at simulated `start_s`: a model whose
    speed varies with time (`JitteredCostModel` with a measured drift)
    answers for that moment; any other model is the same at every time."""
    own = getattr(model, "step_time_at_s", None)
    return own(shape, start_s) if own is not None else model.step_time_s(shape)


def decode_step_ends_s(model: CostModel, start_s: float, shapes: list[tuple[int, int]]) -> list[float]:
    """End times of consecutive pure-decode steps from `start_s`, one per
    (decoding sequences, KV tokens read) shape: what adding up
    step_time_s(StepShape(0, seqs, kv, kv)) gives (a decode's attention
    pairs equal its KV read). A model's own `decode_step_ends_s` computes
    the same floats without a StepShape per step (a simulated hour has
    millions of decode steps)."""
    own = getattr(model, "decode_step_ends_s", None)
    if own is not None:
        return own(start_s, shapes)
    ends, t = [], start_s
    for num_seqs, kv_tokens in shapes:
        t = t + model.step_time_s(StepShape(0, num_seqs, kv_tokens, kv_tokens))
        ends.append(t)
    return ends


# Feature order of a fitted linear model (and of `kvserve profile`'s JSON).
LINEAR_FEATURES = ("intercept_s", "per_prefill_token_s", "per_decode_seq_s",
                   "per_kv_token_read_s", "per_attention_pair_s", "per_prefill_step_s", "per_decode_step_s")
# What a step pays once for having prompt rows, once for decode rows
# (LinearCostModel's e, f): fitted only where the samples tell them apart,
# and read as 0 from a profile written before them.
STEP_KIND_FEATURES = ("per_prefill_step_s", "per_decode_step_s")


@dataclass(frozen=True)
class LinearCostModel:
    """step_time = intercept + curve(tokens) + a x prefill tokens
                   + b x decode seqs + c x KV tokens read + d x attention pairs
                   + e x [any prefill tokens] + f x [any decode seqs]
                   + serving overhead

    with every coefficient >= 0 and tokens = prefill tokens + decode seqs.
    curve(tokens) is 0 without `token_knots`; with them it is the piecewise
    linear function through (token_knots[i], token_knot_s[i]): flat below the
    first knot, extended past the last along the last segment (never
    falling). A fit with a curve puts the intercept and the per-prefill-token
    cost into it; b then is what a decoding sequence costs beyond its token's
    pass through the weights (sampling, detokenizing, its attention call).

    e and f are what a step pays once for having prompt rows, and once for
    having decode rows: an engine whose prompt rows take weights of their
    own (kvserve's CPU path: prompts on bfloat16 tiles, decode rows on the
    quantized weights) streams both sets in a mixed step. There a 1-token
    prefill costs ~1.8x a 1-sequence decode step and a mixed step about the
    two added; one curve over all tokens averaged them and put the batch-1
    decode step 10-20% high. An engine with one pass through one set of
    weights fits e = f = 0."""

    intercept_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_read_s: float
    per_attention_pair_s: float = 0.0
    source: str = ""
    # The profiled engine's KV cache size and its other limits, so a
    # simulation of "this machine" defaults to the same cache.
    engine: tuple[tuple[str, int], ...] = ()
    token_knots: tuple[int, ...] = ()
    token_knot_s: tuple[float, ...] = ()
    # Measured step-to-step variation: each timed repeat over the median of
    # its repeats (empty: not measured). The model itself predicts the
    # median; `JitteredCostModel` applies these.
    step_jitter: tuple[float, ...] = ()
    # What serving adds to a step (the outputs' handoff to the event loop,
    # the GIL shared with it; measured by `kvserve profile` through
    # AsyncEngine): a served step occupies the engine this much longer than
    # the `EngineCore.step()` the coefficients were fitted to.
    serving_overhead_s: float = 0.0
    # The machine's speed over seconds (None: not measured); applied, as
    # the step jitter, by `JitteredCostModel`.
    speed_drift: SpeedDrift | None = None
    per_prefill_step_s: float = 0.0  # e above
    per_decode_step_s: float = 0.0  # f above

    def __post_init__(self) -> None:
        for name in (*LINEAR_FEATURES, "serving_overhead_s"):
            if not getattr(self, name) >= 0:  # `not >=` also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        _check_jitter_ratios(self.step_jitter)
        knots, values = self.token_knots, self.token_knot_s
        if len(knots) != len(values):
            raise ValueError(f"{len(knots)} token knots but {len(values)} knot times")
        if any(b <= a for a, b in zip(knots, knots[1:])) or (knots and knots[0] < 0):
            raise ValueError(f"token knots must be >= 0 and strictly increasing, got {list(knots)}")
        if any(v < 0 for v in values):
            raise ValueError("knot times must be >= 0")

    def token_curve_s(self, num_tokens: int) -> float:
        """The curve's step time at `num_tokens` (0 without knots)."""
        knots, values = self.token_knots, self.token_knot_s
        if not knots:
            return 0.0
        if num_tokens <= knots[0]:
            return values[0]
        if num_tokens >= knots[-1]:
            if len(knots) == 1:
                return values[-1]
            slope = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
            return values[-1] + max(0.0, slope) * (num_tokens - knots[-1])
        i = bisect.bisect_right(knots, num_tokens)
        x0, x1, y0, y1 = knots[i - 1], knots[i], values[i - 1], values[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        t = (self.intercept_s + self.serving_overhead_s + self.per_prefill_token_s * shape.num_prefill_tokens
             + self.per_decode_seq_s * shape.num_decode_seqs
             + self.per_kv_token_read_s * shape.kv_tokens_read
             + self.per_attention_pair_s * shape.attention_pairs
             + (self.per_prefill_step_s if shape.num_prefill_tokens else 0.0)
             + (self.per_decode_step_s if shape.num_decode_seqs else 0.0))
        if self.token_knots:
            t += self.token_curve_s(shape.num_tokens)
        return t

    def describe(self) -> dict:
        described = {"kind": "linear", "source": self.source,
                     **{name: getattr(self, name) for name in LINEAR_FEATURES}}
        if self.token_knots:
            described["token_curve"] = {"tokens": list(self.token_knots), "step_s": list(self.token_knot_s)}
        if self.step_jitter:
            described["step_jitter_measured"] = jitter_summary(self.step_jitter)
        if self.serving_overhead_s:
            described["serving_overhead_s"] = self.serving_overhead_s
        if self.speed_drift is not None:
            described["speed_drift_measured"] = self.speed_drift.summary()
        return described


@dataclass(frozen=True)
class SpeedDrift:
    """How the machine's speed moved over a measured stretch of time: per
    `bin_s` of a trace of back-to-back reference steps, the mean step over
    the whole trace's mean (1.2: that stretch ran 20% slower than the
    trace's average). A simulation replays it in blocks of `block_s` drawn
    from random places in the trace: the drift's own correlation (a slow
    stretch is followed by a slow stretch) kept inside a block, fresh
    realizations between blocks.

    Means, not medians: a bin's median hides a slow stretch shorter than
    half a bin, and on the 2026-12-07 EPYC the slow stretches that make a
    short request's TPOT 1.3-1.6x are 50-200 ms of steps run 1.5-1.8x
    (over 90 s of the engine alone, quarter-second medians read 1.20x at
    most where 50 ms means read up to 1.65x). Over the trace's mean, not its
    median: the factors average 1, so the drift moves a step's time around
    the level the fit and the step jitter's ratios give it without raising
    that level a second time."""

    bin_s: float
    factors: tuple[float, ...]
    block_s: float

    def __post_init__(self) -> None:
        if not self.bin_s > 0 or not self.block_s > 0:
            raise ValueError(f"speed drift bin_s and block_s must be > 0, got {self.bin_s} and {self.block_s}")
        if not self.factors or any(not f > 0 for f in self.factors):
            raise ValueError("speed drift needs factors, each > 0")

    @property
    def block_bins(self) -> int:
        return max(1, min(len(self.factors), round(self.block_s / self.bin_s)))

    def summary(self) -> dict:
        ordered = sorted(self.factors)
        return {"bin_s": self.bin_s, "block_s": self.block_s, "num_bins": len(ordered),
                "p10": percentile(ordered, 10), "p50": percentile(ordered, 50), "p90": percentile(ordered, 90),
                "max": ordered[-1], "mean": sum(ordered) / len(ordered)}

    def to_json(self) -> dict:
        return {"about": "per bin_s of back-to-back batch-1 decode steps, their mean over the whole "
                         "trace's: the machine's speed over time, replayed by kvserve simulate in blocks of "
                         "block_s", **self.summary(), "factors": [round(f, 4) for f in self.factors]}

    @classmethod
    def from_json(cls, raw: dict) -> "SpeedDrift":
        return cls(float(raw["bin_s"]), tuple(float(f) for f in raw["factors"]), float(raw["block_s"]))

    @classmethod
    def of_steps(cls, steps: list[tuple[float, float]], bin_s: float, block_s: float,
                 min_steps_per_bin: int = 3) -> "SpeedDrift | None":
        """From (start time s, step s) of reference steps of one shape (or
        nearly): each bin's mean step over the mean of the steps in bins
        kept; None when no bin holds `min_steps_per_bin` steps."""
        start = steps[0][0] if steps else 0.0
        bins: dict[int, list[float]] = {}
        for at, step_s in steps:
            bins.setdefault(int((at - start) // bin_s), []).append(step_s)
        kept = [v for _, v in sorted(bins.items()) if len(v) >= min_steps_per_bin]
        if not kept:
            return None
        reference = statistics.fmean(t for v in kept for t in v)
        factors = tuple(statistics.fmean(v) / reference for v in kept)
        return cls(bin_s, factors, block_s) if reference > 0 else None


def _check_jitter_ratios(ratios: tuple[float, ...]) -> None:
    if any(not r > 0 for r in ratios):  # `not >` also refuses NaN
        raise ValueError("step jitter ratios must be > 0")


def jitter_summary(ratios: tuple[float, ...]) -> dict:
    """How many ratios, and their p50 / p90 / p99 (the project's one
    percentile definition, kvserve.latency), max and mean."""
    ordered = sorted(ratios)
    return {"num_ratios": len(ordered), "p50": percentile(ordered, 50), "p90": percentile(ordered, 90),
            "p99": percentile(ordered, 99), "max": ordered[-1], "mean": sum(ordered) / len(ordered)}


class JitteredCostModel:
    """`base`'s step times, each multiplied by a ratio drawn (uniformly,
    with replacement) from `ratios` (the measured spread of a step's time
    around its median) and, with a `drift`, by the machine's speed at the
    step's start (`SpeedDrift`). Draws come from generators seeded by
    `seed`, one ratio per step in the order the simulation asks, so a run is
    reproducible. Steps are drawn independently: on this project's CPU,
    consecutive decode steps' times correlate weakly (lag-1 correlation
    ~0.1); what correlates over seconds is the drift.

    Each replica is its own machine: `for_replica(i)` is the same model with
    replica i's own draws (replica 0's are this model's).

    Under jitter the simulator's fast-forward path (a decode run's steps
    timed a stretch at a time, some never used) draws in a different order
    than single steps would: the same process, another realization."""

    def __init__(self, base: CostModel, ratios: tuple[float, ...], seed: int,
                 drift: SpeedDrift | None = None, replica: int = 0) -> None:
        if not ratios and drift is None:
            raise ValueError("step jitter needs at least one measured ratio or a speed drift")
        _check_jitter_ratios(ratios)
        self.base = base
        self.ratios = tuple(ratios)
        self.seed = seed
        self.drift = drift
        self.replica = replica
        # String seeds: not the stream the workload generator draws from
        # for the same --seed.
        suffix = f":{replica}" if replica else ""
        self._random = random.Random(f"step-jitter:{seed}{suffix}").random
        self._block: int | None = None  # the drift block the last step started in, and where it starts
        self._block_start = 0  # in the trace

    def for_replica(self, index: int) -> "JitteredCostModel":
        if index == self.replica:
            return self
        return JitteredCostModel(self.base, self.ratios, self.seed, self.drift, index)

    def _ratio(self) -> float:
        ratios = self.ratios
        return ratios[int(self._random() * len(ratios))] if ratios else 1.0

    def _speed(self, t_s: float) -> float:
        drift = self.drift
        if drift is None:
            return 1.0
        factors, span = drift.factors, drift.block_bins
        block, position = divmod(int(t_s // drift.bin_s), span)
        if block != self._block:
            self._block = block
            draw = random.Random(f"speed-drift:{self.seed}:{self.replica}:{block}")
            self._block_start = draw.randrange(len(factors) - span + 1)
        return factors[self._block_start + position]

    def step_time_s(self, shape: StepShape) -> float:
        """Without a start time: the per-step jitter only."""
        return self.base.step_time_s(shape) * self._ratio()

    def step_time_at_s(self, shape: StepShape, start_s: float) -> float:
        return step_time_at_s(self.base, shape, start_s) * self._ratio() * self._speed(start_s)

    def decode_step_ends_s(self, start_s: float, shapes: list[tuple[int, int]]) -> list[float]:
        base = self.base
        ends: list[float] = []
        t = start_s
        for num_seqs, kv_tokens in shapes:
            t = t + base.step_time_s(StepShape(0, num_seqs, kv_tokens, kv_tokens)) * self._ratio() * self._speed(t)
            ends.append(t)
        return ends

    def describe(self) -> dict:
        described = self.base.describe()
        if self.ratios:
            described["step_jitter"] = {**jitter_summary(self.ratios), "seed": self.seed}
        if self.drift is not None:
            described["speed_drift"] = {**self.drift.summary(), "seed": self.seed}
        return described


class SlowedCostModel:
    """`base`'s step times x `factor`: a slow replica (a failure scenario,
    sim/failures.py), e.g. a throttled or degraded accelerator."""

    def __init__(self, base: CostModel, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"a slowdown factor must be > 0, got {factor}")
        self.base = base
        self.factor = factor

    def step_time_s(self, shape: StepShape) -> float:
        return self.base.step_time_s(shape) * self.factor

    def step_time_at_s(self, shape: StepShape, start_s: float) -> float:
        return step_time_at_s(self.base, shape, start_s) * self.factor

    def decode_step_ends_s(self, start_s: float, shapes: list[tuple[int, int]]) -> list[float]:
        factor = self.factor
        ends: list[float] = []
        t = start_s
        previous = start_s
        for end in decode_step_ends_s(self.base, start_s, shapes):
            t = t + (end - previous) * factor
            previous = end
            ends.append(t)
        return ends

    def describe(self) -> dict:
        return {**self.base.describe(), "slowed_by": self.factor}


def with_step_jitter(model: CostModel, jitter: str, seed: int) -> CostModel:
    """`model` with the step jitter and speed drift its profile measured
    (`jitter` "profile") or without either ("none"). A model that measured
    neither (a roofline preset, an older profile) is returned as it is."""
    if jitter not in ("profile", "none"):
        raise ValueError(f"step jitter must be 'profile' or 'none', got {jitter!r}")
    if jitter == "none" or not isinstance(model, LinearCostModel):
        return model
    if not model.step_jitter and model.speed_drift is None:
        return model
    return JitteredCostModel(model, model.step_jitter, seed, model.speed_drift)


def load_profile(path: Path) -> LinearCostModel | HardwareProfile:
    """A `kvserve profile` JSON (kind "linear") or a custom accelerator
    (kind "hardware": name, flops_per_s, memory_bandwidth_bytes_per_s, memory_bytes)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read hardware profile {str(path)!r}: {exc}") from None
    kind = raw.get("kind")
    if kind == "linear":
        coefficients = raw.get("coefficients", {})
        missing = [n for n in LINEAR_FEATURES if n not in coefficients and n not in STEP_KIND_FEATURES]
        if missing:
            raise ValueError(f"profile {str(path)!r} lacks coefficients {missing}")
        engine = tuple(sorted((k, int(v)) for k, v in raw.get("engine", {}).items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)))
        curve = raw.get("token_curve") or {}
        try:
            knots = tuple(int(n) for n in curve.get("tokens", ()))
            knot_s = tuple(float(t) for t in curve.get("step_s", ()))
        except (TypeError, ValueError):
            raise ValueError(f"profile {str(path)!r}: token_curve needs lists 'tokens' and 'step_s'") from None
        try:
            jitter = tuple(float(r) for r in (raw.get("step_jitter") or {}).get("ratios", ()))
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"profile {str(path)!r}: step_jitter needs a list 'ratios' of numbers") from None
        try:  # profiles written before the serving loop was timed have none
            overhead = float((raw.get("serving_loop") or {}).get("overhead_per_step_s", 0.0))
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"profile {str(path)!r}: serving_loop needs a number 'overhead_per_step_s'") from None
        try:  # profiles written before the drift was timed have none
            drift = SpeedDrift.from_json(raw["speed_drift"]) if raw.get("speed_drift") else None
        except (TypeError, ValueError, KeyError, AttributeError):
            raise ValueError(f"profile {str(path)!r}: speed_drift needs numbers 'bin_s' and 'block_s' "
                             "and a list 'factors' of numbers > 0") from None
        return LinearCostModel(**{n: float(coefficients.get(n, 0.0)) for n in LINEAR_FEATURES},
                               source=str(path), engine=engine, token_knots=knots, token_knot_s=knot_s,
                               step_jitter=jitter, serving_overhead_s=overhead, speed_drift=drift)
    if kind == "hardware":
        return HardwareProfile(name=str(raw.get("name", Path(path).stem)),
                               flops_per_s=float(raw["flops_per_s"]),
                               memory_bandwidth_bytes_per_s=float(raw["memory_bandwidth_bytes_per_s"]),
                               memory_bytes=int(raw["memory_bytes"]), source=str(path))
    raise ValueError(f"profile {str(path)!r}: kind must be 'linear' or 'hardware', got {kind!r}")


def resolve_hardware(spec: str) -> LinearCostModel | HardwareProfile:
    """A preset name (h100, h200, a100, l4) or a JSON profile path."""
    if spec.endswith(".json") or Path(spec).is_file():
        return load_profile(Path(spec))
    return hardware_preset(spec)


def build_cost_model(hardware: LinearCostModel | HardwareProfile, config: ModelConfig,
                     weight_bytes_per_param: float = 2.0, kv_dtype_bytes: float = 2.0) -> CostModel:
    if isinstance(hardware, LinearCostModel):
        return hardware
    return RooflineCostModel(config, hardware, weight_bytes_per_param, kv_dtype_bytes)


def fit_linear_cost_model(samples: list[tuple[StepShape, float]], source: str = "",
                          engine: dict | None = None,
                          token_knots: tuple[int, ...] | None = None) -> tuple[LinearCostModel, dict]:
    """Fit `LinearCostModel` to (shape, measured seconds) pairs by
    non-negative least squares on relative error (a negative per-token cost
    would make a bigger batch faster; relative, because a 60 ms decode step
    mispredicted by 20 ms matters as much as a 600 ms prefill off by 200).

    With `token_knots` (token counts the profile swept), the fit also
    measures the curve of step time over tokens per step at those knots, in
    place of the intercept and the per-prefill-token line: the model stays
    linear in its unknowns (each knot's time weighs in through linear
    interpolation), so it is the same least-squares problem with more
    columns. No knot is fitted below the first: any step streams all the
    weights at least once, so more tokens never cost less than one (the
    unknowns are the first knot's time and each other knot's excess over
    it, all >= 0). Without that, noisy steps could fit a knot at 0 s and
    predict steps that take no time.

    The per-step terms for prompt rows and for decode rows (e, f) are
    fitted only where they can be told apart from the rest: the samples
    hold steps of prompt rows alone, of decode rows alone and of both, and
    enough of them for the two more unknowns (`kvserve profile`'s grid
    does); otherwise they are 0. Returns the model and fit statistics
    (r2, mean absolute relative error, number of samples)."""
    import numpy as np

    knots = tuple(sorted(set(token_knots or ())))
    if knots and samples:
        # Past the last knot token_curve_s never falls (a floor no linear
        # fit can express): a step larger than every knot gets a knot of its
        # own, so the fit never extrapolates and its predictions are the
        # model's.
        largest = max(s.num_tokens for s, _ in samples)
        if largest > knots[-1]:
            knots += (largest,)
    line_features = tuple(n for n in (LINEAR_FEATURES[2:] if knots else LINEAR_FEATURES)
                          if n not in STEP_KIND_FEATURES)
    num_unknowns = len(knots) + len(line_features)
    kinds = {(s.num_prefill_tokens > 0, s.num_decode_seqs > 0) for s, _ in samples}
    told_apart = {(True, False), (False, True), (True, True)} <= kinds
    if told_apart and len(samples) >= num_unknowns + len(STEP_KIND_FEATURES):
        line_features += STEP_KIND_FEATURES
        num_unknowns += len(STEP_KIND_FEATURES)
    if len(samples) < num_unknowns:
        raise ValueError(f"need at least {num_unknowns} timed steps to fit, got {len(samples)}")
    shapes = [s for s, _ in samples]
    columns = {"intercept_s": [1.0] * len(shapes),
               "per_prefill_token_s": [s.num_prefill_tokens for s in shapes],
               "per_decode_seq_s": [s.num_decode_seqs for s in shapes],
               "per_kv_token_read_s": [s.kv_tokens_read for s in shapes],
               "per_attention_pair_s": [s.attention_pairs for s in shapes],
               "per_prefill_step_s": [1.0 if s.num_prefill_tokens else 0.0 for s in shapes],
               "per_decode_step_s": [1.0 if s.num_decode_seqs else 0.0 for s in shapes]}
    x = np.array([columns[name] for name in line_features], dtype=float).T
    if knots:
        # curve = weights @ knot times; knot times = first + [0, excess...],
        # and each row's weights sum to 1: curve = first + weights[:, 1:] @ excess.
        weights = _knot_weights(knots, [s.num_tokens for s in shapes])
        x = np.hstack([np.ones((len(shapes), 1)), weights[:, 1:], x])
    y = np.array([t for _, t in samples], dtype=float)
    if (y <= 0).any():
        raise ValueError("every timed step must take > 0 seconds")
    # Relative error: each row divided by its own time. Columns scaled to
    # unit size so the solve is well conditioned (pairs reach 1e5+).
    rows = x / y[:, None]
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nnls(rows / scale, np.ones(len(y))) / scale
    predicted = x @ coef
    residual = y - predicted
    r2 = 1.0 - float(residual @ residual) / max(float(((y - y.mean()) ** 2).sum()), 1e-300)
    stats = {"num_samples": len(samples), "r2": r2,
             "mean_abs_rel_error": float(np.mean(np.abs(residual) / y))}
    fitted = dict(zip(line_features, (float(c) for c in coef[len(knots):])))
    knot_s = tuple(float(coef[0]) + (float(c) if i else 0.0) for i, c in enumerate(coef[:len(knots)]))
    coefficient = {name: fitted.get(name, 0.0) for name in LINEAR_FEATURES}
    model = LinearCostModel(coefficient["intercept_s"], coefficient["per_prefill_token_s"],
                            coefficient["per_decode_seq_s"], coefficient["per_kv_token_read_s"],
                            coefficient["per_attention_pair_s"], source=source,
                            engine=tuple(sorted((engine or {}).items())), token_knots=knots,
                            token_knot_s=knot_s, per_prefill_step_s=coefficient["per_prefill_step_s"],
                            per_decode_step_s=coefficient["per_decode_step_s"])
    return model, stats


def _knot_weights(knots: tuple[int, ...], num_tokens: list[int]):
    """Row i: the weight of each knot's time in curve(num_tokens[i]), i.e.
    `LinearCostModel.token_curve_s` written as a linear map of the knot
    times, for token counts up to the last knot (the fit adds a knot for
    larger ones)."""
    import numpy as np

    if max(num_tokens, default=0) > knots[-1]:
        raise ValueError(f"{max(num_tokens)} tokens lie past the last knot {knots[-1]}")
    weights = np.zeros((len(num_tokens), len(knots)))
    for row, n in enumerate(num_tokens):
        if n <= knots[0]:
            weights[row, 0] = 1.0
            continue
        i = min(bisect.bisect_right(knots, n), len(knots) - 1)  # n == the last knot: the last segment
        share = (n - knots[i - 1]) / (knots[i] - knots[i - 1])
        weights[row, i - 1] = 1.0 - share
        weights[row, i] = share
    return weights


def _nnls(a, b):
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set
    method; numpy only, the problems here have a few dozen columns)."""
    import numpy as np

    num_rows, num_cols = a.shape
    x = np.zeros(num_cols)
    passive = np.zeros(num_cols, dtype=bool)
    tolerance = 10 * np.finfo(float).eps * max(num_rows, num_cols) * max(1.0, float(np.abs(a).sum(axis=0).max()))
    for _ in range(3 * num_cols + 10):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(passive, -np.inf, gradient)
        if passive.all() or candidates.max() <= tolerance:
            break
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(num_cols)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x toward z until the first passive coefficient hits 0.
            blocked = passive & (z <= 0)
            gaps = x[blocked] - z[blocked]  # >= 0; 0 when both sit at 0
            alpha = float(np.min(np.divide(x[blocked], gaps, out=np.zeros_like(gaps), where=gaps > 0)))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x


def profile_json(model: LinearCostModel, stats: dict, engine: dict, about: dict,
                 samples: list[tuple[StepShape, float]], serving_loop: dict | None = None) -> dict:
    """The document `kvserve profile` writes and `--hardware PATH` reads.
    `serving_loop`: what the serving loop's timing measured besides the
    model's overhead (steps, their mean), kept beside it."""
    curve = {"tokens": list(model.token_knots), "step_s": list(model.token_knot_s)} if model.token_knots else None
    jitter = None
    if model.step_jitter:
        jitter = {"about": "each timed repeat of a shape over the median of its repeats",
                  **jitter_summary(model.step_jitter), "ratios": [round(r, 4) for r in model.step_jitter]}
    loop = {"about": "mean time per step the serving loop adds to the fitted step (the outputs' handoff "
                     "to the event loop, the GIL the two threads share); charged to every simulated step",
            **(serving_loop or {}), "overhead_per_step_s": model.serving_overhead_s}
    return {"kind": "linear", "coefficients": {n: getattr(model, n) for n in LINEAR_FEATURES},
            "token_curve": curve, "step_jitter": jitter, "serving_loop": loop,
            "speed_drift": model.speed_drift.to_json() if model.speed_drift is not None else None,
            "fit": stats, "engine": engine,
            "about": about, "samples": [{**s._asdict(), "step_s": t} for s, t in samples]}
