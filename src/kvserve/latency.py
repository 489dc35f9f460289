"""The one definition of request latencies, shared by the server's metrics,
the load tester (`bench/`) and the simulator (`sim/`), so the three can be
compared number for number.

Definitions (all in seconds):
- TTFT: first token time - start (start = arrival at the server, or the
  send time at the client).
- ITL: the gap between consecutive token deliveries. A delivery that carries
  k tokens contributes k gaps of (gap / k), so a server that batches tokens
  into chunks is neither rewarded nor punished by the chunking.
- TPOT: (last token time - first token time) / (output tokens - 1); it
  excludes the first token, so it measures decode only. None with < 2 tokens.
- E2E: end - start.
- Queue time: first scheduled - start, when known.

Pure Python: no engine imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

PERCENTILES = (50, 90, 95, 99)


class Latency(NamedTuple):
    ttft_s: float | None
    tpot_s: float | None
    itl_s: list[float]
    e2e_s: float | None
    queue_s: float | None
    num_output_tokens: int


def derive_latency(
    start: float,
    token_events: Sequence[tuple[float, int]],
    end: float | None,
    scheduled: float | None = None,
    with_itl: bool = True,
) -> Latency:
    """Latencies of one request from raw timestamps.

    token_events: (time, number of tokens delivered at that time), in time
    order; a server-side record has one event per token.
    with_itl=False leaves itl_s empty, for callers that pool `itl_runs`
    instead (a list per request of one float per token adds up).
    """
    num_tokens = sum(n for _, n in token_events)
    if not token_events or num_tokens == 0:
        return Latency(None, None, [], _minus(end, start), _minus(scheduled, start), 0)
    first_time = token_events[0][0]
    last_time = token_events[-1][0]
    itl: list[float] = []
    for gap, count in itl_runs(token_events) if with_itl else ():
        itl.extend([gap] * count)
    tpot = (last_time - first_time) / (num_tokens - 1) if num_tokens > 1 else None
    return Latency(
        ttft_s=first_time - start,
        tpot_s=tpot,
        itl_s=itl,
        e2e_s=_minus(end, start),
        queue_s=_minus(scheduled, start),
        num_output_tokens=num_tokens,
    )


def itl_runs(token_events: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """The ITL of one request as (gap, number of tokens with that gap), in
    token order: `derive_latency`'s itl_s is these runs expanded. A report
    over millions of tokens pools runs instead of one float per token."""
    if not token_events:
        return []
    # The first event's extra tokens (beyond the first) arrived with it: zero gap.
    runs = [(0.0, token_events[0][1] - 1)] if token_events[0][1] > 1 else []
    prev = token_events[0][0]
    for time, count in token_events[1:]:
        if count <= 0:
            continue
        runs.append(((time - prev) / count, count))
        prev = time
    return runs


def _minus(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of sorted values."""
    if len(sorted_values) == 0:  # len(): numpy arrays are accepted too
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize_runs(runs: Iterable[tuple[float, int]]) -> dict[str, float | None]:
    """`summarize` of the values each repeated `count` times, with numpy
    instead of a Python float per value (an hour of simulated traffic pools
    tens of millions of inter-token gaps). Same numbers: the mean is the
    left-to-right sum of the sorted values, as sum() gives."""
    pairs = [(v, n) for v, n in runs if n > 0]
    if not pairs:
        return summarize(())
    values = np.array([v for v, _ in pairs], dtype=np.float64)
    counts = np.array([n for _, n in pairs], dtype=np.int64)
    order = np.argsort(values, kind="stable")
    data = np.repeat(values[order], counts[order])  # sorted, one entry per value
    total = float(np.cumsum(data)[-1])  # sequential, unlike np.sum's pairwise sum
    out: dict[str, float | None] = {"count": len(data), "mean": total / len(data)}
    for q in PERCENTILES:
        out[f"p{q}"] = float(percentile(data, q))
    return out


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 (and count) of the non-None values.

    Sorted by numpy (a simulated hour summarizes hundreds of thousands of
    requests); the numbers are those of Python's sorted() and sum(): the
    mean is the left-to-right sum of the sorted values (exact for ints)."""
    data = [v for v in values if v is not None]
    if not data:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ordered = np.sort(np.array(data))
    if ordered.dtype.kind == "f":
        total = float(np.cumsum(ordered)[-1])  # sequential, unlike np.sum's pairwise sum
    else:  # ints (token counts): an exact sum, divided as Python divides ints
        total = sum(data)
    out: dict[str, float | None] = {"count": len(data), "mean": total / len(data)}
    for q in PERCENTILES:
        out[f"p{q}"] = float(percentile(ordered, q))
    return out
