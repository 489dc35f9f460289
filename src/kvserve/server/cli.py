"""`kvserve serve`: a model behind the OpenAI API, with KV-aware admission.

SIGTERM (or Ctrl-C) starts a graceful shutdown: new requests get 503 and
/ready turns false, in-flight requests get --shutdown-grace seconds to
finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve import flags
from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.engine.cli import engine_config, set_torch_threads
from kvserve.server.draining import DrainingServer

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """serve's flags: the shared engine and admission groups (kvserve/flags.py,
    which `kvserve simulate`, `profile` and `generate` use too) plus HTTP."""
    model = parser.add_argument_group("model and engine")
    flags.add_model_arguments(model)
    model.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: the model's file name)")
    flags.add_kv_cache_arguments(model)
    flags.add_batching_arguments(model)
    flags.add_runtime_arguments(model)
    flags.add_speculative_arguments(model)
    _add_lora_arguments(parser.add_argument_group("LoRA adapters"))
    from kvserve.server import simulated

    simulated.add_arguments(parser)
    _add_http_arguments(parser.add_argument_group("HTTP"))
    _add_observability_arguments(parser.add_argument_group("observability"))
    flags.add_admission_arguments(parser.add_argument_group("admission (the promise)"))


def _add_lora_arguments(lora: flags.ArgumentTarget) -> None:
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (implied by --lora-modules): a request names one by its "
                           "`model`; POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) to serve, "
                           "each under NAME")
    lora.add_argument("--max-loras", type=int, default=4,
                      help="most adapters resident at once, and so in one step (least recently used "
                           "evicted; a request under another waits) (adapters)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="highest adapter rank accepted; each resident slot is sized for it (rank)")


def lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... -> (name, path) pairs; ValueError for a malformed one."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        pairs.append((name, path))
    return pairs


def _add_http_arguments(http: flags.ArgumentTarget) -> None:
    defaults = ServerConfig()
    http.add_argument("--host", default=defaults.host, help="address to bind (loopback by default)")
    http.add_argument("--port", type=int, default=defaults.port,
                      help="TCP port to listen on (0 = any free port)")
    http.add_argument("--api-keys", default=None,
                      help="JSON file mapping API key -> {tenant, max_concurrent, tokens_per_minute, "
                           "priority}; without it there is one default tenant and no auth")
    http.add_argument("--stream-stall-timeout", type=float, default=defaults.stream_stall_timeout_s,
                      help="abort a request whose client took no response bytes for this long while some "
                           "were waiting, freeing its KV (seconds)")
    http.add_argument("--auth-metrics-and-docs", action="store_true",
                      help="with --api-keys, require a key on /metrics and the API docs (/openapi.json, "
                           "/docs, /redoc) too (default: off, they stay open for scrapers and schema tools; "
                           "/health and /ready are always open)")
    http.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s,
                      help="on SIGTERM, time in-flight requests get to finish before abort (seconds)")
    http.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                      help="larger request bodies get 413 (bytes)")
    http.add_argument("--max-n", type=int, default=defaults.max_n,
                      help="most choices (n) one request may ask for; each is an engine request, admitted "
                           "and charged as one")
    http.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                      help="skip the warm-up before /ready reports ready (by default about 20 engine steps "
                           "on throwaway requests, at most ~10 seconds, so admission's step-time fit exists "
                           "before the first request; metrics, KV and the prefix cache are left empty)")
    http.add_argument("--gil-switch-interval", type=float, default=None,
                      help="Python's thread switch interval (seconds; default: Python's 0.005); shorter "
                           "lets the engine thread win the GIL back from the HTTP thread sooner (no "
                           "measurable effect on the 2-core dev box, see docs/performance.md)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="server log level")


def _add_observability_arguments(group) -> None:
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send one OpenTelemetry trace per request (queue, prefill, decode spans) to "
                            "this OTLP endpoint, over OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, the "
                            "default, or http/protobuf); off by default (no cost). Needs kvserve[tracing]")
    group.add_argument("--request-log", action="store_true",
                       help="log one JSON line per finished request (logger kvserve.requests, INFO): ids, "
                            "tenant, priority, tokens, how it ended, latencies; no text")
    group.add_argument("--log-prompts", action="store_true",
                       help="with --request-log, include the prompt and output text (may be personal data)")


def lora_config(args: argparse.Namespace):
    """The engine's config with the LoRA flags (--lora-modules implies --enable-lora)."""
    from dataclasses import replace

    return replace(engine_config(args), enable_lora=args.enable_lora or bool(args.lora_modules),
                   max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def load_lora_modules(core, args: argparse.Namespace, base_name: str) -> None:
    """Serve each --lora-modules NAME=PATH (a simulated replica reads only
    its config: server/simulated.py). ValueError names a bad one."""
    for adapter_name, path in lora_modules(args.lora_modules):
        if adapter_name == base_name:
            raise ValueError(f"--lora-modules: {adapter_name!r} is the base model's name")
        core.load_lora_adapter(adapter_name, path)  # LoraError (a ValueError) names a bad folder


def configs(args: argparse.Namespace, served_model_name: str) -> tuple[AdmissionConfig, ServerConfig]:
    server = ServerConfig(
        host=args.host, port=args.port, served_model_name=served_model_name, api_keys_path=args.api_keys,
        stream_stall_timeout_s=args.stream_stall_timeout, shutdown_grace_s=args.shutdown_grace,
        max_body_bytes=args.max_body_bytes, warm_up=args.warm_up,
        auth_metrics_and_docs=args.auth_metrics_and_docs, max_n=args.max_n,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        request_log=args.request_log or args.log_prompts, log_prompts=args.log_prompts)
    return flags.admission_config(args), server


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serving = build_serving(args)
    except (ValueError, OSError) as exc:  # bad flags, keys file or model: a message, not a traceback
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(serving, args.gil_switch_interval)


def build_serving(args: argparse.Namespace, phases=None):
    """The Serving `kvserve serve` runs (a Ray replica builds its own with
    it too); `phases` (a startup.StartupPhases) gets the cold start's
    imports, weight load and KV allocation timed."""
    from kvserve.startup import StartupPhases

    phases = phases if phases is not None else StartupPhases()
    with phases.phase("imports"):  # heavy imports only when serving
        from pathlib import Path

        from kvserve.engine.core import EngineCore
        from kvserve.model.loader import load_model
        from kvserve.server.serving import Serving
        from kvserve.admission.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(args.api_keys) if args.api_keys else TenantDirectory()
    if args.simulate:
        from kvserve.server import simulated

        core, versions, name = simulated.build_core(args, lora_config(args))
        name = args.served_model_name or name
        load_lora_modules(core, args, name)
        admission, server = configs(args, name)
        serving = Serving(core, admission, server, tenants, versions=versions)
        serving.startup = phases
        return serving
    if args.preset is not None:
        raise ValueError("--preset needs --simulate (a preset is an architecture without weights)")
    set_torch_threads(args.torch_threads)
    with phases.phase("weight_load"):
        loaded = load_model(args.model, quantization=args.quantization)
    name = args.served_model_name or Path(loaded.source).name.removesuffix(".gguf")
    admission, server = configs(args, name)
    with phases.phase("kv_allocation"):  # the runner allocates the KV cache tensor
        core = EngineCore(loaded.config, loaded.weights, loaded.tokenizer, lora_config(args),
                          versions=loaded.versions)
    load_lora_modules(core, args, name)
    serving = Serving(core, admission, server, tenants, versions=loaded.versions)
    serving.startup = phases
    serving.reload_weights = lambda: load_model(args.model, quantization=args.quantization).weights  # a wake from sleep level 2
    return serving


def serve(serving, gil_switch_interval_s: float | None = None) -> int:
    """Run uvicorn until SIGTERM / SIGINT and a graceful drain; 0 on a clean exit."""
    if gil_switch_interval_s is not None:
        sys.setswitchinterval(gil_switch_interval_s)
    from kvserve.server.app import create_app
    from kvserve.server.transport import ConnectionLimits, uvicorn_config

    app = create_app(serving)
    config = uvicorn_config(app, serving.config.host, serving.config.port,
                            ConnectionLimits(serving.config.stream_stall_timeout_s),
                            log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, serving)
    # Server.run, not asyncio.run(server.serve()): it builds the loop from the
    # config (uvloop when installed), whose C transports write to sockets
    # without a Python selector round per write; measured in
    # docs/performance.md (Overload).
    server.run()
    return 0
