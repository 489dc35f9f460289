"""kvserve's router as a Ray Serve `RequestRouter`: `choose_replicas` ranks
the replicas with `fleet.router` (the policy the gateway and the simulator
use) over one `gateway.backends.BackendView` per replica, fed from the
stats each replica records (`ModelReplica.record_routing_stats`) and the
requests this router routed since (counted as the gateway counts its own,
from the moment each is chosen: Ray chooses for a whole burst before it
sends any of it, and each choice must see the ones before it).

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

import logging
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.fleet.router import RouteRequest, Router, RouterConfig
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

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for replica_id, replica in by_id.items():
            self._replica_views.refresh(replica_id, replica.routing_stats)
        forwarded = _forwarded(pending_request)
        route = forwarded.route if forwarded is not None else RouteRequest()
        exclude = forwarded.exclude if forwarded is not None else frozenset()
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        ranks = self._replica_views.choose(self._router, list(by_id), route, exclude, request_id)
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
        """Ray sent a request there: its choice, counted since, is now in flight."""
        super().on_send_request(replica_id)
        self._replica_views.on_sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._replica_views.on_completed(replica_id.unique_id)


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
