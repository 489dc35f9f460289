"""The fleet's autoscaling policy, once: how many replicas to hold and how
many of them to keep awake, from the signals the source texts name: queue
wait as the demand signal and KV usage as the ceiling, never CPU or
requests per second.

`decide` is the one rule. The Ray Serve application calls it from its
custom autoscaling policy (kvserve.ray.autoscaling) on the stats each
replica records; `kvserve simulate --autoscale` calls it on its simulated
replicas; the gateway's desired-replicas gauge is its stateless scale-up
count (`desired_replicas`).

The rule, HPA-style over the awake replicas:
- demand: each replica's queue wait is the larger of its p95 over the
  look-back (what it observed) and the expected wait of a request arriving
  now (what it is about to observe: a burst shows before anyone finishes
  waiting); ratio = max(mean queue wait / queue_wait_target_s,
  mean KV usage / kv_target);
- target = ceil(n_awake * ratio), at least 1;
- above n_awake: scale up at once, by at least one and at most
  max_scale_up_factor x; sleeping replicas are woken before any new one is
  started (a wake takes a fraction of a second, a cold start minutes), and
  no new replica is asked for while one is still starting (piling more on
  does not make it faster);
- below n_awake: only after it has stayed below for scale_down_delay_s, and
  then by one replica (each further step waits the delay again); the
  replica leaves by draining (it stops admitting, finishes what it has);
- min_replicas is the warm pool: that many replicas are always held, awake
  or asleep.

Pure Python, clock injected (times are arguments).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvserve.fleet.backend_state import BackendLoad, expected_wait_s

KV_TARGET = 0.75  # the KV headroom target: scale out above three quarters full
QUEUE_WAIT_TARGET_S = 0.5

# Why a decision came out as it did (logs, the policy state Ray keeps).
QUEUE_WAIT = "queue_wait"
KV_USAGE = "kv_usage"
STARTING = "starting"  # wanted more, but one is still starting
HOLD = "hold"
CALM = "calm"  # below target, waiting out the delay
SCALE_DOWN = "scale_down"


@dataclass(frozen=True)
class AutoscaleConfig:
    """min_replicas: the warm pool (always held; replicas not needed awake
    sleep where sleeping is on). queue_wait_target_s: the p95 queue wait to
    hold. kv_target: the KV usage to stay under (the headroom target).
    look_back_s: the window of the queue-wait p95 (seconds).
    scale_down_delay_s: how long the fleet must look over-provisioned
    before one replica leaves (seconds)."""

    min_replicas: int = 1
    max_replicas: int = 1
    queue_wait_target_s: float = QUEUE_WAIT_TARGET_S
    kv_target: float = KV_TARGET
    look_back_s: float = 10.0
    scale_down_delay_s: float = 60.0
    max_scale_up_factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if not self.queue_wait_target_s > 0 or not 0 < self.kv_target <= 1:
            raise ValueError("queue_wait_target_s must be > 0 and kv_target in (0, 1]")
        if not self.look_back_s > 0 or not self.scale_down_delay_s >= 0 or not self.max_scale_up_factor > 1:
            raise ValueError("look_back_s must be > 0, scale_down_delay_s >= 0, max_scale_up_factor > 1")


class ReplicaSignals(NamedTuple):
    """What one replica records for the autoscaler."""

    queue_wait_p95_s: float = 0.0  # over the look-back, of requests that started
    expected_wait_s: float = 0.0  # of a request arriving now (math.inf: unbounded)
    kv_usage: float = 0.0  # fraction of KV blocks held, 0..1
    sleeping: bool = False


class ScaleState(NamedTuple):
    """What the rule remembers between calls: since when the fleet has
    looked over-provisioned (None: it does not)."""

    calm_since_s: float | None = None


class ScaleDecision(NamedTuple):
    num_replicas: int  # replicas to hold (awake + asleep + starting)
    num_awake: int  # of them, how many serve
    reason: str
    state: ScaleState


def queue_wait_s(config: AutoscaleConfig, replica: ReplicaSignals) -> float:
    """A replica's demand signal. An unbounded expected wait (nothing
    drained yet) counts as twice the target: grow, but not without limit."""
    expected = min(replica.expected_wait_s, 2 * config.queue_wait_target_s)
    return max(replica.queue_wait_p95_s, expected)


def pressure(config: AutoscaleConfig, awake: Sequence[ReplicaSignals]) -> tuple[float, str]:
    """(ratio, signal): demand against its target over the awake replicas;
    above 1 the fleet is short."""
    if not awake:
        return 0.0, HOLD
    n = len(awake)
    wait_ratio = sum(queue_wait_s(config, r) for r in awake) / n / config.queue_wait_target_s
    kv_ratio = sum(r.kv_usage for r in awake) / n / config.kv_target
    return (wait_ratio, QUEUE_WAIT) if wait_ratio >= kv_ratio else (kv_ratio, KV_USAGE)


def target_awake(config: AutoscaleConfig, awake: Sequence[ReplicaSignals]) -> int:
    """The HPA count: ceil(n * ratio), within [1, max_replicas]."""
    ratio, _ = pressure(config, awake)
    return min(config.max_replicas, max(1, math.ceil(len(awake) * ratio - 1e-9)))


def decide(config: AutoscaleConfig, replicas: Sequence[ReplicaSignals], state: ScaleState, now_s: float,
           num_starting: int = 0) -> ScaleDecision:
    """The fleet's next size. `replicas`: the ready ones (awake or asleep);
    `num_starting`: replicas asked for and not ready yet."""
    awake = [r for r in replicas if not r.sleeping]
    n_awake, n_ready = len(awake), len(replicas)
    target = target_awake(config, awake)
    _, signal = pressure(config, awake)
    if target > n_awake:
        grown = max(n_awake + 1, math.floor(n_awake * config.max_scale_up_factor))
        target = min(target, grown, config.max_replicas)
        if target > n_ready and num_starting:
            return _decision(config, n_ready + num_starting, n_ready, STARTING, ScaleState())
        return _decision(config, max(target, n_ready + num_starting), target, signal, ScaleState())
    if target < n_awake:
        calm_since = now_s if state.calm_since_s is None else state.calm_since_s
        if now_s - calm_since >= config.scale_down_delay_s:
            # The next step down waits the whole delay again.
            return _decision(config, n_awake - 1, n_awake - 1, SCALE_DOWN, ScaleState(now_s))
        return _decision(config, n_ready + num_starting, n_awake, CALM, ScaleState(calm_since))
    return _decision(config, n_ready + num_starting, n_awake, HOLD, ScaleState())


def _decision(config: AutoscaleConfig, num_replicas: int, num_awake: int, reason: str,
              state: ScaleState) -> ScaleDecision:
    held = min(config.max_replicas, max(config.min_replicas, num_replicas, 1))
    return ScaleDecision(held, max(1, min(num_awake, held)), reason, state)


def signals_of(backend: BackendLoad, queue_wait_p95_s: float = 0.0, sleeping: bool = False) -> ReplicaSignals:
    """A router's view of a backend as autoscaling signals."""
    return ReplicaSignals(queue_wait_p95_s, expected_wait_s(backend), backend.kv_usage, sleeping)


def desired_replicas(backends: Sequence[BackendLoad], kv_target: float = KV_TARGET,
                     queue_wait_target_s: float = QUEUE_WAIT_TARGET_S) -> int:
    """The gateway's gauge: the policy's count for these backends now (no
    delay, no bound but the fleet's doubling), for an HPA or KEDA rule."""
    if not backends:
        return 1
    config = AutoscaleConfig(max_replicas=max(1, 2 * len(backends)), kv_target=kv_target,
                             queue_wait_target_s=queue_wait_target_s)
    return target_awake(config, [signals_of(b) for b in backends])


class QueueWaitWindow:
    """Queue waits (arrival -> first scheduled) observed over the last
    `look_back_s`, and their p95. Pure; times are arguments."""

    def __init__(self, look_back_s: float) -> None:
        self.look_back_s = look_back_s
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, now_s: float, wait_s: float) -> None:
        self._samples.append((now_s, wait_s))

    def p95_s(self, now_s: float) -> float:
        """0 when nothing started within the look-back."""
        while self._samples and self._samples[0][0] < now_s - self.look_back_s:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        waits = sorted(w for _, w in self._samples)
        return waits[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)]
