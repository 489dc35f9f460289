"""`kvserve ray`: start (or, with --address, join) a Ray cluster and deploy
kvserve's Ray Serve application on it: per model a deployment of kvserve
engines (`kvserve serve`'s engine and admission flags, passed to every
replica), the OpenAI ingress with the fleet's admission, kvserve's router
and autoscaling policy. Runs until SIGINT / SIGTERM, then shuts the
application down (replicas drain).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvserve.ray.flags import add_arguments  # noqa: F401 (the command's flags, for kvserve.cli)

log = logging.getLogger("kvserve.ray")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import ray
        from ray import serve
    except ImportError:
        print("kvserve ray: error: Ray Serve is not installed (pip install 'kvserve[ray]')", file=sys.stderr)
        return 2
    from kvserve.ray.app import application

    try:
        app = application(args)
    except ValueError as exc:
        print(f"kvserve ray: error: {exc}", file=sys.stderr)
        return 2
    ray.init(address=args.address, num_cpus=args.num_cpus if args.address is None else None)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name=args.app_name, route_prefix="/")
    log.info("kvserve on Ray Serve: http://%s:%d (Ctrl-C to stop)", args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(args.app_name)  # replicas drain: Ray's graceful shutdown, then the engine's
    serve.shutdown()
    ray.shutdown()
    return 0
