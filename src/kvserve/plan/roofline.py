"""The shape of one engine step, and its roofline time on a named accelerator.

A step's cost depends on its shape: how many new tokens go through the
weights (prefill chunks, one per decoding sequence), how much KV it reads
(every chunk attends to its whole context) and how many query-key pairs the
attention computes. `RooflineCostModel` turns a shape into seconds from a
hardware profile's peaks. `kvserve plan` estimates service times with it,
and `kvserve simulate` steps its virtual clock with it (sim/cost_model.py
holds the simulator's other cost models), so both use one model of the
hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from kvserve.model_facts.config import ModelConfig
from kvserve.model_facts.memory import weight_bytes
from kvserve.plan.hardware import HardwareProfile


class StepShape(NamedTuple):
    """What a step computes (all counts are tokens unless named otherwise)."""

    num_prefill_tokens: int  # tokens of prefill / recompute chunks
    num_decode_seqs: int  # sequences generating one token this step
    kv_tokens_read: int  # sum over chunks of the context attended (start + new)
    attention_pairs: int  # query-key pairs: sum of new x (start + (new + 1) / 2)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


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
    # Per-unit costs derived from the above in __post_init__ (the simulator
    # asks for a step time millions of times an hour).
    _flops_per_token: float = field(init=False, repr=False, compare=False)
    _flops_per_pair: float = field(init=False, repr=False, compare=False)
    _weight_bytes: int = field(init=False, repr=False, compare=False)
    _kv_bytes_per_token: int = field(init=False, repr=False, compare=False)
    _flops_per_s: float = field(init=False, repr=False, compare=False)
    _bytes_per_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        cfg = self.config
        object.__setattr__(self, "_flops_per_token", 2.0 * cfg.num_parameters())
        object.__setattr__(self, "_flops_per_pair",
                           4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim)
        object.__setattr__(self, "_weight_bytes", weight_bytes(cfg, self.weight_bytes_per_param))
        object.__setattr__(self, "_kv_bytes_per_token", cfg.kv_bytes_per_token(self.kv_dtype_bytes))
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
        ends: list[float] = []
        t = start_s
        append = ends.append
        for num_seqs, kv_tokens in shapes:  # millions of steps an hour: no calls but append
            if num_seqs:
                compute_s = (per_token * num_seqs + per_pair * kv_tokens) / flops_per_s
                memory_s = (weights + per_kv * kv_tokens) / bytes_per_s
                # max(compute_s, memory_s), which returns compute_s on a tie
                t = t + ((memory_s if memory_s > compute_s else compute_s) + overhead)
            append(t)
        return ends

    def describe(self) -> dict:
        return {"kind": "roofline", "hardware": asdict(self.hardware),
                "compute_efficiency": self.compute_efficiency,
                "bandwidth_efficiency": self.bandwidth_efficiency,
                "step_overhead_s": self.step_overhead_s,
                "weight_bytes": self._weight_bytes, "kv_bytes_per_token": self._kv_bytes_per_token}
