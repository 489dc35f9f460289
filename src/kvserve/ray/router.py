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
ingress); the views live in kvserve.ray.views, where the ingress reads
them for its fleet admission and its warm pool.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.fleet.router import RouteRequest, Router, RouterConfig
from kvserve.gateway.backends import Sent
from kvserve.ray.forward import ForwardedRequest
from kvserve.ray.views import replica_views

# Under "ray.serve": Ray Serve sends its loggers to the replica logs.
log = logging.getLogger("ray.serve." + __name__)


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
        """Ray's broadcast of the replica set, with their latest routing
        stats: the views follow it between requests too (the warm pool and
        fleet admission read them)."""
        super().update_replicas(replicas)
        for replica in replicas:
            self._replica_views.refresh(replica.replica_id.unique_id, replica.routing_stats)
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
