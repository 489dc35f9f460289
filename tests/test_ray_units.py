"""kvserve.ray's parts without a cluster: the replica views the router
ranks (fleet.router's decision first, sleeping replicas last, failed ones
left out), a forwarded request answered by the server's app in process
(and a reader that leaves aborting it), the replica's queue-wait p95 from
its histogram, the application's args (the queue-wait limits reach the
ingress and every replica), the ingress's fleet refusal against them, and
a replica's own 429 sent to the other replica (or, both full, one 429 with
the soonest Retry-After), and the ingress's prefix-affinity key taking
the adapter a request runs under."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import types

import pytest

from kvserve.fleet.router import RouteRequest, Router, RouterConfig
from kvserve.gateway.backends import Scrape
from kvserve.ray.forward import ForwardedRequest, ResponseStart, run_asgi
from kvserve.ray.replica import HistogramWindow
from kvserve.ray.views import ReplicaViews
from kvserve.ray_app import parse_app_args
from kvserve.server.app import create_app
from tests.server_helpers import live_server, slow_steps, tiny_core


def _stats(number: int, running: int, sleeping: int = 0) -> dict:
    scrape = Scrape(num_running=running, num_waiting=0, kv_usage=0.1, finished_total=10.0)
    return {"scrape": dataclasses.asdict(scrape), "ready": not sleeping, "sleeping": sleeping,
            "num_kv_blocks": 100, "block_size": 16, "number": number}


def test_views_rank_the_routers_choice_first_and_sleepers_last():
    views = ReplicaViews(clock=time.monotonic)
    views.refresh("a", _stats(1, running=5))
    views.refresh("b", _stats(1, running=1))
    views.refresh("c", _stats(1, running=0, sleeping=1))
    router = Router(RouterConfig("least-loaded"))
    assert views.rank(router, ["a", "b", "c"], RouteRequest(10, 10)) == [["b"], ["a"], ["c"]]
    assert views.rank(router, ["a", "b", "c"], RouteRequest(10, 10), frozenset({"b"})) == [["a"], ["c"]]
    # A control request to the sleeper alone (the warm pool's wake_up).
    assert views.rank(router, ["a", "b", "c"], RouteRequest(), frozenset({"a", "b"})) == [["c"]]


def test_views_take_a_stats_number_once_and_forget_gone_replicas():
    views = ReplicaViews(clock=time.monotonic)
    view = views.refresh("a", _stats(1, running=2))
    view.on_send(32)  # sent since those stats: counted as running
    assert views.refresh("a", _stats(1, running=2)).num_running == 3  # same stats: not re-read
    assert views.refresh("a", _stats(2, running=2)).num_running == 2  # new stats show it
    views.forget_except({"b"})
    assert views.views == {}


def test_a_burst_routed_before_any_send_spreads_each_choice_seeing_the_ones_before():
    # Ray's routing task chooses for every pending request of a burst before
    # the first is sent: counted only at the send, all 8 went to one replica.
    views = ReplicaViews(_Clock())
    views.refresh("a", _stats(1, running=0))
    views.refresh("b", _stats(1, running=0))
    router = Router(RouterConfig("least-loaded"))
    chosen = [views.choose(router, ["a", "b"], RouteRequest(10, 10), request_id=f"r{i}")[0][0] for i in range(8)]
    assert sorted(collections.Counter(chosen).values()) == [4, 4], chosen
    for replica in chosen:
        views.on_sent(replica)
    assert views.views["a"].num_running == views.views["b"].num_running == 4
    for _ in range(4):
        views.on_completed("a")
    assert views.views["a"].num_running == 0 and views.views["b"].num_running == 4


def test_a_choice_counts_once_until_sent_replaced_when_chosen_again_and_forgotten_unsent():
    from kvserve.ray.views import CHOICE_KEPT_S

    clock = _Clock()
    views = ReplicaViews(clock)
    views.refresh("a", _stats(1, running=0))
    views.refresh("b", _stats(1, running=0))
    router = Router(RouterConfig("least-loaded"))
    a, b = views.views["a"], views.views["b"]
    assert views.choose(router, ["a", "b"], RouteRequest(10, 10), request_id="r1") == [["a"], ["b"]]
    assert (a.num_running, b.num_running) == (1, 0)
    # Ray's backoff chooses the same request again, "a" left out: it moves.
    assert views.choose(router, ["a", "b"], RouteRequest(10, 10), frozenset({"a"}), "r1") == [["b"]]
    assert (a.num_running, b.num_running) == (0, 1)
    views.on_sent("b")
    assert (a.num_running, b.num_running) == (0, 1)  # taken over, not counted twice
    # Sent to a replica it was not chosen for (a lower rank): counted at the send.
    views.on_sent("a")
    assert (a.num_running, b.num_running) == (1, 1)
    # A choice never sent (the client left first) stops counting.
    views.choose(router, ["a", "b"], RouteRequest(10, 10), request_id="r2")
    assert a.num_running + b.num_running == 3
    clock.now = CHOICE_KEPT_S + 1
    views.choose(router, ["a", "b"], RouteRequest(10, 10), frozenset({"a", "b"}), "r3")  # chooses nothing
    assert (a.num_running, b.num_running) == (1, 1)
    views.on_completed("a")
    views.on_completed("b")
    assert (a.num_running, b.num_running) == (0, 0)


def test_a_replica_ray_takes_out_of_the_running_set_is_stopping_until_forgotten():
    from kvserve.ray.views import STOPPING_KEPT_S

    clock = _Clock()
    views = ReplicaViews(clock)
    for name in ("a", "b"):
        views.refresh(name, _stats(1, running=1))
    views.forget_except({"a", "b"})
    assert not views.is_stopping("a") and not views.is_stopping("b")
    assert not views.is_stopping("new")  # not in any set yet: starting, not stopping
    views.forget_except({"a"})  # Ray's broadcast after it stopped "b"
    assert views.is_stopping("b") and not views.is_stopping("a")
    clock.now = STOPPING_KEPT_S / 2
    views.forget_except({"a"})
    assert views.is_stopping("b")  # still asked about while Ray drains it
    views.refresh("c", _stats(1, running=0))
    views.forget_except({"a"})  # a broadcast without "c" ...
    assert views.is_stopping("c")
    views.refresh("c", _stats(2, running=0))  # ... and one with it again: running, not stopping
    assert not views.is_stopping("c")
    clock.now = STOPPING_KEPT_S + 1
    views.forget_except({"a"})
    assert not views.is_stopping("b")  # long gone: forgotten


def test_a_request_for_the_base_model_keys_alike_named_or_not_and_an_adapter_apart():
    # The prefix-affinity key names the model state the request runs under:
    # "model": "smollm2", no "model" at all, and a replica that has not
    # reported yet all reach the base model's cache; an adapter has its own.
    views = ReplicaViews(clock=time.monotonic)
    assert views.state_name(None) == ""
    views.refresh("a", {**_stats(1, running=0), "model": "smollm2"})
    assert views.state_name("smollm2") == views.state_name(None) == ""
    assert views.state_name("sql-lora") == "sql-lora"
    views.forget_except(set())
    assert views.state_name("smollm2") == "smollm2"  # no replica left says it is the base


def test_histogram_window_p95_over_the_look_back():
    window = HistogramWindow(look_back_s=10.0)
    bounds = (0.1, 0.5, 1.0, float("inf"))
    window.observe(0.0, [(b, 0.0) for b in bounds])
    window.observe(5.0, list(zip(bounds, (18.0, 18.0, 20.0, 20.0))))  # 2 of 20 waited 0.5..1 s
    assert window.p95_s() == 1.0
    # 25 s later, 20 more that waited < 0.1 s: the window (from t=5 on) no longer holds the slow two.
    window.observe(30.0, list(zip(bounds, (38.0, 38.0, 40.0, 40.0))))
    assert window.p95_s() == 0.1


def test_a_forwarded_request_is_answered_by_the_app_and_a_leaving_reader_aborts_it():
    server = live_server(slow_steps(tiny_core(), 0.02))
    app = create_app(server.serving)

    async def run() -> None:
        await server.serving.start()
        try:
            body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 4}'
            headers = ((b"content-type", b"application/json"),)
            items = [x async for x in run_asgi(app, ForwardedRequest("POST", "/v1/completions", body, headers))]
            assert isinstance(items[0], ResponseStart) and items[0].status == 200
            assert b'"completion_tokens":4' in b"".join(items[1:])

            stream_body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": true}'
            events = run_asgi(app, ForwardedRequest("POST", "/v1/completions", stream_body, headers))
            start = await events.__anext__()
            assert start.header("content-type").startswith("text/event-stream")
            await events.__anext__()
            left = time.monotonic()
            await events.aclose()  # the ingress's client left (400 tokens would take 8 s more)
            assert time.monotonic() - left < 2.0
            for _ in range(40):  # the abort reaches the engine thread within a step or two
                if server.serving.engine.num_streams == 0:
                    break
                await asyncio.sleep(0.05)
            assert server.serving.engine.num_streams == 0 and time.monotonic() - left < 3.0
        finally:
            await server.serving.stop()

    asyncio.run(run())


def test_app_args_from_a_dict_as_serve_run_gives_them():
    args = parse_app_args({"model": "/m", "num_replicas": "2", "sleep_idle": "true", "kv-cache-memory": "1GiB",
                           "no_warm_up": True, "router": "round-robin"})
    assert (args.model, args.num_replicas, args.sleep_idle, args.kv_cache_memory, args.warm_up) == \
        ("/m", 2, True, "1GiB", False)
    with pytest.raises(ValueError):
        parse_app_args({"router": "nearest"})


def test_the_autoscaling_flags_reach_the_policy_by_either_name():
    # A Ray Serve config file's keys (deploy/ray/kvserve.yaml) and simulate's longer names.
    from kvserve.fleet.autoscale import AutoscaleConfig
    from kvserve.ray.app import autoscale_config

    short = parse_app_args({"model": "/m", "min_replicas": 2, "max_replicas": 3, "queue_wait_target": 0.4,
                            "kv_target": 0.7, "look_back": 3, "scale_down_delay": 2})
    long = parse_app_args({"model": "/m", "min_replicas": 2, "max_replicas": 3, "autoscale_queue_wait_target": 0.4,
                           "autoscale_kv_target": 0.7, "autoscale_look_back": 3, "autoscale_scale_down_delay": 2})
    expected = AutoscaleConfig(min_replicas=2, max_replicas=3, queue_wait_target_s=0.4, kv_target=0.7,
                               look_back_s=3.0, scale_down_delay_s=2.0)
    assert autoscale_config(short) == autoscale_config(long) == expected


def test_kvserve_ray_help_and_bad_bounds_without_starting_ray(capsys, monkeypatch):
    import ray

    from kvserve.cli import main

    def no_cluster(*args, **kwargs):
        raise AssertionError("bad bounds must be refused before Ray starts")

    monkeypatch.setattr(ray, "init", no_cluster)

    with pytest.raises(SystemExit):
        main(["ray", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--address", "--num-replicas", "--min-replicas", "--max-replicas", "--sleep-idle",
                 "--queue-wait-target", "--kv-target", "--kv-cache-memory", "--max-queue-wait"):
        assert flag in help_text
    assert main(["ray", "--min-replicas", "4", "--max-replicas", "2"]) == 2
    assert "max_replicas" in capsys.readouterr().err


def test_the_ingress_fleet_admission_and_every_replica_get_the_configured_queue_wait_limits():
    from kvserve.ray.ingress import IngressConfig
    from kvserve.ray_app import build_app

    app = build_app({"model": "/m", "num_replicas": 1, "max_queue_wait": "7", "deferred_max_queue_wait": "20",
                     "queue_timeout": "40"})
    # Ray's bound deployment (no public reader without a cluster): Ingress(model, config).
    model, ingress_config = app._bound_deployment.init_args
    admission = IngressConfig(**ingress_config).admission
    assert (admission.max_wait_s(0), admission.max_wait_s(1), admission.queue_timeout_s) == (7.0, 20.0, 40.0)
    serve_args = model._bound_deployment.init_args[0]
    assert (serve_args["max_queue_wait"], serve_args["deferred_max_queue_wait"]) == (7.0, 20.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _HandleCalls:
    """How the ingress reaches the model deployment's handle:
    handle.options(...).handle_http.remote(forwarded)."""

    def options(self, **_):
        return self

    @property
    def handle_http(self):
        return self


class _ReplicaHandle(_HandleCalls):
    """The model deployment's handle as the ingress calls it: each send answers 200."""

    def __init__(self) -> None:
        self.sent: list[ForwardedRequest] = []

    def remote(self, forwarded: ForwardedRequest):
        self.sent.append(forwarded)
        return _Answer([ResponseStart(200, ((b"content-type", b"application/json"),)),
                        b'{"usage": {"total_tokens": 3}}'])


class _Answer:
    """A replica's streamed answer (Ray's response generator: async iterator + cancel)."""

    def __init__(self, items: list) -> None:
        self._items = iter(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


def _post(ingress, body: dict):
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return asyncio.run(ingress.completions(Request(scope, receive)))


@pytest.mark.parametrize("max_queue_wait_s, refused", [(30.0, False), (5.0, True)])
def test_the_ingress_refuses_before_any_replica_past_the_configured_queue_wait(max_queue_wait_s, refused):
    from kvserve.config import AdmissionConfig
    from kvserve.ray.ingress import Ingress

    # One replica, its batch full, 30 waiting, 2 requests finished a second: ~15 s to a slot.
    clock = _Clock()
    views = ReplicaViews(clock)
    running = Scrape(num_running=8, num_waiting=0, kv_usage=0.2, finished_total=0.0, running_cap=8)
    views.refresh("r", {"scrape": dataclasses.asdict(running), "ready": True, "num_kv_blocks": 1000,
                        "block_size": 16, "number": 1})
    clock.now = 10.0
    queued = dataclasses.replace(running, num_waiting=30, finished_total=20.0)
    views.refresh("r", {"scrape": dataclasses.asdict(queued), "ready": True, "number": 2})

    handle = _ReplicaHandle()
    ingress_class = Ingress.func_or_class.__mro__[1]  # the class under Ray Serve's ASGI wrapper
    ingress = ingress_class.__new__(ingress_class)
    config = {"deployment_name": "units", "admission": AdmissionConfig(max_queue_wait_s=max_queue_wait_s,
                                                                       queue_timeout_s=60.0)}
    ingress_class.__init__(ingress, handle, config)
    ingress.replicas, ingress.views = views, views.views

    response = _post(ingress, {"model": "m", "prompt": "hello", "max_tokens": 16})
    if refused:
        error = json.loads(response.body)["error"]
        assert (response.status_code, error["code"]) == (429, "batch_slots") and not handle.sent
        assert "within 5.00 s" in error["message"] and int(response.headers["retry-after"]) >= 1
    else:
        assert response.status_code == 200 and len(handle.sent) == 1


DRAINING = "draining"


class _TwoReplicas(_HandleCalls):
    """The model deployment's handle over replicas "a" then "b", each
    answering 200 or 429 with its Retry-After; a send goes to the first
    replica the request does not exclude (what kvserve's router does with
    `exclude`), so the first send always reaches "a"."""

    def __init__(self, retry_after_s: dict[str, int | str | None]) -> None:
        self.retry_after_s = retry_after_s  # None: it answers 200; DRAINING: 503 shutting_down
        self.sent: list[tuple[str, ForwardedRequest]] = []

    def remote(self, forwarded: ForwardedRequest):
        name = next(n for n in self.retry_after_s if n not in forwarded.exclude)
        self.sent.append((name, forwarded))
        replica = (b"x-kvserve-replica", name.encode())
        retry_after = self.retry_after_s[name]
        if retry_after is None:
            return _Answer([ResponseStart(200, ((b"content-type", b"application/json"), replica)),
                            b'{"usage": {"total_tokens": 3}}'])
        if retry_after == DRAINING:
            error = {"error": {"message": "the server is shutting down", "type": "unavailable",
                               "code": "shutting_down", "param": None}}
            return _Answer([ResponseStart(503, ((b"content-type", b"application/json"), replica,
                                                (b"retry-after", b"3"))), json.dumps(error).encode()])
        error = {"error": {"message": "full", "type": "rate_limit_error", "code": "queue_full", "param": None}}
        return _Answer([ResponseStart(429, ((b"content-type", b"application/json"), replica,
                                            (b"retry-after", str(retry_after).encode()))), json.dumps(error).encode()])


def _ingress_over(handle):
    from kvserve.ray.ingress import Ingress

    views = ReplicaViews(_Clock())
    for name in ("a", "b"):
        views.refresh(name, _stats(1, running=0))
    ingress_class = Ingress.func_or_class.__mro__[1]  # the class under Ray Serve's ASGI wrapper
    ingress = ingress_class.__new__(ingress_class)
    ingress_class.__init__(ingress, handle, {"deployment_name": "units-two"})
    ingress.replicas, ingress.views = views, views.views
    return ingress


def _metric(ingress, name: str, labels: dict) -> float:
    return ingress.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_replicas_429_is_sent_to_the_other_replica_which_answers():
    handle = _TwoReplicas({"a": 7, "b": None})
    ingress = _ingress_over(handle)
    response = _post(ingress, {"model": "m", "prompt": "hello", "max_tokens": 16})
    assert response.status_code == 200 and response.headers["x-kvserve-replica"] == "b"
    assert [(name, forwarded.exclude) for name, forwarded in handle.sent] == [("a", frozenset()), ("b", {"a"})]
    assert _metric(ingress, "kvserve_ray_retries_total", {"reason": "replica_full"}) == 1
    assert _metric(ingress, "kvserve_ray_forwards_total", {"outcome": "replica_full"}) == 1
    assert _metric(ingress, "kvserve_ray_forwards_total", {"outcome": "answered"}) == 1


def test_both_replicas_full_give_one_429_with_the_soonest_retry_after():
    handle = _TwoReplicas({"a": 7, "b": 4})
    ingress = _ingress_over(handle)
    response = _post(ingress, {"model": "m", "prompt": "hello", "max_tokens": 16})
    error = json.loads(response.body)["error"]
    assert (response.status_code, error["code"], response.headers["retry-after"]) == (429, "queue_full", "4")
    assert [name for name, _ in handle.sent] == ["a", "b"]  # each asked once
    assert _metric(ingress, "kvserve_ray_admission_rejections_total", {"reason": "queue_full"}) == 1
    assert not ingress.quotas._in_flight  # its fleet slot is given back


def test_a_draining_replicas_503_is_sent_to_the_other_and_relayed_when_none_is_left():
    handle = _TwoReplicas({"a": DRAINING, "b": None})
    ingress = _ingress_over(handle)
    response = _post(ingress, {"model": "m", "prompt": "hello", "max_tokens": 16})
    assert response.status_code == 200 and response.headers["x-kvserve-replica"] == "b"
    assert [name for name, _ in handle.sent] == ["a", "b"]
    assert _metric(ingress, "kvserve_ray_retries_total", {"reason": "replica_draining"}) == 1

    handle = _TwoReplicas({"a": DRAINING, "b": DRAINING})
    ingress = _ingress_over(handle)
    response = _post(ingress, {"model": "m", "prompt": "hello", "max_tokens": 16})
    error = json.loads(response.body)["error"]
    assert (response.status_code, error["code"], response.headers["retry-after"]) == (503, "shutting_down", "3")
    assert [name for name, _ in handle.sent] == ["a", "b"]  # each asked once
    assert not ingress.quotas._in_flight


def test_the_ingress_tells_a_replica_whether_ray_is_stopping_it():
    ingress = _ingress_over(_TwoReplicas({"a": None, "b": None}))
    ingress.replicas.forget_except({"a"})  # Ray stopped "b"
    assert asyncio.run(ingress.replica_stopping("b")) is True
    assert asyncio.run(ingress.replica_stopping("a")) is False


class _Reply:
    """A handle call's response: awaited for its value (or its error)."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
        yield  # a generator: awaitable

    def cancel(self) -> None:
        pass


def test_a_replica_drains_once_the_ingress_says_ray_is_stopping_it_asking_again_after_a_failure():
    from kvserve.ray.replica import ModelReplica

    class _Serving:
        config = types.SimpleNamespace(shutdown_grace_s=7.0)
        engine = types.SimpleNamespace(dead=None)

        def __init__(self) -> None:
            self.drains: list[float] = []
            self.in_flight_done = asyncio.Event()

        async def drain(self, grace_s: float) -> None:
            self.drains.append(grace_s)
            await self.in_flight_done.wait()

    class _EngineFree(ModelReplica):
        def __del__(self) -> None:  # Ray awaits the real one; here nothing was started
            pass

    answers = iter([RuntimeError("the ingress is restarting"), False, True])
    asked: list[str] = []

    def remote(replica_id: str) -> _Reply:
        asked.append(replica_id)
        return _Reply(next(answers))

    ingress = types.SimpleNamespace(replica_stopping=types.SimpleNamespace(remote=remote))
    replica = _EngineFree.__new__(_EngineFree)  # no __init__: no engine
    replica.replica_id, replica.serving, replica._drain = "r1", _Serving(), None

    async def watch() -> None:
        await asyncio.wait_for(replica._watch_for_stop(ingress, 0.01), timeout=10)
        replica.check_health()  # draining, its requests not done yet: healthy
        replica.serving.in_flight_done.set()
        await replica._drain

    asyncio.run(watch())
    assert asked == ["r1"] * 3 and replica.serving.drains == [7.0]  # the shutdown grace
    with pytest.raises(RuntimeError, match="drained"):  # Ray still health-checks it: not stopping after all
        replica.check_health()


def test_ray_lets_a_stopping_replica_run_past_its_grace_and_the_period_it_takes_to_learn_it():
    from kvserve.ray_app import build_app

    app = build_app({"model": "/m", "num_replicas": 1, "shutdown_grace": "12", "stats_period": "3"})
    model = app._bound_deployment.init_args[0]._bound_deployment
    replica_timeout_s = model._deployment_config.graceful_shutdown_timeout_s
    assert replica_timeout_s > 12 + 3  # the notice takes up to a period, the grace runs from it
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s > replica_timeout_s
    assert model.init_args[2:] == ("Ingress", 3.0)  # the deployment each replica asks, every period
    assert app._bound_deployment.name == "Ingress"


def test_the_ingress_keys_one_prompt_apart_under_each_adapter_for_prefix_affinity():
    handle = _ReplicaHandle()
    ingress = _ingress_over(handle)
    ingress.config = dataclasses.replace(ingress.config, router_policy="prefix-affinity")
    for model in ("sql", "sql", "base"):
        assert _post(ingress, {"model": model, "prompt": "a shared system prompt", "max_tokens": 4}).status_code == 200
    sql, sql_again, base = (forwarded.route.affinity_key for forwarded in handle.sent)
    assert sql is not None and sql == sql_again and base != sql


def test_replica_series_label_each_replicas_vllm_series_and_leave_the_rest():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.ray.fleet_metrics import fleet_lines, replica_series

    def exposition(num_success: int) -> str:
        registry = CollectorRegistry()
        success = Counter("vllm:request_success", "Finished requests.", ["finished_reason"], registry=registry)
        success.labels("length").inc(num_success)
        Gauge("vllm:num_requests_running", "Running.", registry=registry).set(num_success - 1)
        Gauge("kvserve_memory_bytes", "Not a fleet series.", registry=registry).set(1)
        return generate_latest(registry).decode()

    # What each replica sends (fleet_lines), merged.
    text = replica_series({"a": fleet_lines(exposition(3)), "b": fleet_lines(exposition(5))}).decode()
    assert text.count("# TYPE vllm:request_success_total counter") == 1 and "kvserve_memory_bytes" not in text
    samples = {(s.name, s.labels.get("replica")): (s.value, s.labels)
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["vllm:request_success_total", "a"] == (3.0, {"finished_reason": "length", "replica": "a"})
    assert samples["vllm:request_success_total", "b"][0] == 5.0
    assert (samples["vllm:num_requests_running", "a"][0], samples["vllm:num_requests_running", "b"][0]) == (2.0, 4.0)
