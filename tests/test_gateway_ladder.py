"""The degradation ladder over simulated replicas (`kvserve serve
--simulate`): with the large pool saturated, `model: "auto"` requests go to
the small pool and say so; with both saturated they get 202 and a batch id
whose results arrive later and are correct; the batch survives a gateway
restart (kill -9)."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.fleet_helpers import gateway, simulated_backend, start_all
from tests.load_helpers import wait_until

MAX_TOKENS, CAP = 20, 8
# Slow replicas of two batch slots each: a 70B roofline on an L4 takes ~0.6 s
# a step (large), an 8B ~0.07 s (small); each step is a sleep.
LARGE = ("--preset", "llama-3.1-70b", "--hardware", "l4", "--served-model-name", "large")
SMALL = ("--preset", "llama-3.1-8b", "--hardware", "l4", "--served-model-name", "small")
COMMON = ("--kv-cache-memory", "1GiB", "--max-num-seqs", "2", "--no-warm-up", "--max-queue-wait", "0.5")


def ladder_config(large: str, small: str, state_dir: str) -> dict:
    return {"pools": [{"model": "large", "backends": [large], "smaller": "small"},
                      {"model": "small", "backends": [small]}],
            "aliases": {"auto": {"default": "large"}},
            "ladder": {"0": ["cap_max_tokens", "smaller_model", "deferred", "reject"], "max_tokens_cap": CAP},
            "scrape_interval_s": 0.25, "state_dir": state_dir}


async def _burst(url: str, n: int) -> list[httpx.Response]:
    body = {"model": "auto", "messages": [{"role": "user", "content": "tell me about the sea"}],
            "max_tokens": MAX_TOKENS}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(delay_s: float):
            await asyncio.sleep(delay_s)
            return await client.post("/v1/chat/completions", json=body)
        return await asyncio.gather(*(one(0.02 * i) for i in range(n)))


def test_ladder_small_pool_then_deferred_lane_surviving_a_restart(tmp_path):
    large, small = simulated_backend(None, *LARGE, *COMMON), simulated_backend(None, *SMALL, *COMMON)
    config = ladder_config(large.url, small.url, str(tmp_path / "state"))
    gw = gateway([], config=config, tmp_path=tmp_path)
    procs = start_all(large, small, gw)
    try:
        responses = asyncio.run(_burst(gw.url, 10))
        by_status = {}
        for r in responses:
            by_status.setdefault(r.status_code, []).append(r)
        assert set(by_status) <= {200, 202}, [(r.status_code, r.text) for r in responses]
        answered = by_status.get(200, [])
        on_large = [r for r in answered if r.json()["model"] == "large"]
        on_small = [r for r in answered if r.json()["model"] == "small"]
        assert on_large and on_small and len(on_large) + len(on_small) == len(answered)
        for r in on_large:  # not degraded: the whole answer, no header
            assert "x-kvserve-degraded" not in r.headers and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        for r in on_small:  # degraded: the header names every change, `model` the model that answered
            assert r.headers["x-kvserve-degraded"] == f"max_tokens={CAP}, model=small", r.headers
            assert r.json()["usage"]["completion_tokens"] == CAP
        deferred = by_status.get(202, [])
        assert deferred, "with both pools saturated some requests must go to the deferred lane"
        batches = [r.json() for r in deferred]
        assert all(b["object"] == "batch" and b["id"].startswith("batch_") for b in batches)
        assert all(r.headers["x-kvserve-degraded"] == f"deferred={b['id']}" for r, b in zip(deferred, batches))

        gw.kill9()  # accepted work must survive the gateway
        gw.start().wait_ready()
        for b in batches:
            again = httpx.get(f"{gw.url}/v1/batches/{b['id']}", timeout=10)
            assert again.status_code == 200 and again.json()["input_file_id"] == b["input_file_id"]

        def all_done() -> bool:
            return all(httpx.get(f"{gw.url}/v1/batches/{b['id']}", timeout=10).json()["status"] == "completed"
                       for b in batches)
        assert wait_until(all_done, 90, 0.5)
        for b in batches:
            done = httpx.get(f"{gw.url}/v1/batches/{b['id']}", timeout=10).json()
            assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
            output = httpx.get(f"{gw.url}/v1/files/{done['output_file_id']}/content", timeout=10).text
            line, = [json.loads(x) for x in output.splitlines()]
            assert line["custom_id"] == b["metadata"]["deferred_request"] and line["error"] is None
            assert line["response"]["status_code"] == 200
            answer = line["response"]["body"]
            assert answer["object"] == "chat.completion" and answer["model"] in ("large", "small")
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS and answer["choices"][0]["message"]["content"]
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'kvserve_gateway_batch_jobs{status="completed"} ' + f"{float(len(batches))}" in metrics
    finally:
        for p in procs:
            p.stop()
