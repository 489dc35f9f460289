"""kvserve on Ray Serve, on a local Ray cluster the tests start
(`ray.init(num_cpus=2)`): the official openai client through the Ray
ingress, streaming and not, over two replicas of a tiny random-weight model;
a burst spread across them by kvserve's router (per-replica counts); a burst
that builds queue wait scales 1 -> 2 and idleness back after the delay with
no request lost or sent twice, and the scale-down drains: a stream on the
replica Ray removes ends at the grace as `kvserve serve` ends one (an abort,
then [DONE]; not the error event of Ray's kill), the other replica's stream
runs on and it serves; a replica killed with `ray.kill` while its requests
wait: they are answered by another replica.

The autoscaling and kill tests run simulated replicas (`kvserve serve
--simulate`: the real server, admission and scheduler, each engine step a
sleep of an 8B model's roofline time on an L4), so a replica stays busy for
a known time on the shared 2-core machine."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from kvserve.ray_app import MODEL_DEPLOYMENT, build_app
from tests.load_helpers import wait_until
from tests.server_helpers import CHAT_TEMPLATE, byte_tokenizer
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.ray

APP = "kvserve"
TINY = {"served_model_name": "tiny", "kv_cache_memory": "1MiB", "max_model_len": 256, "torch_threads": 1,
        "replica_cpus": 0.5, "stats_period": 0.5}
# Two batch slots per replica, ~0.07 s a step: a 20-token answer holds a slot ~1.5 s.
# The replicas admit every burst here (these tests are about routing and scaling, not
# admission): early in a burst of longer answers than the ones measured before it, a
# replica's measured drain has seen no finish yet and its expected wait runs at 4-5x the
# real one (37 s predicted for a ~3 s wait), so a 30-s limit refused part of a 16-request burst.
SLOW_SIM = {"simulate": True, "preset": "llama-3.1-8b", "hardware": "l4", "served_model_name": "sim",
            "kv_cache_memory": "1GiB", "max_num_seqs": 2, "no_warm_up": True, "replica_cpus": 0.5,
            "stats_period": 0.5, "max_queue_wait": 300, "queue_timeout": 300, "max_queue_len": 1000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ray() -> None:
    """A local cluster; started again once when Ray's fixed 30-s wait for its
    raylet runs out (a loaded machine), which is no kvserve failure."""
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def cluster():
    _start_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(seed=0).save_pretrained(folder, safe_serialization=True)
    byte_tokenizer()._backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return str(folder)


def _deploy(args: dict) -> None:
    serve.run(build_app(args), name=APP, route_prefix="/")


def _replica_counts() -> dict[str, int]:
    """The model deployment's replicas by state (STARTING, RUNNING, STOPPING, ...)."""
    deployment = serve.status().applications[APP].deployments[MODEL_DEPLOYMENT]
    return {state: n for state, n in deployment.replica_states.items() if n}


async def _burst(url: str, n: int, body: dict, gap_s: float = 0.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(gap_s * i)
            return await client.post("/v1/completions", json=body)
        return await asyncio.gather(*(one(i) for i in range(n)))


def _failures(responses: list[httpx.Response]) -> list[str]:
    return [f"{r.status_code}: {r.text[:300]}" for r in responses if r.status_code != 200]


def _ingress_counter(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    key = f'kvserve_ray_forwards_total{{outcome="{outcome}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def _replica_successes(url: str) -> dict[str, float]:
    """vllm:request_success_total on the ingress's /metrics, summed per replica label."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                totals[sample.labels["replica"]] += sample.value
    return dict(totals)


class _Stream:
    """One streamed completion, read on its own thread: the replica that
    answers, its SSE data lines, whether it ended; `leave()` closes it."""

    def __init__(self, url: str, body: dict) -> None:
        self.replica: str | None = None
        self.events: list[str] = []
        self.started, self.ended, self._leaving = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
                self.replica = response.headers.get("x-kvserve-replica")
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.started.set()
                    if self._leaving.is_set():
                        return
        finally:
            self.ended.set()
            self.started.set()

    def last_chunk(self) -> dict:
        return json.loads(self.events[-2][len("data: "):])

    def leave(self) -> None:
        self._leaving.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "a stream hung"


def _measure_drain(url: str, body: dict) -> None:
    """A few short requests first: a cold fleet's queue has an unbounded
    expected wait (no drain measured yet), which the ingress refuses."""
    assert [r.status_code for r in asyncio.run(_burst(url, 4, {**body, "max_tokens": 4}))] == [200] * 4
    time.sleep(1.5)  # a stats period or two: the views see the drain


def test_openai_client_and_router_spread_over_two_tiny_replicas(cluster, tiny_folder):
    _deploy({**TINY, "model": tiny_folder, "num_replicas": 2})
    try:
        client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
        again = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        assert again.choices[0].text == done.choices[0].text  # greedy, whichever replica answered
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 6
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with pytest.raises(openai.BadRequestError):  # the replica's own validation, relayed
            client.completions.create(model="tiny", prompt="hello", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="hello", max_tokens=4)

        # The three answered above, once the replicas' stats (a period old at most) show them.
        assert wait_until(lambda: sum(_replica_successes(cluster).values()) == 3, timeout_s=60, period_s=0.5), \
            _replica_successes(cluster)
        before = _replica_successes(cluster)
        responses = asyncio.run(_burst(cluster, 16, {"model": "tiny", "prompt": "spread me", "max_tokens": 48}))
        assert [r.status_code for r in responses] == [200] * 16, _failures(responses)
        per_replica = collections.Counter(r.headers["x-kvserve-replica"] for r in responses)
        assert len(per_replica) == 2 and min(per_replica.values()) >= 4, per_replica
        # The ingress's /metrics carries each replica's own vllm:* series, labelled by replica.
        def counted() -> dict[str, float]:  # what the replicas' latest stats (a period old at most) say
            after = _replica_successes(cluster)
            return {r: after[r] - before.get(r, 0.0) for r in after}
        assert wait_until(lambda: counted() == per_replica, timeout_s=60, period_s=0.5), (counted(), per_replica)
        text = httpx.get(f"{cluster}/metrics", timeout=60).text
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
                     "kvserve_ray_forwards_total"):
            assert f"# TYPE {name}" in text, name
    finally:
        serve.delete(APP)


def test_burst_scales_one_to_two_and_back_after_the_delay_losing_nothing_and_drains_the_one_removed(cluster):
    grace_s = 3.0
    _deploy({**SLOW_SIM, "min_replicas": 1, "max_replicas": 2, "queue_wait_target": 0.5, "look_back": 3,
             "scale_down_delay": 10, "shutdown_grace": grace_s})
    try:
        assert _replica_counts() == {"RUNNING": 1}
        body = {"model": "sim", "prompt": "queue up", "max_tokens": 20}
        _measure_drain(cluster, body)
        counts: list[dict] = []

        async def burst_while_watching() -> list[httpx.Response]:
            async def watch() -> None:
                while True:
                    counts.append(await asyncio.to_thread(_replica_counts))
                    await asyncio.sleep(0.5)
            watcher = asyncio.create_task(watch())
            try:
                # 32 requests, 2 slots: ~20 s of work on one replica; the queue builds at once.
                return await _burst(cluster, 32, body, gap_s=0.3)
            finally:
                watcher.cancel()

        responses = asyncio.run(burst_while_watching())
        assert [r.status_code for r in responses] == [200] * 32, _failures(responses)
        assert len({r.headers["x-request-id"] for r in responses}) == 32
        assert _ingress_counter(cluster, "answered") == 32 + 4  # each sent once: none lost, none twice
        assert _ingress_counter(cluster, "replica_gone") == 0
        assert max(sum(c.values()) for c in counts) == 2, counts  # the queue wait asked for a second
        assert wait_until(lambda: _replica_counts().get("RUNNING") == 2, timeout_s=120, period_s=0.5)
        # Calm from here (a stream holds one of a replica's two slots): one
        # replica leaves once the delay has passed (not before). A stream on
        # each, far longer than Ray's graceful timeout (~1500 steps of 0.07 s).
        streams: list[_Stream] = []
        for i in range(6):
            stream = _Stream(cluster, {"model": "sim", "prompt": f"a long story {i}", "max_tokens": 1500})
            assert stream.started.wait(60) and not stream.ended.is_set(), stream.events[-3:]
            if stream.replica in {s.replica for s in streams}:
                stream.leave()  # one each: two would fill a replica's batch, and a full batch is no calm
            else:
                streams.append(stream)
            if len(streams) == 2:
                break
            time.sleep(1.0)  # a stats period or two: the router sees it
        assert len(streams) == 2, [s.replica for s in streams]
        assert _replica_counts().get("RUNNING") == 2
        assert wait_until(lambda: _replica_counts() == {"RUNNING": 1}, timeout_s=120, period_s=0.5)

        # The removed replica is gone, so its stream has ended: at the grace, as
        # a drain ends it (not cut by Ray's kill); the other replica's runs on.
        assert wait_until(lambda: any(s.ended.is_set() for s in streams), timeout_s=30, period_s=0.2)
        (removed,) = [s for s in streams if s.ended.is_set()]
        (kept,) = [s for s in streams if not s.ended.is_set()]
        assert removed.events[-1] == "data: [DONE]", removed.events[-3:]
        assert "error" not in removed.last_chunk(), removed.last_chunk()
        assert removed.last_chunk()["choices"][0]["finish_reason"] == "abort", removed.last_chunk()
        assert 0 < len(removed.events) - 2 < 1500
        kept.leave()
        # Idle again (beside the 1500-token stream its own admission once answered this 429): it serves.
        after = httpx.post(f"{cluster}/v1/completions", json=body, timeout=120)
        assert after.status_code == 200, after.text[:300]
        assert after.headers["x-kvserve-replica"] == kept.replica
        for stream in streams:
            stream.leave()
    finally:
        serve.delete(APP)


def test_killed_replicas_waiting_requests_are_answered_by_another(cluster):
    _deploy({**SLOW_SIM, "num_replicas": 2, "router": "round-robin"})
    try:
        body = {"model": "sim", "prompt": "survive", "max_tokens": 20}
        _measure_drain(cluster, body)

        async def run() -> list[httpx.Response]:
            burst = asyncio.create_task(_burst(cluster, 12, body))
            await asyncio.sleep(2.0)  # both replicas hold 2 running and 4 waiting
            ray.kill(_model_replica_actors()[0], no_restart=True)
            return await burst

        responses = asyncio.run(run())
        assert [r.status_code for r in responses] == [200] * 12, _failures(responses)
        assert _ingress_counter(cluster, "replica_gone") >= 1  # its requests were sent again
        assert len({r.headers["x-request-id"] for r in responses}) == 12
    finally:
        serve.delete(APP)


def _model_replica_actors() -> list:
    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if MODEL_DEPLOYMENT in a["name"]]


def _ingress_gauge(url: str, name: str) -> float | None:
    lines = [line for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else None


def test_warm_pool_sleeps_an_idle_replica_and_wakes_it_for_a_burst(cluster):
    _deploy({**SLOW_SIM, "min_replicas": 2, "max_replicas": 2, "sleep_idle": True, "look_back": 3,
             "scale_down_delay": 2})
    try:
        body = {"model": "sim", "prompt": "wake up", "max_tokens": 20}
        # Both replicas finish requests first, so the ingress has measured
        # their drain: the replica left awake, facing the burst alone until
        # the sleeper wakes, would otherwise show a queue beyond one batch
        # with no measured drain, which the fleet's door refuses.
        for _ in range(3):  # until both have answered (the router may send a burst to one)
            _measure_drain(cluster, body)
            if len([n for n in _replica_successes(cluster).values() if n]) == 2:
                break
        assert wait_until(lambda: _ingress_gauge(cluster, "kvserve_ray_replicas_sleeping") == 1.0,
                          timeout_s=120, period_s=0.5), "an idle replica of the pool never went to sleep"
        assert _replica_counts() == {"RUNNING": 2}  # asleep, not gone

        responses = asyncio.run(_burst(cluster, 16, body, gap_s=0.2))
        assert [r.status_code for r in responses] == [200] * 16, _failures(responses)
        assert len({r.headers["x-kvserve-replica"] for r in responses}) == 2  # the sleeper woke and served
        assert _ingress_gauge(cluster, "kvserve_ray_replicas_awake_target") is not None
    finally:
        serve.delete(APP)
