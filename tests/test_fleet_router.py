"""The fleet's routing policy (kvserve.fleet.router) on hand-made backend
states, and the simulator driving it exactly (fast forward on and off)."""

from __future__ import annotations

import collections
import math

import pytest

from kvserve.config import AdmissionConfig
from kvserve.fleet.backend_state import BackendState, DrainMeter, expected_wait_s
from kvserve.fleet.router import (AFFINE, AFFINE_OVERFLOW, KV_FIT, KV_SHORT, HashRing, RouteRequest, Router,
                                  RouterConfig, affinity_key)
from tests.test_sim_fast_forward import SHARING, _compare, _config, _workload


def router(policy: str, **fields) -> Router:
    return Router(RouterConfig(policy=policy, **fields))


def idle(name: str, **fields) -> BackendState:
    return BackendState(name, **{"num_kv_blocks": 100, "block_size": 16, "running_cap": 8,
                                 "drain_rps": 2.0, **fields})


def test_round_robin_takes_turns_and_least_loaded_counts_running_plus_waiting():
    states = [idle("a"), idle("b"), idle("c")]
    rr = router("round-robin")
    assert [rr.pick(states, RouteRequest()).position for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    loaded = [idle("a", num_running=3), idle("b", num_running=1, num_waiting=1), idle("c", num_running=2, num_waiting=1)]
    assert router("least-loaded").pick(loaded, RouteRequest()).position == 1
    assert router("least-queue").pick(loaded, RouteRequest()).position == 1  # the simulator's old name


def test_kv_aware_prefers_where_the_projected_blocks_fit_with_most_headroom():
    # 40 free blocks vs 60 free; request of 800 tokens = 50 blocks fits only on b.
    a, b = idle("a", kv_usage=0.6), idle("b", kv_usage=0.4)
    kv = router("kv-aware")
    assert kv.pick([a, b], RouteRequest(700, 100)) == (1, KV_FIT)
    # Both fit a small request: the most headroom left wins.
    assert kv.pick([b, a], RouteRequest(10, 6)).position == 0
    # A shorter expected wait comes first: b is queueing behind its cap.
    b_queued = idle("b", kv_usage=0.1, num_running=8, num_waiting=4)
    assert kv.pick([a, b_queued], RouteRequest(10, 6)).position == 0
    # Fits nowhere: the one whose missing blocks drain soonest.
    full_a, full_b = idle("a", kv_usage=0.99, num_running=2), idle("b", kv_usage=0.95, num_running=2)
    assert kv.pick([full_a, full_b], RouteRequest(700, 100)) == (1, KV_SHORT)


def test_prefix_affinity_keeps_a_key_on_one_backend_and_tenants_apart():
    states = [idle(f"b{i}") for i in range(4)]
    pa = router("prefix-affinity")
    key = affinity_key("alice", "base", b"You are a helpful assistant." * 8)
    picks = {pa.pick(states, RouteRequest(100, 10, key)).position for _ in range(20)}
    assert len(picks) == 1
    # Same prefix, another tenant: another key (and, over many prefixes, other backends).
    assert affinity_key("bob", "base", b"You are a helpful assistant." * 8) != key
    assert affinity_key("al", "base", b"ice" + b"x") != affinity_key("alice", "base", b"x")  # no ambiguity at the seam
    assert affinity_key("t", "ab", b"x") != affinity_key("ta", "b", b"x")  # nor between tenant and model
    keys = [affinity_key("t", "base", f"p{i}".encode()) for i in range(400)]
    spread = collections.Counter(pa.pick(states, RouteRequest(100, 10, k)).position for k in keys)
    assert len(spread) == 4 and min(spread.values()) > 40, spread


def test_prefix_affinity_keys_one_prefix_under_each_adapter_apart():
    # A LoRA adapter changes every layer's KV: the same text under two adapters shares no cached block.
    prefix = b"You are a helpful assistant." * 8
    states = [idle("b0"), idle("b1")]
    pa = router("prefix-affinity")
    sql = [pa.pick(states, RouteRequest(100, 10, affinity_key("alice", "sql", prefix))).position for _ in range(5)]
    assert len(set(sql)) == 1  # one adapter, one prefix: one backend
    chat_key = affinity_key("alice", "chat", prefix)
    assert chat_key not in {affinity_key("alice", "sql", prefix), affinity_key("alice", "base", prefix)}
    # A key of its own, placed where fewer keys are: the other backend, not beside sql's cache.
    assert pa.pick(states, RouteRequest(100, 10, chat_key)).position != sql[0]
    assert pa.placements.num_keys("b0") == pa.placements.num_keys("b1") == 1


def test_prefix_affinity_is_bounded_by_load():
    pa = router("prefix-affinity", affinity_slack_s=1.0)
    key = affinity_key("alice", "base", b"shared system prompt")
    states = [idle(f"b{i}") for i in range(3)]
    home = pa.pick(states, RouteRequest(100, 10, key)).position
    # The affine backend queues 4 requests beyond its cap at 2 per second:
    # 2.5 s of expected wait against 0 elsewhere, over the 1 s slack.
    busy = list(states)
    busy[home] = idle(states[home].name, num_running=8, num_waiting=4)
    assert expected_wait_s(busy[home]) == pytest.approx(2.5)
    moved = pa.pick(busy, RouteRequest(100, 10, key))
    assert moved.index != home and moved.reason == AFFINE_OVERFLOW
    # Within the slack (one request ahead: 0.5 s) and the load bound it stays.
    even = [idle(s.name, num_running=7) for s in states]
    even[home] = idle(states[home].name, num_running=8)
    assert pa.pick(even, RouteRequest(100, 10, key)) == (home, AFFINE)
    # A hot prefix: no wait anywhere (batch slots free), but the affine
    # backend holds far more than its share (8 of 10 against a bound of
    # 2 x 11 / 3 + 1): the next backend on the ring takes it.
    hot = [idle(s.name, num_running=1, running_cap=64) for s in states]
    hot[home] = idle(states[home].name, num_running=8, running_cap=64)
    moved = pa.pick(hot, RouteRequest(100, 10, key))
    assert moved.position != home and moved.reason == AFFINE_OVERFLOW


def test_prefix_affinity_places_new_keys_evenly_and_keeps_them():
    # 8 hot prefixes over 4 backends: a hash ring alone often puts 3-5 on
    # one backend (whose cache then thrashes); placement gives each two.
    pa = router("prefix-affinity")
    states = [idle(f"b{i}") for i in range(4)]
    keys = [affinity_key("t", "base", f"system prompt {i}".encode()) for i in range(8)]
    homes = [pa.pick(states, RouteRequest(100, 10, k)) for k in keys]
    assert all(d.reason == AFFINE for d in homes)
    assert sorted(collections.Counter(d.position for d in homes).values()) == [2, 2, 2, 2]
    # A key stays where it was placed when another backend gets less loaded.
    busier = [idle(s.name, num_running=2) for s in states]
    for key, home in zip(keys, homes):
        busier[home.position] = idle(states[home.position].name, num_running=3)
        assert pa.pick(busier, RouteRequest(100, 10, key)) == (home.position, AFFINE)
        busier[home.position] = idle(states[home.position].name, num_running=2)
    # Its backend gone, a key is placed again (on the least loaded) and stays there.
    gone = homes[0].position
    left = [s for i, s in enumerate(states) if i != gone]
    moved = pa.pick(left, RouteRequest(100, 10, keys[0]))
    assert moved.reason == AFFINE
    assert pa.pick(states, RouteRequest(100, 10, keys[0])).position == states.index(left[moved.position])


def test_prefix_affinity_forgets_the_least_recently_used_placement():
    pa = router("prefix-affinity", affinity_max_keys=2)
    states = [idle("a"), idle("b", num_running=1)]
    first, second, third = (affinity_key("t", "base", name.encode()) for name in ("x", "y", "z"))
    assert pa.pick(states, RouteRequest(100, 10, first)).position == 0
    assert pa.pick(states, RouteRequest(100, 10, second)).position == 0  # a is still the least loaded
    pa.pick(states, RouteRequest(100, 10, first))  # first is used again: second is the oldest
    pa.pick(states, RouteRequest(100, 10, third))
    assert pa.placements.owner(second) is None and pa.placements.owner(first) == "a"
    assert pa.placements.num_keys("a") == 2


def test_hash_ring_moves_only_the_keys_of_a_removed_backend():
    names = [f"b{i}" for i in range(5)]
    full, less = HashRing(names, 64), HashRing(names[:-1], 64)
    keys = [affinity_key("t", "base", f"{i}".encode()) for i in range(500)]
    moved = [k for k in keys if full.walk(k)[0] != less.walk(k)[0]]
    assert moved and all(full.walk(k)[0] == "b4" for k in moved)
    assert all(sorted(full.walk(k)) == sorted(names) for k in keys[:20])


def test_expected_wait_counts_batch_slots_and_missing_kv():
    assert expected_wait_s(idle("a", num_running=3)) == 0.0
    assert expected_wait_s(idle("a", num_running=8, num_waiting=1)) == pytest.approx(1.0)  # 2 ahead at 2/s
    # Unknown cap (vLLM): any queue means full; unknown drain: one batch of queue allowed.
    vllm = BackendState("v", num_running=4, num_waiting=2)
    assert expected_wait_s(vllm) == 0.0
    assert math.isinf(expected_wait_s(BackendState("v", num_running=4, num_waiting=6)))
    # KV: 10 free blocks, the request needs 30; 90 used by 3 running (30 each): one must finish.
    short = idle("a", kv_usage=0.9, num_running=3)
    assert expected_wait_s(short, 30 * 16) == pytest.approx(0.5)
    assert math.isinf(expected_wait_s(short, 101 * 16))  # never fits


def test_drain_meter_counts_finishes_per_busy_second():
    meter = DrainMeter(window_s=10.0)
    assert meter.rate_rps(0.0) is None
    meter.observe(0.0, 0, busy=True)
    for t in range(1, 21):
        meter.observe(float(t), 3 * t, busy=True)
    assert meter.rate_rps(20.0) == pytest.approx(3.0, rel=0.1)  # counted at each interval's end
    meter.observe(21.0, 63, busy=False)
    meter.observe(600.0, 63, busy=False)  # idle: no decay
    assert meter.rate_rps(600.0) == pytest.approx(meter.rate_rps(21.0))


@pytest.mark.parametrize("policy", ["kv-aware", "prefix-affinity"])
def test_simulator_routes_exactly_with_policies_that_read_kv(policy):
    specs = _workload(200, seed=4, **SHARING)
    offsets = [i * 0.01 for i in range(len(specs))]
    fast, slow, _ = _compare(_config(AdmissionConfig(max_queue_wait_s=0.5), num_blocks=150, num_replicas=3,
                                     router=policy), specs, offsets)
    assert fast.route_trace == slow.route_trace
    assert len({d.position for _, _, d in fast.route_trace}) == 3
