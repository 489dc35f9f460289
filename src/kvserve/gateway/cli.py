"""`kvserve gateway`: the fleet's front door over OpenAI-compatible backends.

SIGTERM (or Ctrl-C) drains: /ready turns false, new requests get 503,
streams in flight get --shutdown-grace seconds, then the gateway exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.config import AdmissionConfig
from kvserve.fleet.router import ROUTERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("backends and routing")
    fleet.add_argument("--backend", action="append", default=None, metavar="URL",
                       help="an OpenAI-compatible server exposing vLLM's metric names (kvserve serve, vLLM); "
                            "repeat for each; they form one pool whose model name they list")
    fleet.add_argument("--config", default=None, metavar="FILE",
                       help="YAML or JSON: pools of backends per served model name, router, aliases "
                            "(model: auto), the degradation ladder per priority class, tenants, admission "
                            "(see kvserve/gateway/config.py); flags given override it")
    fleet.add_argument("--router", choices=ROUTERS, default=None,
                       help="routing policy (default: least-loaded): round-robin, least-loaded (running + "
                            "waiting), kv-aware (projected KV blocks fit with most headroom), prefix-affinity "
                            "(consistent hash of tenant + prompt start, bounded by load)")
    fleet.add_argument("--affinity-slack", type=float, default=None,
                       help="prefix-affinity keeps a prefix on its backend while that backend's expected "
                            "wait is at most this much above the least-loaded one's (seconds; default 0.5)")
    fleet.add_argument("--scrape-interval", type=float, default=None,
                       help="how often each backend's /metrics and /ready are read (seconds; default 1)")

    http = parser.add_argument_group("HTTP and admission")
    http.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1, loopback)")
    http.add_argument("--port", type=int, default=None, help="TCP port to listen on (default: 8080; 0 = any free)")
    http.add_argument("--api-keys", default=None, metavar="FILE",
                      help="JSON file mapping API key -> {tenant, max_concurrent, tokens_per_minute, priority} "
                           "(as kvserve serve's); quotas are counted once for the whole fleet")
    http.add_argument("--retry-budget", type=float, default=None,
                      help="retries (clients' and the gateway's re-sends after a backend's 429) allowed per "
                           f"admitted request, for the fleet (fraction; default {AdmissionConfig.retry_budget:g})")
    http.add_argument("--max-queue-wait", type=float, default=None,
                      help="refuse (429 + Retry-After) before asking any backend when none could start the "
                           f"request within this (seconds; default {AdmissionConfig.max_queue_wait_s:g}; priority > 0: "
                           "--deferred-max-queue-wait)")
    http.add_argument("--deferred-max-queue-wait", type=float, default=None,
                      help=f"the same limit for deferred classes (seconds; default "
                           f"{AdmissionConfig.deferred_max_queue_wait_s:g})")
    http.add_argument("--state-dir", default=None, metavar="DIR",
                      help="where the Batch API's SQLite database lives; accepted batches survive a restart "
                           "(default: ./kvserve-gateway-state)")
    http.add_argument("--shutdown-grace", type=float, default=None,
                      help="on SIGTERM, time streams in flight get to finish (seconds; default 30)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log level")


def build_config(args: argparse.Namespace):
    from kvserve.gateway import config as gw

    data = gw.load_file(args.config) if args.config else {}
    data = gw.add_backends(data, args.backend or [])
    if not data.get("pools"):
        raise ValueError("give at least one --backend URL, or --config FILE with pools")
    router = dict(data.get("router") or {})
    if args.router is not None:
        router["policy"] = args.router
    if args.affinity_slack is not None:
        router["affinity_slack_s"] = args.affinity_slack
    if router:
        data["router"] = router
    admission = {"retry_budget": args.retry_budget, "max_queue_wait_s": args.max_queue_wait,
                 "deferred_max_queue_wait_s": args.deferred_max_queue_wait}
    return gw.from_mapping(data, admission, host=args.host, port=args.port, api_keys_path=args.api_keys,
                           state_dir=args.state_dir, shutdown_grace_s=args.shutdown_grace,
                           scrape_interval_s=args.scrape_interval)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kvserve.gateway.service import Gateway

        gateway = Gateway(build_config(args))
    except (ValueError, OSError) as exc:
        print(f"kvserve gateway: error: {exc}", file=sys.stderr)
        return 2
    return serve(gateway)


def serve(gateway) -> int:
    import uvicorn

    from kvserve.gateway.app import create_gateway_app
    from kvserve.server.draining import DrainingServer

    config = uvicorn.Config(create_gateway_app(gateway), host=gateway.config.host, port=gateway.config.port,
                            log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, gateway).run()  # the first SIGTERM drains, as kvserve serve's
    return 0
