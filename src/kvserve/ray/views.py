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

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.fleet.autoscale import ReplicaSignals
from kvserve.fleet.router import RouteRequest, Router
from kvserve.gateway.backends import BackendView, Scrape, Sent
from kvserve.gateway.config import BackendConfig, BreakerConfig

# How long a replica Ray took out of the running set is remembered as
# stopping: it asks every stats period, so it learns within seconds; past
# Ray's graceful timeout it is gone, and the entry only costs memory.
STOPPING_KEPT_S = 600.0

# How long a routing choice counts at its replica before Ray sends the
# request there. Ray sends within milliseconds of choosing; a choice not
# sent by then was cancelled, or Ray sent the request to a lower rank
# (which counts it on its own when it is sent).
CHOICE_KEPT_S = 5.0


@dataclass
class _Choice:
    """A request routed to a replica and not sent yet: already counted there."""

    replica_id: str
    ticket: Sent
    at: float


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
        # The router's own traffic, counted as the gateway counts its sends,
        # from the choice on: Ray routes a burst's requests one after another
        # before it sends any, and each choice must see the ones before it.
        self._chosen: dict[str, _Choice] = {}  # by Ray's internal request id
        self._unsent: dict[str, collections.deque[str]] = {}  # per replica: request ids chosen there, oldest first
        self._sent: dict[str, collections.deque[Sent]] = {}  # per replica: tickets of requests sent there, oldest first
        self._latest_tokens = 0

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
            self._unsent.pop(gone, None)
            self._sent.pop(gone, None)
        self._chosen = {i: c for i, c in self._chosen.items() if c.replica_id in self.views}

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

    # ---- the router's traffic ---------------------------------------------
    def choose(self, router: Router, ids: Sequence[str], route: RouteRequest,
               exclude: frozenset[str] = frozenset(), request_id: str | None = None) -> list[list[str]]:
        """`rank`, and the request counted at the chosen replica at once
        (until `on_sent` takes it over, or CHOICE_KEPT_S passes). Choosing
        the same request again (Ray's backoff) replaces its earlier choice."""
        self._expire_choices()
        if request_id is not None:
            self._withdraw(request_id)
        ranks = self.rank(router, ids, route, exclude)
        tokens = route.num_prompt_tokens + route.max_tokens
        self._latest_tokens = tokens
        chosen = ranks[0][0] if ranks else None
        if request_id is not None and chosen is not None and not self.sleeping.get(chosen):
            self._chosen[request_id] = _Choice(chosen, self.views[chosen].on_send(tokens), self.clock())
            self._unsent.setdefault(chosen, collections.deque()).append(request_id)
        return ranks

    def on_sent(self, replica_id: str) -> None:
        """Ray sent a request there (it does not say which): the oldest
        choice of that replica is now in flight. A send with no choice
        behind it (Ray fell back to a lower rank) is counted now, at the
        latest routed request's size."""
        self._expire_choices()
        waiting = self._unsent.get(replica_id)
        while waiting:
            choice = self._chosen.pop(waiting.popleft(), None)
            if choice is not None:
                self._sent.setdefault(replica_id, collections.deque()).append(choice.ticket)
                return
        view = self.views.get(replica_id)
        if view is not None:
            self._sent.setdefault(replica_id, collections.deque()).append(view.on_send(self._latest_tokens))

    def on_completed(self, replica_id: str) -> None:
        """A request sent there finished: stop counting the oldest one."""
        tickets = self._sent.get(replica_id)
        view = self.views.get(replica_id)
        if tickets and view is not None:
            view.on_done(tickets.popleft())

    def _withdraw(self, request_id: str) -> None:
        choice = self._chosen.pop(request_id, None)
        if choice is not None:
            view = self.views.get(choice.replica_id)
            if view is not None:
                view.on_done(choice.ticket)
            # Its id stays in the replica's unsent queue; on_sent skips it.

    def _expire_choices(self) -> None:
        now = self.clock()
        for request_id in [i for i, c in self._chosen.items() if now - c.at > CHOICE_KEPT_S]:
            self._withdraw(request_id)
        for waiting in self._unsent.values():
            while waiting and waiting[0] not in self._chosen:
                waiting.popleft()


# Each deployment's views in this process, by deployment name.
_BY_DEPLOYMENT: dict[str, ReplicaViews] = {}


def replica_views(deployment_name: str) -> ReplicaViews:
    return _BY_DEPLOYMENT.setdefault(deployment_name, ReplicaViews())
