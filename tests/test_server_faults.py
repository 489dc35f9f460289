"""Faults: an exception inside an engine step fails the requests the engine
had with a clean error (an error event in a started stream, a 503 before
headers), the server turns unhealthy and not ready, and no request is left
hanging; a client abort racing a request's finish frees its KV once."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.contract import SamplingParams
from tests.load_helpers import body
from tests.server_helpers import live_server, slow_steps, tiny_core


def failing_steps(core):
    """`core.step` raises once `arm` is set (the warm-up's steps run first)."""
    arm = threading.Event()
    step = core.step

    def maybe_failing_step():
        if arm.is_set():
            raise RuntimeError("injected fault in the step")
        return step()
    core.step = maybe_failing_step
    return arm


def test_a_failing_step_ends_every_request_with_a_clean_error_and_the_server_unhealthy():
    core = slow_steps(tiny_core(max_num_seqs=2), 0.02)
    arm = failing_steps(core)
    with live_server(core, max_queue_wait_s=60.0) as srv:
        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=body(max_tokens=300)) as streamed:
                    assert streamed.status_code == 200
                    lines = streamed.aiter_lines()
                    first = await anext(lines)  # the first event: the request runs
                    plain = asyncio.ensure_future(client.post("/v1/completions",
                                                              json=body(max_tokens=300, stream=False)))
                    # The second of two slots taken before the third request comes, so it waits (sent
                    # together, the short one could take the slot, finish and leave before the fault).
                    for _ in range(500):
                        if core.num_running == 2:
                            break
                        await asyncio.sleep(0.01)
                    queued = asyncio.ensure_future(client.post("/v1/completions", json=body(max_tokens=5)))
                    await asyncio.sleep(0.3)  # it reaches the engine and waits for a slot
                    assert core.num_running == 2
                    arm.set()
                    rest = [line async for line in lines]
                events = [first, *rest]
                return events, await plain, await queued, await client.get("/health"), \
                    await client.get("/ready"), await client.post("/v1/completions", json=body(max_tokens=5))

        events, plain, queued, health, ready, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    data = [line[6:] for line in events if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    error = json.loads(data[-2])["error"]
    assert error["code"] == "engine_dead" and "injected fault" in error["message"], error
    for response in (plain, queued):
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", response.text
    assert health.status_code == 503 and ready.status_code == 503
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


@settings(max_examples=40, deadline=None)
@given(max_tokens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       abort_steps=st.lists(st.integers(0, 16), min_size=4, max_size=4))
def test_an_abort_racing_a_finish_frees_kv_exactly_once(max_tokens, abort_steps):
    core = _core()
    kv = core.scheduler.kv_cache
    pool_free = kv.num_free_blocks
    frees: dict[str, int] | None = {}
    free = kv.free

    def counted_free(request):
        frees[request.request_id] = frees.get(request.request_id, 0) + 1
        return free(request)
    try:
        kv.free = counted_free
    except AttributeError:  # the compiled core's classes take no instance patches:
        frees = None  # a double free still shows as more free blocks than the pool has (below)
    ids = []
    for i, n in enumerate(max_tokens):
        request = core.new_request([1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=n, temperature=0.0,
                                                                      ignore_eos=True))
        core.add_request(request)
        ids.append(request.request_id)
    finished: set[str] = set()
    for step in range(18):
        for rid, at in zip(ids, abort_steps):
            if at == step:  # before, during or after its finish: each is allowed
                output = core.abort(rid)
                assert (output is None) == (rid in finished), (rid, step)
                finished.add(rid)
                assert core.abort(rid) is None  # a second abort finds nothing to free
        if core.has_unfinished():
            finished.update(o.request_id for o in core.step().outputs if o.finished)
        kv.check_integrity()
    assert not core.has_unfinished()
    if frees is not None:
        del kv.free
        assert frees == {rid: 1 for rid in ids}, frees  # freed once, whichever came first
    assert kv.num_free_blocks == pool_free and kv.usage() == 0.0  # every block back


_CORE = None


def _core():
    """One tiny engine for every example (building it is the slow part);
    each example starts from an empty cache."""
    global _CORE
    if _CORE is None:
        _CORE = tiny_core(num_blocks=16, max_num_seqs=4)
    _CORE.reset_prefix_cache()
    return _CORE
