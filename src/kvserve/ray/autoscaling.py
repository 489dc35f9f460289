"""kvserve's autoscaling policy as a Ray Serve custom policy
(`AutoscalingConfig.policy`): the replicas' recorded signals (their latest
`record_autoscaling_stats`) -> `fleet.autoscale.decide` -> the number of
replicas Ray holds. The delay and the warm pool are the rule's own, and
its state rides in Ray's `policy_state`. Ray 2.60 passes a custom
policy's answer through its own scaling factors and up/down delays too
(ray.serve.autoscaling_policy._apply_default_params): kvserve.ray.app sets
those delays to 0 and the factors to 1, so only the min/max bounds remain.

Configured through `AutoscalingPolicy(policy_function=KVServeAutoscalingPolicy,
policy_kwargs={...})`: the `fleet.autoscale.AutoscaleConfig` fields.
"""

from __future__ import annotations

import logging

from kvserve.fleet.autoscale import AutoscaleConfig, ReplicaSignals, ScaleState, decide

log = logging.getLogger("ray.serve." + __name__)

_SIGNALS = ReplicaSignals._fields


class KVServeAutoscalingPolicy:
    """Called by the Serve controller every control-loop tick with an
    `AutoscalingContext`; returns (replicas to hold, policy state)."""

    def __init__(self, **config) -> None:
        self.config = AutoscaleConfig(**config)

    def __call__(self, ctx) -> tuple[int, dict]:
        replicas = signals_from(ctx)
        num_starting = max(0, ctx.target_num_replicas - ctx.current_num_replicas)
        state = ScaleState(ctx.policy_state.get("calm_since_s"))
        decision = decide(self.config, replicas, state, ctx.current_time, num_starting)
        if decision.num_replicas != ctx.target_num_replicas:
            log.info("kvserve autoscaling %s: %d -> %d replicas (%d awake; %s)", ctx.deployment_name,
                     ctx.target_num_replicas, decision.num_replicas, decision.num_awake, decision.reason)
        return decision.num_replicas, {"calm_since_s": decision.state.calm_since_s,
                                       "num_awake": decision.num_awake, "reason": decision.reason}


def signals_from(ctx) -> list[ReplicaSignals]:
    """Each running replica's latest recorded signals; a replica that has
    recorded none yet counts as idle and awake."""
    raw = ctx.raw_metrics or {}
    signals = []
    for replica_id in ctx.running_replicas:
        latest = {}
        for name in _SIGNALS:
            series = raw.get(name, {}).get(replica_id)
            if series:
                latest[name] = series[-1].value
        signals.append(ReplicaSignals(**{k: (bool(v) if k == "sleeping" else float(v)) for k, v in latest.items()}))
    return signals
