"""Step time of one forward pass, in place of the torch runner.

A step's cost depends on its shape: how many new tokens go through the
weights (prefill chunks, one per decoding sequence), how much KV it reads
(every chunk attends to its whole context) and how many query-key pairs the
attention computes. Two models answer `step_time_s(shape)`:

- `RooflineCostModel`: a named accelerator's peaks. A step takes the longer
  of its compute (2 x params per token + attention FLOPs) and its memory
  traffic (all weights once + the KV read), each at an achieved fraction of
  peak, plus a fixed per-step overhead (launches, the scheduler, sampling).
- `LinearCostModel`: coefficients fitted by `kvserve profile` to timed steps
  of the real engine on the local machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from kvserve.model.config import ModelConfig
from kvserve.plan.kv_math import kv_bytes_per_token, weight_bytes
from kvserve.sim.hardware import HardwareProfile, hardware_preset


class StepShape(NamedTuple):
    """What a step computes (all counts are tokens unless named otherwise)."""

    num_prefill_tokens: int  # tokens of prefill / recompute chunks
    num_decode_seqs: int  # sequences generating one token this step
    kv_tokens_read: int  # sum over chunks of the context attended (start + new)
    attention_pairs: int  # query-key pairs: sum of new x (start + (new + 1) / 2)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


def chunk_shape(chunks) -> StepShape:
    """Shape of a batch of `ScheduledChunk`s; decode vs prefill is
    `ScheduledChunk.is_decode` (the same rule the server's step model uses)."""
    prefill = decode = kv_read = pairs = 0
    for chunk in chunks:
        n, start = chunk.num_new_tokens, chunk.start
        if chunk.is_decode:
            decode += 1
        else:
            prefill += n
        kv_read += start + n
        pairs += n * start + n * (n + 1) // 2
    return StepShape(prefill, decode, kv_read, pairs)


class CostModel(Protocol):
    def step_time_s(self, shape: StepShape) -> float: ...

    def describe(self) -> dict: ...


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


@dataclass(frozen=True)
class RooflineCostModel:
    """Roofline step time of `config` on `hardware`.

    compute_efficiency / bandwidth_efficiency: achieved fractions of peak
    (well-tuned serving stacks reach roughly 40-60% of peak matmul FLOP/s in
    mixed batches and 70-85% of HBM bandwidth in decode).
    step_overhead_s: fixed per step (kernel launches, scheduling, sampling).
    """

    config: ModelConfig
    hardware: HardwareProfile
    weight_bytes_per_param: float = 2.0
    kv_dtype_bytes: float = 2.0
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        cfg = self.config
        # Cached per-unit costs: the simulator calls step_time_s once per step.
        object.__setattr__(self, "_flops_per_token", 2.0 * cfg.num_parameters())
        object.__setattr__(self, "_flops_per_pair",
                           4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim)
        object.__setattr__(self, "_weight_bytes", weight_bytes(cfg, self.weight_bytes_per_param))
        object.__setattr__(self, "_kv_bytes_per_token", kv_bytes_per_token(cfg, self.kv_dtype_bytes))
        object.__setattr__(self, "_flops_per_s", self.hardware.flops_per_s * self.compute_efficiency)
        object.__setattr__(self, "_bytes_per_s",
                           self.hardware.memory_bandwidth_bytes_per_s * self.bandwidth_efficiency)

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        flops = self._flops_per_token * shape.num_tokens + self._flops_per_pair * shape.attention_pairs
        traffic = self._weight_bytes + self._kv_bytes_per_token * shape.kv_tokens_read
        return max(flops / self._flops_per_s, traffic / self._bytes_per_s) + self.step_overhead_s

    def decode_step_ends_s(self, start_s: float, shapes: list[tuple[int, int]]) -> list[float]:
        """`decode_step_ends_s` of this model: step_time_s's operations, in its order."""
        per_token, per_pair = self._flops_per_token, self._flops_per_pair
        weights, per_kv = self._weight_bytes, self._kv_bytes_per_token
        flops_per_s, bytes_per_s, overhead = self._flops_per_s, self._bytes_per_s, self.step_overhead_s
        ends, t = [], start_s
        for num_seqs, kv_tokens in shapes:
            if num_seqs == 0:
                ends.append(t)
                continue
            compute_s = (per_token * num_seqs + per_pair * kv_tokens) / flops_per_s
            memory_s = (weights + per_kv * kv_tokens) / bytes_per_s
            t = t + (max(compute_s, memory_s) + overhead)
            ends.append(t)
        return ends

    def describe(self) -> dict:
        return {"kind": "roofline", "hardware": asdict(self.hardware),
                "compute_efficiency": self.compute_efficiency,
                "bandwidth_efficiency": self.bandwidth_efficiency,
                "step_overhead_s": self.step_overhead_s,
                "weight_bytes": self._weight_bytes, "kv_bytes_per_token": self._kv_bytes_per_token}


# Feature order of a fitted linear model (and of `kvserve profile`'s JSON).
LINEAR_FEATURES = ("intercept_s", "per_prefill_token_s", "per_decode_seq_s",
                   "per_kv_token_read_s", "per_attention_pair_s")


@dataclass(frozen=True)
class LinearCostModel:
    """step_time = intercept + a x prefill tokens + b x decode seqs
                   + c x KV tokens read + d x attention pairs (all >= 0)."""

    intercept_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_read_s: float
    per_attention_pair_s: float = 0.0
    source: str = ""
    # The profiled engine's KV cache size and its other limits, so a
    # simulation of "this machine" defaults to the same cache.
    engine: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name in LINEAR_FEATURES:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return (self.intercept_s + self.per_prefill_token_s * shape.num_prefill_tokens
                + self.per_decode_seq_s * shape.num_decode_seqs
                + self.per_kv_token_read_s * shape.kv_tokens_read
                + self.per_attention_pair_s * shape.attention_pairs)

    def describe(self) -> dict:
        return {"kind": "linear", "source": self.source,
                **{name: getattr(self, name) for name in LINEAR_FEATURES}}


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
        missing = [n for n in LINEAR_FEATURES if n not in coefficients]
        if missing:
            raise ValueError(f"profile {str(path)!r} lacks coefficients {missing}")
        engine = tuple(sorted((k, int(v)) for k, v in raw.get("engine", {}).items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)))
        return LinearCostModel(**{n: float(coefficients[n]) for n in LINEAR_FEATURES},
                               source=str(path), engine=engine)
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
                          engine: dict | None = None) -> tuple[LinearCostModel, dict]:
    """Least-squares fit of `LinearCostModel` to (shape, measured seconds)
    pairs, with every coefficient kept >= 0 (a negative per-token cost would
    make a bigger batch faster): features whose coefficient comes out
    negative are dropped and the rest refitted. Returns the model and fit
    statistics (r2, mean absolute relative error, number of samples)."""
    import numpy as np

    if len(samples) < len(LINEAR_FEATURES):
        raise ValueError(f"need at least {len(LINEAR_FEATURES)} timed steps to fit, got {len(samples)}")
    x = np.array([[1.0, s.num_prefill_tokens, s.num_decode_seqs, s.kv_tokens_read, s.attention_pairs]
                  for s, _ in samples])
    y = np.array([t for _, t in samples])
    # Scale columns so lstsq is well conditioned (pairs reach 1e5+, intercept is 1).
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        solution = solution / scale[active]
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    predicted = x @ coef
    residual = y - predicted
    r2 = 1.0 - float(residual @ residual) / max(float(((y - y.mean()) ** 2).sum()), 1e-300)
    stats = {"num_samples": len(samples), "r2": r2,
             "mean_abs_rel_error": float(np.mean(np.abs(residual) / np.maximum(y, 1e-12)))}
    model = LinearCostModel(*(float(c) for c in coef), source=source,
                            engine=tuple(sorted((engine or {}).items())))
    return model, stats


def profile_json(model: LinearCostModel, stats: dict, engine: dict, about: dict,
                 samples: list[tuple[StepShape, float]]) -> dict:
    """The document `kvserve profile` writes and `--hardware PATH` reads."""
    return {"kind": "linear", "coefficients": {n: getattr(model, n) for n in LINEAR_FEATURES},
            "fit": stats, "engine": engine, "about": about,
            "samples": [{**s._asdict(), "step_s": t} for s, t in samples]}
