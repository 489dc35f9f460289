"""KV-cache capacity arithmetic: the memory left for KV after weights and a
stated reserve, how many tokens that holds, and how many sequences of a
given length fit at once.

Capacity is stated in KV tokens, not requests per second: a sequence holds
(prompt + generated) tokens of K and V in every layer until it finishes, so
the context length, not the request count, decides how many run together.
Bytes per token, per weight and per block are model_facts/memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import parse_size
from kvserve.model_facts.memory import blocks_in


@dataclass(frozen=True)
class MemoryBudget:
    """How device memory divides: weights, a reserve for activations /
    workspace / runtime context, and what is left for the KV cache."""

    memory_bytes: int
    weight_bytes: int
    reserve_bytes: int

    def __post_init__(self) -> None:
        if min(self.memory_bytes, self.weight_bytes, self.reserve_bytes) < 0:
            raise ValueError("memory, weight and reserve bytes must be >= 0")

    @property
    def kv_bytes(self) -> int:
        """Bytes for the KV cache; 0 when weights and reserve already fill memory."""
        return max(0, self.memory_bytes - self.weight_bytes - self.reserve_bytes)

    @property
    def fits(self) -> bool:
        return self.memory_bytes > self.weight_bytes + self.reserve_bytes


def memory_budget(memory_bytes: int, weight_bytes: int, reserve_fraction: float = 0.0,
                  reserve_bytes: int = 0) -> MemoryBudget:
    """Budget with a reserve of `reserve_fraction` of memory plus `reserve_bytes`."""
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve fraction must be in [0, 1), got {reserve_fraction}")
    reserve = int(memory_bytes * reserve_fraction) + reserve_bytes
    return MemoryBudget(memory_bytes=memory_bytes, weight_bytes=weight_bytes, reserve_bytes=reserve)


def parse_reserve(text: str) -> tuple[float, int]:
    """A reserve flag: "10%" -> (0.1, 0) of memory, "4GiB" -> (0.0, bytes)."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            return float(text[:-1]) / 100.0, 0
        except ValueError:
            raise ValueError(f"bad reserve {text!r}: use a percentage like 10% or a size") from None
    return 0.0, parse_size(text)


def kv_capacity_tokens(kv_bytes: int, bytes_per_token: int, block_size: int = 16) -> int:
    """Token slots the KV bytes hold, in whole blocks of `block_size` (the
    paged cache allocates blocks, so a partial block at the end is unusable)."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be > 0")
    return blocks_in(kv_bytes, bytes_per_token * block_size) * block_size


def blocks_for_tokens(num_tokens: int, block_size: int = 16) -> int:
    return -(-num_tokens // block_size)


def max_concurrency(capacity_tokens: int, tokens_per_sequence: int, block_size: int = 16) -> int:
    """Sequences of `tokens_per_sequence` (prompt + output) that fit at once,
    each holding whole blocks."""
    if tokens_per_sequence <= 0:
        raise ValueError(f"tokens per sequence must be > 0, got {tokens_per_sequence}")
    return (capacity_tokens // block_size) // blocks_for_tokens(tokens_per_sequence, block_size)


@dataclass(frozen=True)
class ContextLength:
    """A sequence shape: prompt tokens and output tokens (output 0 when the
    row was given as a total length)."""

    prompt_tokens: int
    output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 0:
            raise ValueError(f"bad context length {self.prompt_tokens}:{self.output_tokens}")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def mean_held_tokens(self) -> float:
        """Tokens held on average over the sequence's life: the prompt all the
        time, the output growing from 0 to its full length."""
        return self.prompt_tokens + self.output_tokens / 2


def parse_context_lengths(text: str) -> list[ContextLength]:
    """"1024,4096" (total tokens) or "800:200,6000:200" (prompt:output)."""
    rows = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            parts = [int(p) for p in item.split(":")]
        except ValueError:
            raise ValueError(f"bad context length {item!r}: use N or PROMPT:OUTPUT integers") from None
        if len(parts) > 2:
            raise ValueError(f"bad context length {item!r}: use N or PROMPT:OUTPUT")
        rows.append(ContextLength(*parts))
    if not rows:
        raise ValueError("no context lengths given")
    return rows


@dataclass(frozen=True)
class ConcurrencyRow:
    context: ContextLength
    kv_bytes_per_sequence: int
    max_concurrency: int


def concurrency_table(capacity_tokens: int, bytes_per_token: int, contexts: list[ContextLength],
                      block_size: int = 16) -> list[ConcurrencyRow]:
    """Max concurrent sequences for each context length: one number per row,
    because the answer depends on the length."""
    rows = []
    for ctx in contexts:
        blocks = blocks_for_tokens(ctx.total_tokens, block_size)
        rows.append(ConcurrencyRow(
            context=ctx,
            kv_bytes_per_sequence=blocks * block_size * bytes_per_token,
            max_concurrency=max_concurrency(capacity_tokens, ctx.total_tokens, block_size)))
    return rows


@dataclass(frozen=True)
class ContextShift:
    """The same request rate with longer contexts: per-sequence KV grows, the
    concurrency the cache holds shrinks by the same factor, and (by Little's
    law, sequences in flight = rate x time in system) the KV demanded at a
    given rate grows."""

    before: ConcurrencyRow
    after: ConcurrencyRow
    kv_demand_tokens_before: float | None  # rate x service time x mean held tokens
    kv_demand_tokens_after: float | None

    @property
    def concurrency_ratio(self) -> float:
        return self.after.max_concurrency / max(1, self.before.max_concurrency)


def context_shift(capacity_tokens: int, bytes_per_token: int, before: ContextLength,
                  after: ContextLength, rate_per_s: float | None = None,
                  service_s_before: float | None = None, service_s_after: float | None = None,
                  block_size: int = 16) -> ContextShift:
    rows = concurrency_table(capacity_tokens, bytes_per_token, [before, after], block_size)
    demand_before = demand_after = None
    if rate_per_s is not None and service_s_before is not None:
        demand_before = rate_per_s * service_s_before * before.mean_held_tokens
        demand_after = rate_per_s * (service_s_after or service_s_before) * after.mean_held_tokens
    return ContextShift(rows[0], rows[1], demand_before, demand_after)
