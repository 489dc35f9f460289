"""The fleet's desired replica count from the signals the source texts name:
queue wait as the demand signal, KV usage as the ceiling (never CPU or
requests per second). The gateway exports it as a gauge for an HPA or KEDA
rule; the Ray Serve autoscaling policy (issue 18) is to grow from it.

The rule, HPA-style: desired = ceil(n * max(mean KV usage / kv_target,
mean expected queue wait / queue_wait_target_s)), at least 1, and never
below the replicas that have requests queued while any has a queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.fleet.backend_state import BackendLoad, expected_wait_s

KV_TARGET = 0.75  # the KV headroom target: scale out above three quarters full
QUEUE_WAIT_TARGET_S = 0.5


def desired_replicas(backends: Sequence[BackendLoad], kv_target: float = KV_TARGET,
                     queue_wait_target_s: float = QUEUE_WAIT_TARGET_S) -> int:
    n = len(backends)
    if n == 0:
        return 1
    mean_kv = sum(b.kv_usage for b in backends) / n
    # An unbounded wait (nothing drained yet) counts as twice the target: grow, but not without limit.
    waits = [min(expected_wait_s(b), 2 * queue_wait_target_s) for b in backends]
    ratio = max(mean_kv / kv_target, (sum(waits) / n) / queue_wait_target_s)
    return max(1, math.ceil(n * ratio - 1e-9))
