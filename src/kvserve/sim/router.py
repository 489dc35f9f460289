"""Which replica gets a request: round-robin, least-queue, prefix-affinity.

A router sees only what a gateway in front of real servers could see: each
replica's load (running + waiting requests) and the request's shared-prefix
group. Prefix affinity sends a group to one replica so its prefix stays in
that replica's cache; requests with no group fall back to least-queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

ROUTERS = ("round-robin", "least-queue", "prefix-affinity")


class RoutedReplica(Protocol):
    @property
    def load(self) -> int: ...  # requests running + waiting


def _least_loaded(replicas: Sequence[RoutedReplica]) -> int:
    best, best_load = 0, None
    for i, replica in enumerate(replicas):
        load = replica.load
        if best_load is None or load < best_load:
            best, best_load = i, load
    return best


class Router:
    """Picks an index into the list of ready replicas."""

    def __init__(self, policy: str) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; use one of {', '.join(ROUTERS)}")
        self.policy = policy
        self._next = 0

    def pick(self, replicas: Sequence[RoutedReplica], prefix_group: int | None) -> int:
        if not replicas:
            raise ValueError("no ready replica to route to")
        if self.policy == "round-robin":
            index = self._next % len(replicas)
            self._next += 1
            return index
        if self.policy == "prefix-affinity" and prefix_group is not None:
            # A stable spread of group ids; adding replicas remaps some groups
            # (a consistent-hash ring would remap fewer; fine for a simulator).
            return (prefix_group * 2654435761) % 2**32 % len(replicas)
        return _least_loaded(replicas)
