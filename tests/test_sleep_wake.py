"""Sleep and wake with vLLM's endpoint names on a live server (tiny model):
`POST /sleep?level=1` releases the KV cache tensor's memory (measured: the
process's resident memory drops by the cache's size), requests get 503
"sleeping", /ready says so and `kvserve_sleeping` shows the level; the
prefix cache is empty after `POST /wake_up`, and greedy output equals the
output before. Level 2 drops the weights too and reads them again."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest

from tests.load_helpers import wait_until
from tests.server_helpers import KV_BYTES_PER_TOKEN, live_server, tiny_core
from tests.tiny_models import tiny_llama, weights_of

KV_MIB = 192
PROMPT = "a prompt long enough to fill two blocks of the prefix cache, and then some more"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _complete(client: httpx.Client) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(client: httpx.Client, name: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name)]
    return float(lines[0].split()[-1])


def test_sleep_frees_the_kv_cache_refuses_and_wakes_to_the_same_output():
    num_blocks = KV_MIB * 2**20 // (16 * KV_BYTES_PER_TOKEN)
    core = tiny_core(num_blocks=num_blocks)
    core.runner.kv_cache.fill_(0.0)  # every page resident, so the release shows in RSS
    with live_server(core) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = _complete(client)
        assert _complete(client)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache works

        rss_awake = _rss_bytes()
        kv_tensor = weakref.ref(core.runner.kv_cache)
        asleep = client.post("/sleep", params={"level": 1})
        assert asleep.status_code == 200 and asleep.json()["freed_bytes"] >= KV_MIB * 2**20
        gc.collect()
        assert kv_tensor() is None  # nothing holds the old cache tensor
        # The memory went back to the system (polled: another thread's
        # allocations in the moment can hide part of the drop on a busy box).
        assert wait_until(lambda: rss_awake - _rss_bytes() >= 0.8 * KV_MIB * 2**20, 5), \
            (rss_awake - _rss_bytes()) / 2**20
        assert client.get("/is_sleeping").json() == {"is_sleeping": True, "level": 1}
        refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "sleeping"
        ready = client.get("/ready")
        assert ready.status_code == 503 and "asleep" in ready.json()["error"]["message"]
        assert _metric(client, "kvserve_sleeping") == 1.0

        woke = client.post("/wake_up")
        assert woke.status_code == 200 and woke.json()["wake_up_s"] > 0
        assert client.get("/ready").status_code == 200 and _metric(client, "kvserve_sleeping") == 0.0
        assert 'kvserve_startup_seconds{model_name="tiny",phase="wake_up"}' in client.get("/metrics").text
        after = _complete(client)
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # emptied on sleep
        assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_level_two_drops_the_weights_and_reads_them_again():
    core = tiny_core()
    with live_server(core) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        server.serving.reload_weights = lambda: weights_of(tiny_llama(seed=0))
        before = _complete(client)
        assert client.post("/sleep", params={"level": 2}).status_code == 200
        assert core.runner is None  # the model and its cache are gone
        assert client.post("/wake_up").status_code == 200
        assert _complete(client)["choices"][0]["text"] == before["choices"][0]["text"]


@pytest.mark.parametrize("level", [0, 3])
def test_a_bad_level_is_a_400(level):
    with live_server(tiny_core()) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post("/sleep", params={"level": level})
        assert r.status_code == 400 and r.json()["error"]["param"] == "level"
        assert client.get("/is_sleeping").json()["is_sleeping"] is False


def test_sleep_if_idle_refuses_while_a_request_is_in_flight():
    import threading

    from tests.server_helpers import slow_steps

    with live_server(slow_steps(tiny_core(), 0.05)) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 40}
        long_one = threading.Thread(target=lambda: client.post("/v1/completions", json=body))
        long_one.start()
        try:
            while server.serving.engine.num_streams == 0:
                pass
            busy = client.post("/sleep", params={"level": 1, "if_idle": "true"})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy"
            assert client.get("/is_sleeping").json()["is_sleeping"] is False
        finally:
            long_one.join()
        assert client.post("/sleep", params={"level": 1, "if_idle": "true"}).status_code == 200


def test_the_cuda_offload_walk_reaches_every_weight_tensor():
    # On CUDA a level-1 sleep moves what this walk finds to pinned host
    # memory: a weight it misses would stay on the device (the linears live
    # inside weight objects, not as the layers' own tensors).
    from kvserve.runner.model_runner import _tensor_attributes

    model = tiny_core().runner.model
    reached = {id(tensor) for _, _, tensor in _tensor_attributes(model)}
    weights = [getattr(w, "weight_t", getattr(w, "packed", w)) for w in model._weights()]
    assert len(weights) > 10 and all(id(w) in reached for w in weights)
