"""The headroom decision: headroom costs money every hour whether or not it
was needed; a breached promise costs money at the moment of the breach. Per
fleet size, simulated on the same workload:

    fleet cost per hour    = replicas x price of a replica-hour
    headroom cost per hour = (replicas - the smallest size's) x that price
    breach share           = breached / judged requests (judged: not
                             cancelled by the client; breached: refused,
                             timed out, failed, or served outside the SLO)
    breaches per hour      = breached / simulated hours
    breach cost per hour   = breaches per hour x price of one breach
    total per hour         = fleet cost + breach cost

The recommended size minimises the total (the smaller size on a tie). Pure
arithmetic on the runs' counts: the simulation gives the counts, this gives
the decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FleetRun:
    """What one simulated fleet size did with the workload."""

    replicas: int
    duration_s: float
    num_judged: int  # requests not cancelled by the client
    num_good: int  # served inside the SLO

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.duration_s <= 0 or not 0 <= self.num_good <= self.num_judged:
            raise ValueError(f"inconsistent fleet run: {self}")


@dataclass(frozen=True)
class HeadroomRow:
    replicas: int
    fleet_cost_per_hour: float
    headroom_cost_per_hour: float
    breach_share: float
    breaches_per_hour: float
    breach_cost_per_hour: float
    total_cost_per_hour: float


def headroom_row(run: FleetRun, smallest: int, price_per_hour: float, breach_price: float) -> HeadroomRow:
    hours = run.duration_s / 3600.0
    breached = run.num_judged - run.num_good
    breaches_per_hour = breached / hours
    fleet = run.replicas * price_per_hour
    breach_cost = breaches_per_hour * breach_price
    return HeadroomRow(run.replicas, fleet, (run.replicas - smallest) * price_per_hour,
                       breached / run.num_judged if run.num_judged else 0.0, breaches_per_hour,
                       breach_cost, fleet + breach_cost)


def headroom_decision(runs: Sequence[FleetRun], price_per_hour: float, breach_price: float) -> dict:
    """The decision table (one row per size, smallest first) and the
    recommended size, as report.json's `headroom_decision`."""
    if not runs:
        raise ValueError("the headroom decision needs at least one fleet size")
    if price_per_hour < 0 or breach_price < 0:
        raise ValueError("--price-per-hour and --breach-price must be >= 0")
    runs = sorted(runs, key=lambda r: r.replicas)
    smallest = runs[0].replicas
    rows = [headroom_row(r, smallest, price_per_hour, breach_price) for r in runs]
    best = min(rows, key=lambda row: (row.total_cost_per_hour, row.replicas))
    return {"price_per_replica_hour": price_per_hour, "breach_price": breach_price,
            "rows": [asdict(row) for row in rows], "recommended_replicas": best.replicas}


def format_decision(decision: dict) -> str:
    header = (f"headroom decision (a replica-hour {decision['price_per_replica_hour']:g}, "
              f"a breach {decision['breach_price']:g}):")
    lines = [header, f"{'replicas':>8} {'fleet/h':>10} {'headroom/h':>10} {'breached':>9} "
                     f"{'breaches/h':>11} {'breach cost/h':>13} {'total/h':>10}"]
    for row in decision["rows"]:
        mark = "  <- recommended" if row["replicas"] == decision["recommended_replicas"] else ""
        lines.append(f"{row['replicas']:>8} {row['fleet_cost_per_hour']:>10.2f} "
                     f"{row['headroom_cost_per_hour']:>10.2f} {row['breach_share']:>9.2%} "
                     f"{row['breaches_per_hour']:>11.1f} {row['breach_cost_per_hour']:>13.2f} "
                     f"{row['total_cost_per_hour']:>10.2f}{mark}")
    return "\n".join(lines)
