"""The model deployment's replica: one kvserve engine, exactly as
`kvserve serve` builds it (server.cli.build_serving: the async engine, the
server's per-replica admission and metrics), answering the requests the
ingress forwards through kvserve's own ASGI app in process.

What it records for Ray Serve:
- `record_routing_stats`: its own /metrics as the gateway parses them
  (vLLM's names), its KV cache's size, whether it is ready or asleep: the
  router builds a fleet `BackendLoad` view of it from these;
- `record_autoscaling_stats`: the autoscaling signals
  (`fleet.autoscale.ReplicaSignals`): the p95 queue wait over the look-back
  (from its `vllm:request_queue_time_seconds` histogram, as a Prometheus
  rule would take it), the expected wait of a request arriving now, KV
  usage and its sleep level.

Sleep and wake go through the same app (`POST /sleep?level=N`,
`POST /wake_up`, `GET /is_sleeping`), so a replica sleeps as a server does.

How Ray Serve 2.60 stops a replica (a scale-down, an upgrade, the
application's delete; read from ray/serve/_private/deployment_state.py and
replica.py): the controller picks the replica (on a scale-down: one not
running yet, else one off the head node, on the node with fewest replicas,
the newest), moves it to STOPPING and calls its actor's
`perform_graceful_shutdown` in the same control-loop step, in which it also
broadcasts the running set without it, so routers stop choosing it within
moments. The actor then waits, every `graceful_shutdown_wait_loop_s`, for
its ongoing requests to end, calls the user's `__del__` only once none is
left, and the controller kills it `graceful_shutdown_timeout_s` after the
stop whatever is still running. No public hook tells the user's code that
the wait began: a stream longer than the timeout is cut by the kill (an
error event at the client), and the engine never stops admitting.

What kvserve adds: the replica drains as `kvserve serve` does at its own
shutdown (`begin_drain`: it stops admitting, 503 "shutting_down", /ready
and its routing stats say not ready; requests in flight get the shutdown
grace to finish, then what is still running ends as finish_reason "abort",
then [DONE]), told in one of two ways:
- a stop Ray decides (scale-down, upgrade): kvserve's router in the ingress
  sees the replica leave Ray's running set (`RequestRouter.update_replicas`,
  public), and the replica, asking the ingress every stats period
  (`Ingress.replica_stopping`), learns it within a period;
- `kvserve ray`'s shutdown: the command calls `begin_drain` on every
  replica before it deletes the application.
Ray's graceful timeout is set past the grace plus that period
(kvserve.ray.app), so the kill comes after the aborts' last chunks; then
`__del__` stops the engine. A replica that drained while Ray still counts
it running (a notice Ray did not follow) fails its health check, so Ray
replaces it rather than keep one that refuses everything.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator

from kvserve.fleet.autoscale import ReplicaSignals, signals_of
from kvserve.ray.fleet_metrics import fleet_lines
from kvserve.ray.forward import REPLICA_HEADER, ForwardedRequest, ResponseStart, run_asgi
from kvserve.startup import StartupPhases

# Under "ray.serve": Ray Serve sends its loggers to the replica logs.
log = logging.getLogger("ray.serve." + __name__)

# For the ingress's answer to "is Ray stopping me?" (a loaded ingress answers in well under that).
STOP_ASK_TIMEOUT_S = 10.0

QUEUE_TIME_METRIC = "vllm:request_queue_time_seconds"


class HistogramWindow:
    """The p95 of a Prometheus histogram over the last `look_back_s`, from
    snapshots of its cumulative buckets (what `histogram_quantile` over a
    `rate[...]` computes): the upper bound of the bucket the 95th
    percentile falls in."""

    def __init__(self, look_back_s: float) -> None:
        self.look_back_s = look_back_s
        self._snapshots: deque[tuple[float, list[tuple[float, float]]]] = deque()

    def observe(self, now_s: float, buckets: list[tuple[float, float]]) -> None:
        """`buckets`: (upper bound, cumulative count), ascending, +Inf last."""
        self._snapshots.append((now_s, buckets))
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= now_s - self.look_back_s:
            self._snapshots.popleft()

    def p95_s(self) -> float:
        if len(self._snapshots) < 2:
            return 0.0
        old, new = self._snapshots[0][1], self._snapshots[-1][1]
        deltas = [(bound, count - old_count) for (bound, count), (_, old_count) in zip(new, old)]
        total = deltas[-1][1] if deltas else 0.0
        if total <= 0:
            return 0.0
        finite = [bound for bound, _ in deltas if bound != float("inf")]
        for bound, count in deltas:
            if count >= 0.95 * total:
                return bound if bound != float("inf") else (finite[-1] if finite else 0.0)
        return 0.0


def histogram_buckets(registry, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets summed over its label sets."""
    sums: dict[float, float] = {}
    for metric in registry.collect():
        if metric.name != name:
            continue
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                sums[bound] = sums.get(bound, 0.0) + sample.value
    return sorted(sums.items())


class ModelReplica:
    """One kvserve engine behind a Ray Serve replica. `serve_args`: the
    `kvserve serve` flags as a dict (argparse's namespace, e.g. from
    `kvserve ray`), passed to every replica. `ingress_deployment`: the
    deployment it asks, every `stop_poll_s`, whether Ray is stopping it
    (None: it is only told by `begin_drain`)."""

    async def __init__(self, serve_args: dict, look_back_s: float = 10.0, ingress_deployment: str | None = None,
                       stop_poll_s: float = 1.0) -> None:
        phases = StartupPhases()
        self.replica_id = _replica_id()
        with phases.phase("imports"):
            from kvserve.gateway.backends import BackendView, parse_metrics
            from kvserve.gateway.config import BackendConfig, BreakerConfig
            from kvserve.server.app import create_app
            from kvserve.server.cli import build_serving
        self._parse_metrics = parse_metrics
        args = argparse.Namespace(**serve_args)
        self.serving = await asyncio.to_thread(build_serving, args, phases)
        self.app = create_app(self.serving)
        kv = self.serving.core.scheduler.kv_cache
        self.num_kv_blocks, self.block_size = kv.num_blocks, kv.block_size
        # Its own view, as a gateway would keep of it: the expected wait of a new request.
        self._view = BackendView(BackendConfig(f"http://{self.replica_id}", self.replica_id, self.num_kv_blocks,
                                               self.block_size), BreakerConfig(), time.monotonic)
        self._queue_wait = HistogramWindow(look_back_s)
        self._stats_number = 0
        self._drain: asyncio.Task | None = None
        self._stop_watch: asyncio.Task | None = None  # asks the ingress whether Ray is stopping it
        await self.serving.start()  # warm-up: timed into phases, logged, and the startup gauge set
        # From the process's start (Ray's worker start and imports included) to ready.
        phases.record("process_start_to_ready", time.time() - _process_start_time())
        log.info("replica %s ready: %s", self.replica_id, phases.summary())
        # Off the event loop: the handle asks the controller (a blocking ray.get) that the deployment exists.
        ingress = await asyncio.to_thread(_deployment_handle, ingress_deployment) if ingress_deployment else None
        if ingress is not None:
            self._stop_watch = asyncio.get_running_loop().create_task(self._watch_for_stop(ingress, stop_poll_s))

    async def _watch_for_stop(self, ingress, period_s: float) -> None:
        """Until a drain began: ask the ingress every period whether Ray took
        this replica out of its running set; when it did, drain."""
        while self._drain is None:
            await asyncio.sleep(period_s)
            response = ingress.replica_stopping.remote(self.replica_id)
            try:
                stopping = await asyncio.wait_for(response, STOP_ASK_TIMEOUT_S)
            except Exception as exc:  # the ingress restarting, or gone with the application: ask again
                response.cancel()
                log.debug("replica %s: the ingress did not say whether it is stopping: %r", self.replica_id, exc)
                continue
            if stopping and self._drain is None:
                log.info("replica %s: Ray is stopping it; draining (grace %.1f s)", self.replica_id,
                         self.serving.config.shutdown_grace_s)
                await self.begin_drain()

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to one forwarded request: a ResponseStart (with
        this replica's id in a header), then the body's chunks."""
        async for item in run_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, item.headers + ((REPLICA_HEADER, self.replica_id.encode()),))
            yield item

    async def record_routing_stats(self) -> dict:
        text = self.serving.metrics.render().decode()
        scrape = self._parse_metrics(text)
        self._stats_number += 1
        return {"scrape": dataclasses.asdict(scrape), "series": fleet_lines(text), "ready": self.serving.ready,
                "sleeping": self.serving.sleep_level, "num_kv_blocks": self.num_kv_blocks,
                "block_size": self.block_size, "number": self._stats_number,
                "model": self.serving.model_name,
                "startup_s": dict(self.serving.startup.seconds), "signals": self.signals()._asdict()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.signals()._asdict().items()}

    def signals(self) -> ReplicaSignals:
        now = time.monotonic()
        self._view.record_scrape(self._parse_metrics(self.serving.metrics.render().decode()), True)
        self._queue_wait.observe(now, histogram_buckets(self.serving.metrics.registry, QUEUE_TIME_METRIC))
        return signals_of(self._view, self._queue_wait.p95_s(), self.serving.sleep_level > 0)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine died (a sleeping one is
        healthy), and one that drained while Ray still runs it: Ray checks
        only the replicas in its running set, which a stopping one has left."""
        if self.serving.engine.dead is not None:
            raise RuntimeError(f"engine failed: {self.serving.engine.dead}")
        if self._drain is not None and self._drain.done():
            raise RuntimeError("drained (told Ray was stopping it), yet Ray still runs it")

    async def begin_drain(self) -> None:
        """Stop admitting (503, /ready false) and give the requests in
        flight the shutdown grace, then abort the rest: a stream ends with a
        chunk whose finish_reason is "abort", then [DONE]. Returns at once;
        Ray's drain, waiting for those requests, ends with them."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(
                self.serving.drain(self.serving.config.shutdown_grace_s))

    async def __del__(self) -> None:
        # Ray has drained its own requests by now; finish or abort what is left, then stop.
        if self._stop_watch is not None:
            self._stop_watch.cancel()
        await self.begin_drain()
        await self._drain
        await self.serving.stop()


def _process_start_time() -> float:
    import psutil  # a dependency of Ray's

    return psutil.Process().create_time()


def _deployment_handle(deployment: str):
    """A handle to a deployment of this replica's application; None outside a Ray replica (tests)."""
    try:
        from ray import serve

        app_name = serve.get_replica_context().app_name
    except Exception:  # outside a Ray replica
        return None
    try:
        return serve.get_deployment_handle(deployment, app_name)
    except Exception as exc:
        log.warning("no handle to deployment %s (%r): a stop Ray decides will cut this replica's streams",
                    deployment, exc)
        return None


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Ray replica (tests)
        return f"replica-{os.getpid()}"
