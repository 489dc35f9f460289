"""`kill -9` of a backend mid-run: requests not yet streaming finish on the
other backend, streams under way end with a clean error event, nothing
hangs, the dead backend is ejected, and it gets traffic again once back."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.fleet_helpers import backend_counter, gateway, start_all, tiny_backend
from tests.load_helpers import wait_until
from tests.server_helpers import MODEL_NAME

# 30 ms per engine step: a 150-token request lasts ~5 s, so it is mid-way at the kill.
# A generous queue-wait limit: the backends admit everything sent here (a backend's own
# refusal of a cold burst is not what this test is about; test_gateway_refusals.py is).
BACKEND_FLAGS = ("--no-warm-up", "--step-delay", "0.03", "--max-queue-wait", "30")
FAST_HEALTH = {"scrape_interval_s": 0.25, "stale_after_s": 2.0, "breaker": {"failures": 2, "cool_down_s": 1.0},
               "router": {"policy": "round-robin"}}


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> dict:
    body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 150, "stream": True}
    out = {"finish": None, "error": None, "chunks": 0}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        out["status"], out["backend"] = response.status_code, response.headers.get("x-kvserve-backend")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
            elif event["choices"]:
                out["chunks"] += 1
                out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
                started.set()
    return out


async def _complete(client: httpx.AsyncClient, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "not streamed", "max_tokens": max_tokens}
    return await client.post("/v1/completions", json=body)


def test_kill_9_mid_run(tmp_path):
    a, b = tiny_backend(None, *BACKEND_FLAGS), tiny_backend(None, *BACKEND_FLAGS)
    gw = gateway([a.url, b.url], "--state-dir", str(tmp_path / "state"), config=FAST_HEALTH, tmp_path=tmp_path)
    procs = start_all(a, b, gw)
    try:
        ejections = f'kvserve_gateway_backend_ejections_total{{backend="{a.url}"}}'
        ejected_before = backend_counter(gw.url, ejections)  # start-up scrapes may have failed too
        results = asyncio.run(_mid_run(gw.url, a))
        streams, long_ones, after_kill = results
        on_a = [s for s in streams if s["backend"] == a.url]
        on_b = [s for s in streams if s["backend"] == b.url]
        assert len(on_a) == len(on_b) == 2, streams  # round-robin put two on each
        for s in on_a:  # broken streams end cleanly and say so
            assert s["status"] == 200 and s["finish"] == "error" and s["error"]["code"] == "backend_failed", s
            assert 0 < s["chunks"] < 150
        assert all(s["finish"] == "length" and s["error"] is None for s in on_b), on_b
        # Not streaming when the backend died (mid-generation or sent after): answered by the other one.
        for response in long_ones + after_kill:
            assert response.status_code == 200, response.text
            assert response.headers["x-kvserve-backend"] == b.url
        assert backend_counter(gw.url, ejections) == ejected_before + 1
        assert backend_counter(gw.url, f'kvserve_gateway_breaker_state{{backend="{a.url}",state="closed"}}') == 0
        # Back on the same port: probed after the cool-down, then routed to again.
        a.start().wait_ready()
        before = backend_counter(a.url, "vllm:request_success_total")

        def served_again() -> bool:
            response = httpx.post(gw.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                                    "max_tokens": 2}, timeout=30)
            return response.status_code == 200 and response.headers["x-kvserve-backend"] == a.url
        assert wait_until(served_again, 20, 0.2)
        assert backend_counter(a.url, "vllm:request_success_total") > before
    finally:
        for p in procs:
            p.stop()


async def _mid_run(url: str, victim):
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60)) as client:
        started = [asyncio.Event() for _ in range(4)]
        streams, long_ones = [], []
        for i in range(4):  # round-robin: streams alternate a, b, a, b, then the long ones a, b
            streams.append(asyncio.create_task(_stream(client, started[i])))
            await asyncio.sleep(0.05)
        long_ones = [asyncio.create_task(_complete(client, 120)) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        await asyncio.sleep(0.3)
        victim.kill9()
        after_kill = [await _complete(client, 4) for _ in range(4)]  # before the breaker opens, some go to a
        done = await asyncio.wait_for(asyncio.gather(*streams, *long_ones), 30)  # nothing hangs
        return done[:4], done[4:], after_kill
