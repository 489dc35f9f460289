"""kvserve's router as a Ray Serve `RequestRouter`: `choose_replicas` ranks
the replicas with `fleet.router` (the policy the gateway and the simulator
use) over one `gateway.backends.BackendView` per replica, fed from the
stats each replica records (`ModelReplica.record_routing_stats`) and the
requests this router sent since (counted as the gateway counts its own).

Ranks returned: the chosen replica first, then the other eligible ones,
then the sleeping ones (a request routed there wakes nothing: it waits for
the ingress's warm pool to wake one). Replicas that failed this request
(`ForwardedRequest.exclude`) are left out. Ray Serve probes the first rank's
queue length against `max_ongoing_requests`, which kvserve sets high, so
Ray's own queue never decides in kvserve's place.

The router lives in the process that owns the deployment handle (the
ingress); `replica_views` lets the ingress read the same views for its
fleet admission (refuse before any replica when none can start in time)
and its warm pool (which replicas sleep).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.fleet.router import RouteRequest, Router, RouterConfig
from kvserve.gateway.backends import BackendView, Scrape, Sent
from kvserve.gateway.config import BackendConfig, BreakerConfig
from kvserve.ray.forward import ForwardedRequest

log = logging.getLogger(__name__)



class ReplicaViews:
    """BackendViews of Ray replicas, refreshed from their routing stats.
    Pure bookkeeping (no Ray calls), so it is tested without a cluster."""

    def __init__(self, clock=time.monotonic) -> None:
        self.views: dict[str, BackendView] = {}
        self.clock = clock
        self._numbers: dict[str, int] = {}
        self.sleeping: dict[str, int] = {}

    def refresh(self, replica_id: str, stats: dict | None) -> BackendView:
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
        return view

    def forget_except(self, replica_ids: set[str]) -> None:
        for gone in set(self.views) - replica_ids:
            del self.views[gone]
            self._numbers.pop(gone, None)
            self.sleeping.pop(gone, None)

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


# Each deployment's replica views in this process, by deployment name: Ray
# builds the router inside the handle, the ingress reads the same views.
_BY_DEPLOYMENT: dict[str, ReplicaViews] = {}


def replica_views(deployment_name: str) -> ReplicaViews:
    return _BY_DEPLOYMENT.setdefault(deployment_name, ReplicaViews())


class KVServeRouter(RequestRouter):
    """Ray Serve's hook onto fleet.router. Configured through
    `RequestRouterConfig(request_router_kwargs={"policy": ..., ...})`:
    the `fleet.router.RouterConfig` fields."""

    def initialize_state(self, **router_kwargs) -> None:
        self._router = Router(RouterConfig(**router_kwargs))
        self._replica_views = replica_views(self._deployment_id.name)
        self._sent: dict[str, collections.deque[Sent]] = {}  # per replica, oldest first
        self._last_tokens = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for replica_id, replica in by_id.items():
            self._replica_views.refresh(replica_id, replica.routing_stats)
        forwarded = _forwarded(pending_request)
        route = forwarded.route if forwarded is not None else RouteRequest()
        exclude = forwarded.exclude if forwarded is not None else frozenset()
        self._last_tokens = route.num_prompt_tokens + route.max_tokens
        ranks = self._replica_views.rank(self._router, list(by_id), route, exclude)
        return [[by_id[i] for i in rank] for rank in ranks]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._replica_views.forget_except({r.replica_id.unique_id for r in replicas})

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Ray sent a request there: count it (as the gateway counts its
        sends) until that replica's stats show it. Ray passes no request
        here, so its size is the latest one routed (sends follow their
        routing decision on this one event loop)."""
        super().on_send_request(replica_id)
        view = self._replica_views.views.get(replica_id.unique_id)
        if view is not None:
            self._sent.setdefault(replica_id.unique_id, collections.deque()).append(view.on_send(self._last_tokens))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        tickets = self._sent.get(replica_id.unique_id)
        view = self._replica_views.views.get(replica_id.unique_id)
        if tickets and view is not None:
            view.on_done(tickets.popleft())


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
