"""The gateway's /metrics: what it decided (routing, admission, retries,
ejections, degradations, batch jobs) and, as gauges an HPA or KEDA rule
reads, the autoscaling signals per backend (queue size and expected queue
wait, running batch, KV usage) and each pool's desired replica count under
`fleet.autoscale.desired_replicas`. Gauges of backend state are refreshed
from the live views whenever /metrics is read."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.admission.decision import Outcome, Reason
from kvserve.fleet.autoscale import desired_replicas
from kvserve.fleet.backend_state import expected_wait_s
from kvserve.gateway.backends import BREAKER_STATES, BackendView


# The gateway's own decision beside admission's outcomes: moved to the
# deferred lane (202 + batch id); and the reason of a ladder's change.
DEFER = "defer"
LADDER = "ladder"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("kvserve_gateway_requests_routed", "Requests sent to a backend, by the router's reason.",
                              ["pool", "backend", "decision"], registry=r)
        self.admission = Counter("kvserve_gateway_admission_decisions",
                                 "Fleet admission decisions by outcome (admit|degrade|defer|reject) and reason.",
                                 ["pool", "outcome", "reason"], registry=r)
        self.retries = Counter("kvserve_gateway_retries", "Re-sends to another backend, by what the first answered.",
                               ["pool", "reason"], registry=r)
        self.ejections = Counter("kvserve_gateway_backend_ejections",
                                 "Times a backend's circuit breaker opened.", ["backend"], registry=r)
        self.degradations = Counter("kvserve_gateway_degradations", "Ladder rungs applied, by rung.",
                                    ["pool", "step"], registry=r)
        self.stream_errors = Counter("kvserve_gateway_stream_errors",
                                     "Streams ended with an error event because their backend failed.",
                                     ["backend"], registry=r)
        self.breaker = Gauge("kvserve_gateway_breaker_state", "1 for the breaker's current state.",
                             ["backend", "state"], registry=r)
        self.batch_jobs = Gauge("kvserve_gateway_batch_jobs", "Batches by status.", ["status"], registry=r)
        self.queue_size = Gauge("kvserve_fleet_queue_size", "Requests waiting at the backend (autoscaling signal).",
                                ["pool", "backend"], registry=r)
        self.queue_wait = Gauge("kvserve_fleet_queue_wait_seconds",
                                "Expected queue wait of a new request there, from its measured drain (s).",
                                ["pool", "backend"], registry=r)
        self.batch_size = Gauge("kvserve_fleet_batch_size", "Requests running at the backend.",
                                ["pool", "backend"], registry=r)
        self.kv_usage = Gauge("kvserve_fleet_kv_usage", "KV cache usage at the backend (0..1).",
                              ["pool", "backend"], registry=r)
        self.in_flight = Gauge("kvserve_fleet_gateway_in_flight", "Requests the gateway has at the backend.",
                               ["pool", "backend"], registry=r)
        self.desired = Gauge("kvserve_fleet_desired_replicas",
                             "Replicas the pool should have (fleet.autoscale.desired_replicas).", ["pool"], registry=r)
        self.ready_backends = Gauge("kvserve_fleet_ready_backends", "Backends getting traffic now.", ["pool"],
                                    registry=r)
        self._ejections_seen: dict[str, int] = {}

    def record_admission(self, pool: str, outcome: Outcome | str, reason: Reason | str | None) -> None:
        """One fleet decision; labels are the wire strings, as the server's
        kvserve_admission_decisions_total ("none" for no reason)."""
        self.admission.labels(pool, str(outcome), "none" if reason is None else str(reason)).inc()

    def refresh(self, pools: Iterable[tuple[str, list[BackendView], int]], batch_counts: dict[str, int]) -> None:
        """Backend gauges from the views: (pool name, its views, how many are eligible)."""
        for pool, views, num_ready in pools:
            for v in views:
                labels = (pool, v.name)
                self.queue_size.labels(*labels).set(v.num_waiting)
                wait = expected_wait_s(v)
                self.queue_wait.labels(*labels).set(wait if wait != float("inf") else 1e9)
                self.batch_size.labels(*labels).set(v.num_running)
                self.kv_usage.labels(*labels).set(v.kv_usage)
                self.in_flight.labels(*labels).set(v.in_flight)
                state = v.breaker.state
                for s in BREAKER_STATES:
                    self.breaker.labels(v.name, s).set(1.0 if s == state else 0.0)
                new = v.breaker.num_ejections - self._ejections_seen.get(v.name, 0)
                if new > 0:
                    self.ejections.labels(v.name).inc(new)
                self._ejections_seen[v.name] = v.breaker.num_ejections
            self.desired.labels(pool).set(desired_replicas(views))
            self.ready_backends.labels(pool).set(num_ready)
        for status, count in batch_counts.items():
            self.batch_jobs.labels(status).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
