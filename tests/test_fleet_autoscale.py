"""The autoscaling policy (fleet.autoscale.decide) on its own, and through
Ray Serve's custom-policy hook (kvserve.ray.autoscaling) with a fake
AutoscalingContext: it scales up on queue wait (not on CPU or on requests
alone), holds within the KV headroom, scales down only after the delay and
one replica at a time, wakes sleeping replicas before starting new ones,
and starts none while one is starting."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from kvserve.fleet.autoscale import (HOLD, QUEUE_WAIT, SCALE_DOWN, STARTING, AutoscaleConfig, QueueWaitWindow,
                                     ReplicaSignals, ScaleState, decide, desired_replicas)

CONFIG = AutoscaleConfig(min_replicas=1, max_replicas=4, queue_wait_target_s=0.5, kv_target=0.75,
                         scale_down_delay_s=30.0)
IDLE = ReplicaSignals()
QUEUED = ReplicaSignals(queue_wait_p95_s=1.2, kv_usage=0.3)


def test_queue_wait_over_target_scales_up_at_once():
    d = decide(CONFIG, [QUEUED], ScaleState(), now_s=0.0)
    assert (d.num_replicas, d.num_awake, d.reason) == (2, 2, QUEUE_WAIT)


def test_expected_wait_of_a_building_queue_scales_up_before_anyone_waited():
    building = ReplicaSignals(queue_wait_p95_s=0.0, expected_wait_s=math.inf)
    assert decide(CONFIG, [building], ScaleState(), 0.0).num_replicas == 2


def test_busy_but_within_targets_holds():
    # Full batches (what CPU or requests in flight would see) but no queue and KV inside the headroom.
    busy = ReplicaSignals(queue_wait_p95_s=0.1, expected_wait_s=0.0, kv_usage=0.7)
    d = decide(CONFIG, [busy, busy], ScaleState(), 0.0)
    assert (d.num_replicas, d.reason) == (2, HOLD)


def test_kv_usage_past_the_headroom_scales_up():
    full = ReplicaSignals(kv_usage=0.9)
    assert decide(CONFIG, [full, full], ScaleState(), 0.0).num_replicas == 3  # ceil(2 * 0.9 / 0.75)


def test_scale_up_is_bounded_by_max_replicas_and_doubling():
    swamped = ReplicaSignals(queue_wait_p95_s=50.0)
    assert decide(CONFIG, [swamped], ScaleState(), 0.0).num_replicas == 2  # at most 2x per decision
    assert decide(CONFIG, [swamped] * 3, ScaleState(), 0.0).num_replicas == 4  # max_replicas


def test_scale_down_only_after_the_delay_and_one_at_a_time():
    state = ScaleState()
    for now in (0.0, 10.0, 29.0):
        d = decide(CONFIG, [IDLE] * 3, state, now)
        assert d.num_replicas == 3
        state = d.state
    d = decide(CONFIG, [IDLE] * 3, state, 30.0)
    assert (d.num_replicas, d.reason) == (2, SCALE_DOWN)
    # The next step down waits the whole delay again.
    assert decide(CONFIG, [IDLE] * 2, d.state, 31.0).num_replicas == 2
    assert decide(CONFIG, [IDLE] * 2, d.state, 60.0).num_replicas == 1


def test_pressure_resets_the_delay():
    state = decide(CONFIG, [IDLE] * 2, ScaleState(), 0.0).state
    state = decide(CONFIG, [QUEUED, QUEUED], state, 20.0).state  # a burst in between
    assert decide(CONFIG, [IDLE] * 2, state, 35.0).num_replicas == 2  # 15 s of calm, not 35


def test_min_replicas_is_the_warm_pool():
    pool = AutoscaleConfig(min_replicas=3, max_replicas=4, scale_down_delay_s=0.0)
    d = decide(pool, [IDLE, ReplicaSignals(sleeping=True), ReplicaSignals(sleeping=True)], ScaleState(), 0.0)
    assert (d.num_replicas, d.num_awake) == (3, 1)  # held, one awake
    d = decide(pool, [IDLE] * 3, ScaleState(), 0.0)
    assert (d.num_replicas, d.num_awake) == (3, 2)  # a step down: one more may sleep, none leaves


def test_sleeping_replicas_wake_before_new_ones_start():
    pool = AutoscaleConfig(min_replicas=3, max_replicas=4)
    asleep = ReplicaSignals(sleeping=True)
    d = decide(pool, [QUEUED, asleep, asleep], ScaleState(), 0.0)
    assert (d.num_replicas, d.num_awake) == (3, 2)  # woken, nothing started


def test_no_new_replica_while_one_is_starting():
    d = decide(CONFIG, [QUEUED], ScaleState(), 0.0, num_starting=1)
    assert (d.num_replicas, d.reason) == (2, STARTING)


def test_gateway_gauge_is_the_policys_count():
    from kvserve.fleet.backend_state import BackendState

    assert desired_replicas([BackendState("a", kv_usage=0.9, num_kv_blocks=100, block_size=16)] * 4) == 5


def test_queue_wait_window_p95_forgets_past_the_look_back():
    window = QueueWaitWindow(look_back_s=10.0)
    for i in range(20):
        window.observe(float(i) * 0.1, 0.05 if i < 18 else 2.0)
    assert window.p95_s(2.0) == pytest.approx(2.0)  # the slowest 2 of 20 hold the 95th percentile
    assert window.p95_s(13.0) == 0.0


# ---- through Ray Serve's hook --------------------------------------------------------------

@dataclass
class _Sample:
    timestamp: float
    value: float


@dataclass
class FakeContext:
    """The AutoscalingContext fields the policy reads (ray.serve.config)."""

    running_replicas: list[str]
    raw_metrics: dict
    target_num_replicas: int
    current_num_replicas: int
    current_time: float
    policy_state: dict = field(default_factory=dict)
    deployment_name: str = "kvserve-model"
    # What a request-count policy would read; kvserve's ignores it.
    total_num_requests: float = 0.0


def _context(per_replica: dict[str, dict[str, float]], now: float, state: dict | None = None,
             target: int | None = None, cpu: float = 0.0) -> FakeContext:
    raw: dict = {}
    for replica, metrics in per_replica.items():
        for name, value in {**metrics, "cpu_percent": cpu}.items():
            raw.setdefault(name, {})[replica] = [_Sample(now - 1, 0.0), _Sample(now, value)]
    n = len(per_replica)
    return FakeContext(list(per_replica), raw, target or n, n, now, dict(state or {}),
                       total_num_requests=100.0 * n)


def test_ray_policy_scales_on_queue_wait_not_cpu():
    from kvserve.ray.autoscaling import KVServeAutoscalingPolicy

    policy = KVServeAutoscalingPolicy(min_replicas=1, max_replicas=4, scale_down_delay_s=30.0)
    hot_cpu = _context({"r1": {"queue_wait_p95_s": 0.05, "kv_usage": 0.2}}, now=100.0, cpu=100.0)
    assert policy(hot_cpu)[0] == 1
    queued = _context({"r1": {"queue_wait_p95_s": 1.5, "kv_usage": 0.2}}, now=100.0, cpu=5.0)
    assert policy(queued)[0] == 2


def test_ray_policy_scales_down_after_the_delay_from_its_state():
    from kvserve.ray.autoscaling import KVServeAutoscalingPolicy

    policy = KVServeAutoscalingPolicy(min_replicas=1, max_replicas=4, scale_down_delay_s=30.0)
    idle = {"r1": {"kv_usage": 0.0}, "r2": {"kv_usage": 0.0}}
    n, state = policy(_context(idle, now=100.0))
    assert n == 2 and state["calm_since_s"] == 100.0
    assert policy(_context(idle, now=120.0, state=state))[0] == 2
    assert policy(_context(idle, now=130.0, state=state))[0] == 1


def test_ray_policy_holds_while_a_replica_starts():
    from kvserve.ray.autoscaling import KVServeAutoscalingPolicy

    policy = KVServeAutoscalingPolicy(min_replicas=1, max_replicas=4)
    ctx = _context({"r1": {"queue_wait_p95_s": 3.0}}, now=5.0, target=2)  # 1 running, 2 targeted
    assert policy(ctx)[0] == 2


def test_the_simulator_and_ray_make_the_same_scaling_decisions():
    """One policy: each autoscaling check of a simulated fleet (a burst, then
    quiet) replayed through the Ray Serve hook gives the same answer."""
    import dataclasses

    from kvserve.bench.arrivals import arrival_offsets, parse_arrival
    from kvserve.bench.workload import generate_requests
    from kvserve.config import AdmissionConfig
    from kvserve.ray.autoscaling import KVServeAutoscalingPolicy
    from kvserve.sim.simulator import AutoscaleConfig as SimAutoscale
    from kvserve.sim.simulator import Simulator
    from tests.test_sim_simulator import COST, fixed_mix, replica_config

    rule = SimAutoscale(AutoscaleConfig(max_replicas=4, look_back_s=5.0, scale_down_delay_s=8.0),
                        interval_s=2.0, cold_start_s=6.0, warm_pool=1, warm_start_s=0.5)
    offsets = arrival_offsets(parse_arrival("step:rates=5/60/2,step=10"), None, 40.0, seed=3)
    specs = generate_requests(fixed_mix(200, 30), len(offsets), seed=3)
    result = Simulator(replica_config(AdmissionConfig(), autoscale=rule), COST).run(specs, offsets)
    policy = KVServeAutoscalingPolicy(**dataclasses.asdict(rule.policy(1)))
    reasons = set()
    for now, signals, num_starting, state, decision in result.scale_trace:
        per_replica = {f"r{i}": {k: float(v) for k, v in s._asdict().items()} for i, s in enumerate(signals)}
        ctx = _context(per_replica, now, {"calm_since_s": state.calm_since_s})
        ctx.target_num_replicas = len(signals) + num_starting
        num_replicas, ray_state = policy(ctx)
        assert (num_replicas, ray_state["num_awake"], ray_state["reason"]) == \
            (decision.num_replicas, decision.num_awake, decision.reason), now
        reasons.add(decision.reason)
    assert {QUEUE_WAIT, SCALE_DOWN} <= reasons or {"kv_usage", SCALE_DOWN} <= reasons, reasons
