"""Queueing approximations for capacity reviews: thinking tools, not predictions.

Kingman's G/G/1 formula shows why a fleet "only 60-70% busy" still queues
badly when service times spread over orders of magnitude (LLM requests do:
a 20-token answer and a 4,000-token essay share a server). Allen-Cunneen
extends it to c parallel servers (a replica runs c sequences in a batch).
Both assume FCFS and stationary arrivals, and treat service time as
independent of load, which batching violates; use them to reason about
headroom and variance, and the simulator for numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_utilization(utilization: float) -> None:
    if not 0.0 <= utilization < 1.0:
        raise ValueError(f"utilization must be in [0, 1) for a stable queue, got {utilization}")


def kingman_wait_s(utilization: float, mean_service_s: float, arrival_cv: float = 1.0,
                   service_cv: float = 1.0) -> float:
    """Mean wait in queue of a G/G/1 server (Kingman, 1961):

        Wq ~ rho / (1 - rho) * (ca^2 + cs^2) / 2 * E[S]

    ca, cs: coefficients of variation (std / mean) of inter-arrival and
    service times. Exact for M/M/1 (ca = cs = 1) and M/D/1 (cs = 0)."""
    _check_utilization(utilization)
    if mean_service_s < 0 or arrival_cv < 0 or service_cv < 0:
        raise ValueError("mean service time and coefficients of variation must be >= 0")
    variability = (arrival_cv ** 2 + service_cv ** 2) / 2
    return utilization / (1 - utilization) * variability * mean_service_s


def erlang_c(num_servers: int, offered_load: float) -> float:
    """Probability an arrival waits in an M/M/c queue, offered load a = lambda / mu."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    _check_utilization(offered_load / num_servers)
    # Erlang B by its stable recurrence, then C from B: no factorials to overflow.
    blocking = 1.0
    for k in range(1, num_servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    rho = offered_load / num_servers
    return blocking / (1 - rho + rho * blocking)


def allen_cunneen_wait_s(num_servers: int, utilization: float, mean_service_s: float,
                         arrival_cv: float = 1.0, service_cv: float = 1.0) -> float:
    """Mean queue wait of a G/G/c queue (Allen-Cunneen):

        Wq ~ C(c, a) / (c mu - lambda) * (ca^2 + cs^2) / 2

    Exact for M/M/c; equals Kingman's formula for c = 1."""
    _check_utilization(utilization)
    offered_load = utilization * num_servers
    mu = 1.0 / mean_service_s
    lam = offered_load * mu
    variability = (arrival_cv ** 2 + service_cv ** 2) / 2
    return erlang_c(num_servers, offered_load) / (num_servers * mu - lam) * variability


@dataclass(frozen=True)
class ReplicaPlan:
    """Replicas for a target rate at a utilization ceiling (the headroom)."""

    rate_per_s: float
    mean_service_s: float
    slots_per_replica: int  # sequences one replica serves at once
    headroom: float  # target utilization ceiling, e.g. 0.75
    num_replicas: int
    utilization: float  # at num_replicas
    queue_wait_s: float  # Allen-Cunneen mean wait at that utilization, per replica

    @property
    def capacity_per_replica_per_s(self) -> float:
        return self.slots_per_replica / self.mean_service_s


def replicas_for_rate(rate_per_s: float, mean_service_s: float, slots_per_replica: int,
                      headroom: float = 0.75, arrival_cv: float = 1.0,
                      service_cv: float = 1.0) -> ReplicaPlan:
    """Fewest replicas that keep utilization at or below `headroom`.

    Each replica is c = slots_per_replica servers of mean service time
    `mean_service_s`; arrivals split evenly across replicas."""
    if rate_per_s <= 0 or mean_service_s <= 0:
        raise ValueError("rate and mean service time must be > 0")
    if slots_per_replica < 1:
        raise ValueError(f"a replica must hold at least one sequence, got {slots_per_replica}")
    if not 0.0 < headroom < 1.0:
        raise ValueError(f"headroom (target utilization) must be in (0, 1), got {headroom}")
    offered_load = rate_per_s * mean_service_s  # busy slots needed across the fleet
    num_replicas = max(1, math.ceil(offered_load / (slots_per_replica * headroom) - 1e-9))
    utilization = offered_load / (num_replicas * slots_per_replica)
    wait_s = allen_cunneen_wait_s(slots_per_replica, utilization, mean_service_s,
                                  arrival_cv, service_cv)
    return ReplicaPlan(rate_per_s, mean_service_s, slots_per_replica, headroom,
                       num_replicas, utilization, wait_s)


def wait_curve(mean_service_s: float, arrival_cv: float, service_cv: float,
               utilizations: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
               ) -> list[tuple[float, float]]:
    """(utilization, Kingman wait in seconds): where the knee is."""
    return [(u, kingman_wait_s(u, mean_service_s, arrival_cv, service_cv)) for u in utilizations]
