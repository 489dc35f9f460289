"""The gateway's refusals against scripted backends (HTTP servers on
127.0.0.1 that export vLLM's metric names and answer as told): a backend's
429 is tried once on another backend within the retry budget, both full
gives a 429 with the soonest Retry-After, a spent budget passes no re-send,
and a fleet whose every backend is queued past the class's limit is refused
before any backend is asked, with a Retry-After from their measured drain.
The gateway is a real `kvserve gateway` process."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.fleet_helpers import backend_counter, gateway, start_all

MODEL = "scripted"


class ScriptedBackend:
    """A backend whose load and answers a test sets: `running`, `waiting`,
    `full_retry_after_s` (None: answer 200, else 429 with that Retry-After),
    `finishes_per_scrape` (its finished counter grows by this at each
    /metrics read, so the gateway measures a drain)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = self.waiting = 0
        self.full_retry_after_s: int | None = None
        self.finishes_per_scrape = 0
        self.exports_running_cap = True  # False: a backend without admission of its own (vLLM)
        self.finished = 0
        self.num_requests = 0
        app = FastAPI()
        app.get("/metrics")(self._metrics)
        app.get("/ready")(lambda: {"ready": True})
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        app.post("/v1/completions")(self._complete)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ScriptedBackend:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "scripted backend did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _metrics(self) -> PlainTextResponse:
        self.finished += self.finishes_per_scrape
        return PlainTextResponse(
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1\n'
            f'vllm:request_success_total{{model_name="{MODEL}"}} {self.finished}\n'
            + (f'kvserve_running_cap{{model_name="{MODEL}"}} 8\n' if self.exports_running_cap else '')
            + f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000"}} 1.0\n')

    async def _complete(self, request: Request) -> JSONResponse:
        await request.body()
        self.num_requests += 1
        if self.full_retry_after_s is not None:
            return JSONResponse({"error": {"message": "full", "type": "overloaded", "code": "kv_cache",
                                           "param": None}}, status_code=429,
                                headers={"Retry-After": str(self.full_retry_after_s)})
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": self.name, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture()
def backends():
    pair = [ScriptedBackend("a").start(), ScriptedBackend("b").start()]
    yield pair
    for b in pair:
        b.stop()


def _gateway(backends, tmp_path, admission: dict):
    config = {"admission": admission, "router": {"policy": "least-loaded"}, "scrape_interval_s": 0.2}
    gw = gateway([b.url for b in backends], "--state-dir", str(tmp_path / "state"), config=config,
                 tmp_path=tmp_path)
    return start_all(gw)[0]


def _complete(gw) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=30)


def test_a_backends_429_is_tried_on_another_then_the_soonest_retry_after(backends, tmp_path):
    first, second = backends
    gw = _gateway(backends, tmp_path, {"retry_budget": 0.1, "retry_budget_burst": 2})
    try:
        first.full_retry_after_s = 7  # equal loads: least-loaded asks the first
        response = _complete(gw)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "b", response.text
        assert (first.num_requests, second.num_requests) == (1, 1)
        assert backend_counter(gw.url, 'kvserve_gateway_retries_total{pool="scripted",reason="backend_full"') == 1
        second.full_retry_after_s = 3
        response = _complete(gw)  # both full: the client gets the sooner of their Retry-Afters
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"]["code"] == "kv_cache"
        assert (first.num_requests, second.num_requests) == (2, 2)  # one re-send, no more
        # The burst of two is spent: the next full backend's 429 comes back without a re-send.
        response = _complete(gw)
        assert response.status_code == 429 and (first.num_requests, second.num_requests) == (3, 2)
        assert int(response.headers["retry-after"]) >= 1
    finally:
        gw.stop()


def test_a_fleet_queued_past_the_limit_is_refused_before_any_backend(backends, tmp_path):
    first, second = backends
    for backend, waiting in ((first, 200), (second, 16)):
        backend.running, backend.waiting, backend.finishes_per_scrape = 8, waiting, 2
    gw = _gateway(backends, tmp_path, {"max_queue_wait_s": 1.0})
    try:
        time.sleep(2.0)  # scrapes measure the drain: ~2 finishes per 0.2 s, about 10 per second
        response = _complete(gw)
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert error["code"] == "batch_slots" and error["type"] == "overloaded"
        assert "expected wait for a batch slot across 2 backends" in error["message"]
        # The second backend's wait (17 ahead at ~10/s) sets it, not the first's (~20 s).
        assert 1 <= int(response.headers["retry-after"]) <= 6, response.headers
        assert (first.num_requests, second.num_requests) == (0, 0)
        assert backend_counter(gw.url, 'kvserve_gateway_admission_decisions_total{outcome="reject",pool="scripted",'
                                       'reason="batch_slots"') == 1
        second.waiting = 0  # room again: admitted
        time.sleep(0.6)
        assert _complete(gw).status_code == 200
    finally:
        gw.stop()


def test_a_fresh_fleet_queued_past_one_batch_is_left_to_kvserve_backends_own_admission(backends, tmp_path):
    # Nothing has finished yet, so the door has no measured drain. A kvserve
    # backend (it exports kvserve_running_cap) admits on its own, from the
    # step times its warm-up measured: the door forwards and the backend
    # answers (here 200). A backend with no admission of its own (vLLM) gets
    # the door's cold rule: refused beyond one batch worth of queue.
    first, second = backends
    for backend in backends:
        backend.running, backend.waiting = 8, 16
    gw = _gateway(backends, tmp_path, {"max_queue_wait_s": 1.0})
    try:
        time.sleep(0.6)  # scraped: 16 waiting beyond a full batch of 8, no finishes
        response = _complete(gw)
        assert response.status_code == 200, response.text
        assert first.num_requests + second.num_requests == 1
        for backend in backends:
            backend.exports_running_cap = False
        time.sleep(0.6)
        response = _complete(gw)
        assert response.status_code == 429, response.text
        assert "unbounded (no measured drain)" in response.json()["error"]["message"]
        assert first.num_requests + second.num_requests == 1
    finally:
        gw.stop()
