"""Frozen configuration dataclasses, validated once at construction.

Sizes accept human strings ("2GiB", "512MiB", "1.5GB") through `parse_size`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB", "4096" or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {value!r}: use a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB, e.g. '2GiB')")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the waiting-queue policy.

    max_num_batched_tokens: token budget of one forward pass (prefill chunks
      plus one token per decoding sequence).
    max_num_seqs: most sequences in one step (the running batch cap).
    max_model_len: longest sequence (prompt + output) in tokens.
    aging_s_per_priority: a waiting request gains one priority class of
      urgency for each this many seconds it waits, so nothing starves.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    aging_s_per_priority: float = 10.0

    def __post_init__(self) -> None:
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(self.aging_s_per_priority > 0,
               f"aging_s_per_priority must be > 0, got {self.aging_s_per_priority}")
