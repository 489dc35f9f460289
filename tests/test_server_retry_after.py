"""Retry-After a client can follow, on a live server whose steps are slowed
to a known time: clients that sleep exactly the advised seconds and retry
are all served without a retry storm, and the server stays busy."""

from __future__ import annotations

import asyncio
import time

from tests.load_helpers import body, run_clients, stream_one
from tests.server_helpers import live_server, slow_steps, tiny_core

STEP_DELAY_S = 0.05


def record_steps(core) -> list[tuple[float, float]]:
    """(start, end) of every engine step of `core` from now on."""
    spans: list[tuple[float, float]] = []
    step = core.step

    def timed_step():
        started = time.monotonic()
        try:
            return step()
        finally:
            spans.append((started, time.monotonic()))
    core.step = timed_step
    return spans


async def follow_retry_after(client, payload: dict) -> int:
    """Send until served, sleeping exactly the advised Retry-After after each
    429; returns how many refusals it took."""
    refusals = 0
    while True:
        out = await stream_one(client, payload)
        if out.status == 200:
            assert out.finish_reason == "length", out
            return refusals
        assert out.status == 429 and out.retry_after is not None, (out.status, out.error)
        refusals += 1
        await asyncio.sleep(int(out.retry_after))


def test_clients_that_follow_retry_after_are_all_served_without_a_storm():
    num_clients = 16
    core = slow_steps(tiny_core(num_blocks=64, max_num_seqs=2), STEP_DELAY_S)
    spans = record_steps(core)
    # Two at a time, ~1.1 s each: a burst of 16 is ~9 s of work, and a
    # client may wait at most 1 s in the queue.
    with live_server(core, max_queue_wait_s=1.0, ttft_slo_s=2.0, tpot_slo_s=1.0) as srv:
        started = time.monotonic()
        refusals = run_clients(srv.base_url, lambda c: [follow_retry_after(c, body(max_tokens=20))
                                                        for _ in range(num_clients)], timeout_s=120)
        ended = time.monotonic()
    busy_s = sum(min(end, ended) - max(start, started) for start, end in spans if end > started)
    assert sum(refusals) <= 2 * num_clients, refusals
    # Quiet, the engine is busy 92-95% of the burst; a shared CI box measured
    # 76%. One Retry-After for everyone (the storm this guards against)
    # left it idle about half the time.
    assert busy_s >= 0.7 * (ended - started), (busy_s, ended - started, refusals)
