"""`kvserve ray`'s flags: every `kvserve serve` engine and admission flag
(passed to every replica) plus Ray's. Their own module: the command
(ray/cli.py) and the application built from a dict (ray_app.py, for
`serve run` and a config file) both read them.
"""

from __future__ import annotations

import argparse

from kvserve import flags
from kvserve.fleet.router import ROUTERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.server import cli as serve_cli

    serve_cli.add_arguments(parser)  # --host / --port are the Ray HTTP proxy's
    ray = parser.add_argument_group("Ray Serve")
    ray.add_argument("--address", default=None,
                     help="Ray cluster to join (e.g. auto, ray://head:10001); default: start a local one")
    ray.add_argument("--num-cpus", type=float, default=None,
                     help="CPUs of a local cluster started here (default: all of this machine's)")
    ray.add_argument("--num-replicas", type=int, default=None,
                     help="a fixed number of replicas (replicas); without it, --min/--max-replicas autoscale")
    ray.add_argument("--min-replicas", type=int, default=1,
                     help="the warm pool: replicas always held, awake or (with --sleep-idle) asleep (replicas)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="most replicas the autoscaler holds (replicas; default: --min-replicas)")
    ray.add_argument("--sleep-idle", action="store_true",
                     help="replicas of the warm pool not needed awake sleep (KV cache freed, weights kept) "
                          "and are woken before new ones are started")
    ray.add_argument("--router", default="kv-aware", choices=ROUTERS, help="kvserve's routing policy")
    flags.add_autoscale_arguments(ray)
    ray.add_argument("--stats-period", type=float, default=1.0,
                     help="how often replicas record routing and autoscaling stats and ask the ingress "
                          "whether Ray is stopping them (seconds)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves (CPUs)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs each replica reserves (GPUs)")
    ray.add_argument("--app-name", default="kvserve", help="the Ray Serve application's name")
