"""Admission on a live server: the decision and its prefix-hit lookup are made
on the engine thread, which alone touches the KV cache."""

from __future__ import annotations

import threading

import httpx

from tests.server_helpers import MODEL_NAME, live_server, tiny_core


def test_the_prefix_hit_admission_projects_is_looked_up_on_the_engine_thread():
    # 8 blocks of 16 tokens. A 100-token prompt with max_tokens 40 needs 9
    # blocks, more than the whole cache, unless admission counts the 96 of
    # its tokens already cached by the first request: then 3 blocks.
    core = tiny_core(num_blocks=8, block_size=16)
    threads: list[str] = []
    lookup = core.prefix_hit_tokens

    def recorded_lookup(request):
        threads.append(threading.current_thread().name)
        return lookup(request)

    core.prefix_hit_tokens = recorded_lookup
    prompt = list(range(1, 101))
    with live_server(core, max_queue_wait_s=30) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
        first = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20})
        assert first.status_code == 200, first.json()
        second = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40})
        assert second.status_code == 200, second.json()
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        never = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [7] * 100, "max_tokens": 40})
        assert (never.status_code, never.json()["error"]["code"]) == (400, "never_fits")
    assert threads == ["kvserve-engine"] * 3
