"""kvserve's Ray Serve application from `kvserve ray`'s flags (a parsed
namespace): an `Ingress` (the OpenAI API and fleet admission) bound to a
model deployment of `ModelReplica`s, with kvserve's router as its request
router and, unless `num_replicas` is fixed, kvserve's autoscaling policy.
`kvserve ray` builds it here; `kvserve.ray_app:build_app` from a dict.
"""

from __future__ import annotations

import argparse
import dataclasses

from kvserve import flags
from kvserve.fleet.autoscale import AutoscaleConfig

# Ray's own queue must never decide in kvserve's place: a replica takes
# (nearly) all it is sent and its own admission refuses with 429.
MAX_ONGOING_REQUESTS = 100_000
MODEL_DEPLOYMENT = "kvserve-model"
# The name Ray gives it by default (its class's), spelt out: replicas ask it whether Ray is stopping them.
INGRESS_DEPLOYMENT = "Ingress"
# Past a replica's own grace and the stats period it takes to learn Ray is
# stopping it (or at once: told by `kvserve ray` before the delete; it aborts
# what is left at --shutdown-grace): Ray's kill never cuts the aborts' last chunks.
REPLICA_EXTRA_GRACE_S = 2.0
# Past the replicas' graceful shutdown: a stream cut at their grace still ends cleanly.
INGRESS_EXTRA_GRACE_S = 5.0


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """Raises ValueError on bounds that cannot hold (max below min)."""
    max_replicas = args.min_replicas if args.max_replicas is None else args.max_replicas
    return flags.autoscale_config(args, args.min_replicas, max_replicas)


def application(args: argparse.Namespace):
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from kvserve.ray.autoscaling import KVServeAutoscalingPolicy
    from kvserve.ray.ingress import Ingress
    from kvserve.ray.replica import ModelReplica
    from kvserve.ray.router import KVServeRouter

    scaling = autoscale_config(args)  # validates the bounds
    period_s = args.stats_period
    options: dict = {
        "name": MODEL_DEPLOYMENT, "max_ongoing_requests": MAX_ONGOING_REQUESTS,
        "graceful_shutdown_timeout_s": replica_graceful_timeout_s(args),
        "graceful_shutdown_wait_loop_s": min(1.0, period_s),
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus,
                              "runtime_env": {"env_vars": _metric_push_env(period_s)}},
        "request_router_config": RequestRouterConfig(
            request_router_class=KVServeRouter, request_router_kwargs={"policy": args.router},
            request_routing_stats_period_s=period_s, request_routing_stats_timeout_s=max(5.0, 4 * period_s)),
    }
    if args.num_replicas is not None:
        options["num_replicas"] = args.num_replicas
    else:
        fields = dataclasses.asdict(scaling)
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas,
            initial_replicas=max(1, scaling.min_replicas), look_back_period_s=max(scaling.look_back_s, 2 * period_s),
            # Ray applies these to a custom policy's answer too: neutral, the rule has its own delay.
            upscale_delay_s=0.0, downscale_delay_s=0.0, upscaling_factor=1.0, downscaling_factor=1.0,
            policy=AutoscalingPolicy(policy_function=KVServeAutoscalingPolicy, policy_kwargs=fields))
    model = serve.deployment(ModelReplica).options(**options).bind(_serve_args(args), scaling.look_back_s,
                                                                  INGRESS_DEPLOYMENT, period_s)
    ingress_config = {"deployment_name": MODEL_DEPLOYMENT, "api_keys_path": args.api_keys,
                      "retry_budget": args.retry_budget, "admission": flags.admission_config(args),
                      "router_policy": args.router,
                      "warm_pool": dataclasses.asdict(scaling) if args.sleep_idle else None,
                      "warm_pool_interval_s": period_s}
    # The ingress outlives its replicas' grace: it relays the end of their streams.
    ingress_grace_s = replica_graceful_timeout_s(args) + INGRESS_EXTRA_GRACE_S
    return Ingress.options(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                           graceful_shutdown_timeout_s=ingress_grace_s,
                           graceful_shutdown_wait_loop_s=0.5,
                           ray_actor_options={"num_cpus": 0}).bind(model, ingress_config)


def replica_graceful_timeout_s(args: argparse.Namespace) -> float:
    """How long Ray lets a stopping model replica run: its shutdown grace,
    after the stats period it may take to learn it is stopping, and a margin."""
    return args.shutdown_grace + args.stats_period + REPLICA_EXTRA_GRACE_S


def _serve_args(args: argparse.Namespace) -> dict:
    """The flags every replica builds its engine from (`kvserve serve`'s)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def _metric_push_env(period_s: float) -> dict[str, str]:
    """Replicas push autoscaling metrics every period (Ray's default: 10 s,
    too slow for a queue building in seconds)."""
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(period_s)}
