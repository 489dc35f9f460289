"""What the ingress process knows of each model replica: one
`gateway.backends.BackendView` per Ray replica, refreshed from the routing
stats the replica records (`ModelReplica.record_routing_stats`), plus its
sleep level. The router (kvserve.ray.router) fills and ranks them; the
ingress reads the same ones for its fleet admission and warm pool, and
answers from them a replica asking whether Ray is stopping it (`stopping`:
taken out of the running set Ray broadcasts to the router).

Its own module, imported by reference: Ray pickles a request router's
module by value (a copy of its globals per unpickling), so a registry kept
there would not be the one the ingress sees. Pure bookkeeping, no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvserve.fleet.autoscale import ReplicaSignals
from kvserve.fleet.router import RouteRequest, Router
from kvserve.gateway.backends import BackendView, Scrape
from kvserve.gateway.config import BackendConfig, BreakerConfig

# How long a replica Ray took out of the running set is remembered as
# stopping: it asks every stats period, so it learns within seconds; past
# Ray's graceful timeout it is gone, and the entry only costs memory.
STOPPING_KEPT_S = 600.0


class ReplicaViews:
    """BackendViews of Ray replicas, refreshed from their routing stats.
    Pure bookkeeping (no Ray calls), so it is tested without a cluster."""

    def __init__(self, clock=time.monotonic) -> None:
        self.views: dict[str, BackendView] = {}
        self.clock = clock
        self._numbers: dict[str, int] = {}
        self.sleeping: dict[str, int] = {}
        self.startup_s: dict[str, dict[str, float]] = {}  # per replica: its startup phases and latest wake
        self.signals: dict[str, ReplicaSignals] = {}  # per replica: what it records for the autoscaler
        self.series: dict[str, str] = {}  # per replica: its vllm:* series (exposition text)
        self.models: dict[str, str] = {}  # per replica: the base model's served name
        # Replicas Ray took out of the running set (stopping, or dead), and when.
        self.stopping: dict[str, float] = {}

    def refresh(self, replica_id: str, stats: dict | None) -> BackendView:
        self.stopping.pop(replica_id, None)  # in the running set again
        view = self.views.get(replica_id)
        stats = stats or {}
        if view is None or (view.config.num_kv_blocks is None and stats.get("num_kv_blocks")):
            config = BackendConfig(f"http://{replica_id}", replica_id, stats.get("num_kv_blocks"),
                                   stats.get("block_size"))  # identity only: reached by its actor handle
            view = self.views[replica_id] = BackendView(config, BreakerConfig(), self.clock)
        number = stats.get("number")
        if number is not None and number != self._numbers.get(replica_id) and "scrape" in stats:
            self._numbers[replica_id] = number
            view.record_scrape(Scrape(**stats["scrape"]), bool(stats.get("ready")))
            self.sleeping[replica_id] = int(stats.get("sleeping") or 0)
            self.startup_s[replica_id] = dict(stats.get("startup_s") or {})
            self.series[replica_id] = str(stats.get("series") or "")
            if stats.get("model"):
                self.models[replica_id] = str(stats["model"])
            if "signals" in stats:
                self.signals[replica_id] = ReplicaSignals(**stats["signals"])
        return view

    def forget_except(self, replica_ids: set[str]) -> None:
        """Ray's running set is now `replica_ids`: a replica seen before and
        not in it is stopping (Ray takes a replica it stops, on a scale-down
        or an upgrade, out of the set at once) or dead."""
        now = self.clock()
        self.stopping = {i: since for i, since in self.stopping.items() if now - since < STOPPING_KEPT_S}
        for gone in set(self.views) - replica_ids:
            self.stopping[gone] = now
            del self.views[gone]
            self._numbers.pop(gone, None)
            self.sleeping.pop(gone, None)
            self.startup_s.pop(gone, None)
            self.signals.pop(gone, None)
            self.series.pop(gone, None)
            self.models.pop(gone, None)

    def is_stopping(self, replica_id: str) -> bool:
        return replica_id in self.stopping

    def state_name(self, requested_model: str | None) -> str:
        """The model state a request with this `model` runs under, for its
        prefix-affinity key: "" for the base model (named by its served name
        or not named at all: the same cache), else the adapter's name."""
        if requested_model is None or requested_model in self.models.values():
            return ""
        return requested_model

    def rank(self, router: Router, ids: Sequence[str], route: RouteRequest,
             exclude: frozenset[str] = frozenset()) -> list[list[str]]:
        """[[chosen], [other awake], [asleep]]; empty ranks dropped. Before a
        replica's first stats it counts as awake and idle (it is running)."""
        candidates = [i for i in ids if i not in exclude]
        awake = [i for i in candidates if not self.sleeping.get(i)]
        asleep = [i for i in candidates if self.sleeping.get(i)]
        ranks: list[list[str]] = []
        if awake:
            views = [self.views[i] for i in awake]
            chosen = awake[router.pick(views, route).position]
            ranks = [[chosen], [i for i in awake if i != chosen]]
        ranks.append(asleep)
        return [r for r in ranks if r]


# Each deployment's views in this process, by deployment name.
_BY_DEPLOYMENT: dict[str, ReplicaViews] = {}


def replica_views(deployment_name: str) -> ReplicaViews:
    return _BY_DEPLOYMENT.setdefault(deployment_name, ReplicaViews())
