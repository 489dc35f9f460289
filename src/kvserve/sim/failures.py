"""Failure scenarios of a simulated fleet: what they are and what they cost.

- `ReplicaLoss`: replica INDEX goes away at a time (`--fail-replica
  INDEX@SECONDS`). As the gateway sees a backend that dies: it stops being
  ready, so the router no longer sees it (and the autoscaler counts it
  gone); a request there that has not streamed its first token yet (a
  backend sends its headers only with the first token) fails before any
  answer and is sent to another ready replica; one already streaming ends
  with the gateway's error event (outcome "error": lost).
- `ReplicaSlowdown`: replica INDEX's steps take FACTOR x as long, from a
  time on or throughout (`--slow-replica INDEX:FACTOR[@SECONDS]`). Nothing
  else changes: the router sees its load, KV usage and drain as they are.

`failure_section` compares the run with the failures against the same
workload without them (same arrivals, same seeds): report.json's
`failure_scenarios`, "what it cost in goodput".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.bench.report import RequestRecord, is_good, record_latency


@dataclass(frozen=True)
class ReplicaLoss:
    index: int  # into the replicas the simulation starts with
    at_s: float  # simulated seconds from the start

    def __post_init__(self) -> None:
        if self.index < 0 or not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"a replica loss needs an index >= 0 and a time >= 0, got {self}")


@dataclass(frozen=True)
class ReplicaSlowdown:
    index: int
    factor: float  # its steps take this many times as long
    from_s: float = 0.0

    def __post_init__(self) -> None:
        if self.index < 0 or not (math.isfinite(self.from_s) and self.from_s >= 0):
            raise ValueError(f"a slow replica needs an index >= 0 and a time >= 0, got {self}")
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(f"a slow replica's factor must be a number > 1, got {self.factor}")


def check_failures(losses: Sequence[ReplicaLoss], slowdowns: Sequence[ReplicaSlowdown], num_replicas: int) -> None:
    """ValueError naming what is wrong: an index past the initial fleet, a
    replica lost or slowed twice."""
    for kind, items in (("lost", losses), ("slowed", slowdowns)):
        indices = [item.index for item in items]
        beyond = [i for i in indices if i >= num_replicas]
        if beyond:
            raise ValueError(f"replica {beyond[0]} cannot be {kind}: the fleet starts with {num_replicas} "
                             f"(indices 0..{num_replicas - 1})")
        twice = sorted({i for i in indices if indices.count(i) > 1})
        if twice:
            raise ValueError(f"replica {twice[0]} is {kind} twice; give one scenario per replica")


def parse_loss(text: str) -> ReplicaLoss:
    """'INDEX@SECONDS' (argparse type)."""
    index, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        return ReplicaLoss(int(index), float(at))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INDEX@SECONDS (replica index >= 0, a time >= 0), e.g. 0@30, "
                                         f"got {text!r}") from None


def parse_slowdown(text: str) -> ReplicaSlowdown:
    """'INDEX:FACTOR' or 'INDEX:FACTOR@SECONDS' (argparse type)."""
    index, sep, rest = text.partition(":")
    factor, at_sep, at = rest.partition("@")
    try:
        if not sep or (at_sep and not at):
            raise ValueError
        return ReplicaSlowdown(int(index), float(factor), float(at) if at_sep else 0.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INDEX:FACTOR[@SECONDS] (replica index >= 0, a factor > 1, a "
                                         f"time >= 0), e.g. 1:3 or 1:3@60, got {text!r}") from None


def describe(losses: Sequence[ReplicaLoss], slowdowns: Sequence[ReplicaSlowdown]) -> list[str]:
    return ([f"replica {x.index} lost at {x.at_s:g} s" for x in losses]
            + [f"replica {x.index} {x.factor:g}x slower from {x.from_s:g} s" for x in slowdowns])


# -- what they cost ----------------------------------------------------------

def _run_figures(summary: dict, replicas: list[dict], num_rerouted: int) -> dict:
    outcomes = summary["outcomes"]
    return {"goodput": summary["goodput"], "num_good": summary["num_good"],
            "slo_attainment": summary["slo_attainment"], "num_requests": summary["num_requests"],
            "success": outcomes["success"], "refused": outcomes["rejected"], "timed_out": outcomes["timed_out"],
            "lost": outcomes["error"], "cancelled": outcomes["cancelled"], "rerouted": num_rerouted,
            "refused_reasons": outcomes["rejected_reasons"],
            "routed_by_replica": [r["num_routed"] for r in replicas]}


def phase_bounds(losses: Sequence[ReplicaLoss], slowdowns: Sequence[ReplicaSlowdown], replicas: list[dict],
                 end_s: float) -> list[float]:
    """The run cut where the fleet changed: each failure, and each replica
    that began serving after the first failure (a replacement started or
    woken by the autoscaler)."""
    times = [x.at_s for x in losses] + [x.from_s for x in slowdowns]
    first = min(times, default=end_s)
    times += [r["ready_s"] for r in replicas if r["ready_s"] > first]
    return [0.0, *sorted({t for t in times if 0 < t < end_s}), end_s]


def _phases(bounds: list[float], baseline: Sequence[RequestRecord], failed: Sequence[RequestRecord],
            slo) -> list[dict]:
    """Per stretch of send times: goodput and SLO share, both runs side by side."""
    phases = []
    for lo, hi in zip(bounds, bounds[1:]):
        row: dict = {"from_s": lo, "to_s": hi}
        for name, records in (("baseline", baseline), ("with_failures", failed)):
            sent = [r for r in records if r.sent_s is not None and lo <= r.sent_s < hi]
            judged = [r for r in sent if r.outcome != "cancelled"]
            good = sum(is_good(r, record_latency(r), slo) for r in judged)
            row[name] = {"num_sent": len(sent), "num_good": good, "goodput": good / (hi - lo),
                         "slo_attainment": good / len(judged) if judged else None}
        phases.append(row)
    return phases


def failure_section(losses: Sequence[ReplicaLoss], slowdowns: Sequence[ReplicaSlowdown], slo,
                    baseline: tuple[dict, Sequence[RequestRecord], list[dict], int],
                    failed: tuple[dict, Sequence[RequestRecord], list[dict], int],
                    num_sent: int) -> dict:
    """report.json's `failure_scenarios`. baseline / failed: (report
    summary, records, replica stats, requests rerouted) of the run without
    and with the failures; num_sent: the requests the workload sent (each
    run must account for every one)."""
    base, fail = _run_figures(baseline[0], baseline[2], baseline[3]), _run_figures(failed[0], failed[2], failed[3])
    end_s = max((r.sent_s for r in failed[1] if r.sent_s is not None), default=0.0)
    end_s = math.nextafter(end_s, math.inf)  # the last send falls inside the last phase
    bounds = phase_bounds(losses, slowdowns, failed[2], end_s)
    cost = {"good_requests_lost": (base["num_good"] or 0) - (fail["num_good"] or 0),
            "goodput_lost": None, "goodput_lost_share": None, "slo_attainment_lost": None}
    if base["goodput"] is not None and fail["goodput"] is not None:
        cost["goodput_lost"] = base["goodput"] - fail["goodput"]
        cost["goodput_lost_share"] = cost["goodput_lost"] / base["goodput"] if base["goodput"] else None
    if base["slo_attainment"] is not None and fail["slo_attainment"] is not None:
        cost["slo_attainment_lost"] = base["slo_attainment"] - fail["slo_attainment"]
    return {"scenarios": describe(losses, slowdowns),
            "losses": [{"replica": x.index, "at_s": x.at_s} for x in losses],
            "slowdowns": [{"replica": x.index, "factor": x.factor, "from_s": x.from_s} for x in slowdowns],
            "num_sent": num_sent, "baseline": base, "with_failures": fail, "cost": cost,
            "unaccounted": {"baseline": num_sent - len(baseline[1]), "with_failures": num_sent - len(failed[1])},
            "replicas": [{"index": r["index"], "started_s": r["started_s"], "ready_s": r["ready_s"],
                          "lost_at_s": r["lost_at_s"], "slowed_by": r["slowed_by"]} for r in failed[2]],
            "phases": _phases(bounds, baseline[1], failed[1], slo)}
