"""Capacity search: the highest arrival rate a server sustains, and the highest
at which it keeps its SLO, found with a bounded number of runs.

Two different answers, reported separately:
- max sustainable rate: the server keeps up, whatever the latency: at least
  `min_success_share` of the (not client-cancelled) requests succeed, and the
  queue does not grow during the run: the median TTFT of the last third of
  requests (by send time) is at most 2x that of the first third + 0.25 s.
- capacity at SLO: the report's `slo_passed` (percentile targets held and the
  success share at least the SLO percentile).

Search: start at `start_rate`, double while the run is sustainable, then
bisect each interval (pass below, fail above) until its width is under
`rel_tol` of its lower end or `max_runs` is spent. Each run informs both
intervals. `run_at(rate)` returns a report dict (bench or simulator).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RunAt = Callable[[float], dict]


@dataclass(frozen=True)
class SweepPoint:
    rate_per_s: float
    sustainable: bool
    slo_passed: bool
    request_throughput: float
    goodput: float | None
    slo_attainment: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None


@dataclass
class _Interval:
    """Highest passing and lowest failing rate seen so far."""

    passed: float | None = None
    failed: float | None = None

    def update(self, rate: float, ok: bool) -> None:
        if ok and (self.failed is None or rate < self.failed):
            self.passed = max(rate, self.passed or 0.0)
        elif not ok and (self.passed is None or rate > self.passed):
            self.failed = min(rate, self.failed or float("inf"))

    def next_rate(self, rel_tol: float) -> float | None:
        """Midpoint to try next, None when narrow enough or unbounded."""
        if self.failed is None:
            return None
        low = self.passed or 0.0
        if low > 0 and (self.failed - low) <= rel_tol * low:
            return None
        return (low + self.failed) / 2 if low > 0 else self.failed / 2


@dataclass(frozen=True)
class SweepResult:
    max_sustainable_rate_per_s: float | None
    capacity_at_slo_per_s: float | None
    points: list[SweepPoint] = field(default_factory=list)

    # Whether the search saw the limit at all: some rate it ran failed. One
    # whose every run held ran out of runs while still doubling, and its
    # answer is only a lower bound (an 8 req/s "max sustainable rate" from
    # 5 runs starting at 0.5 was the cap, not the server's limit).
    @property
    def max_sustainable_rate_found(self) -> bool:
        return any(not p.sustainable for p in self.points)

    @property
    def capacity_at_slo_found(self) -> bool:
        return any(not p.slo_passed for p in self.points)

    def to_dict(self) -> dict:
        return {"max_sustainable_rate_per_s": self.max_sustainable_rate_per_s,
                "max_sustainable_rate_found": self.max_sustainable_rate_found,
                "capacity_at_slo_per_s": self.capacity_at_slo_per_s,
                "capacity_at_slo_found": self.capacity_at_slo_found,
                "points": [p.__dict__ for p in sorted(self.points, key=lambda p: p.rate_per_s)]}


def is_sustainable(report: dict, min_success_share: float = 0.95) -> bool:
    """The server kept up with the offered load (see module doc)."""
    summary = report["summary"]
    outcomes = summary["outcomes"]
    judged = summary["num_requests"] - outcomes["cancelled"]
    if judged <= 0 or outcomes["success"] / judged < min_success_share:
        return False
    ok = sorted((r for r in report["requests"] if r["outcome"] == "success"
                 and r["ttft_s"] is not None), key=lambda r: r["sent_s"])
    third = len(ok) // 3
    if third == 0:
        return True
    early = statistics.median(r["ttft_s"] for r in ok[:third])
    late = statistics.median(r["ttft_s"] for r in ok[-third:])
    return late <= 2 * early + 0.25


def _point(rate: float, report: dict, min_success_share: float) -> SweepPoint:
    s = report["summary"]
    return SweepPoint(rate, is_sustainable(report, min_success_share), bool(s["slo_passed"]),
                      s["request_throughput"], s["goodput"], s["slo_attainment"],
                      s["ttft"]["p99"], s["tpot"]["p99"])


def capacity_search(run_at: RunAt, start_rate: float = 1.0, max_runs: int = 8,
                    rel_tol: float = 0.1, max_rate: float = 1e4,
                    min_success_share: float = 0.95,
                    on_point: Callable[[SweepPoint], None] | None = None) -> SweepResult:
    """Bisection on arrival rate; at most `max_runs` calls of `run_at`."""
    if start_rate <= 0 or max_runs < 1 or rel_tol <= 0:
        raise ValueError("need start_rate > 0, max_runs >= 1, rel_tol > 0")
    sustain, slo = _Interval(), _Interval()
    points: list[SweepPoint] = []
    rate: float | None = start_rate
    while rate is not None and len(points) < max_runs:
        point = _point(rate, run_at(rate), min_success_share)
        points.append(point)
        if on_point:
            on_point(point)
        sustain.update(rate, point.sustainable)
        slo.update(rate, point.slo_passed)
        rate = _next_rate(sustain, slo, rate, rel_tol, max_rate)
    return SweepResult(sustain.passed, slo.passed, points)


def _next_rate(sustain: _Interval, slo: _Interval, last: float, rel_tol: float,
               max_rate: float) -> float | None:
    if sustain.failed is None:  # still expanding
        return min(last * 2, max_rate) if last < max_rate else None
    return slo.next_rate(rel_tol) or sustain.next_rate(rel_tol)


def run_sweep_to_dir(run_at: RunAt, out_dir: Path, slo_name: str, start_rate: float, max_runs: int,
                     rel_tol: float, note: str = "") -> SweepResult:
    """The `--sweep` of `kvserve bench` and `kvserve simulate`: search, print
    each point and the result, write out_dir/sweep.json."""

    def show(point: SweepPoint) -> None:
        print(f"rate {point.rate_per_s:8.3g} req/s: sustainable={point.sustainable} "
              f"slo_passed={point.slo_passed} goodput={point.goodput}")

    result = capacity_search(run_at, start_rate, max_runs, rel_tol, on_point=show)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result.to_dict(), indent=1))
    print(f"max sustainable rate: {result.max_sustainable_rate_per_s} req/s; capacity at SLO "
          f"{slo_name}: {result.capacity_at_slo_per_s} req/s ({note}wrote {out_dir / 'sweep.json'})")
    short = [name for name, found in (("max sustainable rate", result.max_sustainable_rate_found),
                                      ("capacity at SLO", result.capacity_at_slo_found)) if not found]
    if short:
        print(f"  {' and '.join(short)}: a lower bound, no rate tried failed (raise --sweep-max-runs)")
    return result
