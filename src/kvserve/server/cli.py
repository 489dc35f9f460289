"""`kvserve serve`: a model behind the OpenAI API, with KV-aware admission.

SIGTERM (or Ctrl-C) starts a graceful shutdown: new requests get 503 and
/ready turns false, in-flight requests get --shutdown-grace seconds to
finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import uvicorn

from kvserve.config import AdmissionConfig, ServerConfig

log = logging.getLogger("kvserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and engine")
    model.add_argument("--model", default=None,
                       help="a *.gguf file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: the model's file name)")
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="weight and activation dtype")
    model.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    model.add_argument("--kv-cache-memory", default="1GiB",
                       help="KV cache size in bytes with a unit (e.g. 512MiB, 2GiB)")
    model.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens per block)")
    model.add_argument("--max-num-seqs", type=int, default=64,
                       help="most sequences in one engine step (sequences); admission may lower it")
    model.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one forward pass (tokens)")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (tokens; default: the model's context)")
    model.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    model.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly instead of replaying CUDA graphs (graphs are used on "
                            "CUDA only; they cut a small model's decode step to its kernels' time)")
    model.add_argument("--torch-threads", type=int, default=None,
                       help="torch intra-op CPU threads (default: torch's choice); on a small shared CPU, "
                            "1 avoids oversubscription with the HTTP thread")

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    http.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0 = any free port)")
    http.add_argument("--api-keys", default=None,
                      help="JSON file mapping API key -> {tenant, max_concurrent, tokens_per_minute, "
                           "priority}; without it there is one default tenant and no auth")
    http.add_argument("--stream-stall-timeout", type=float, default=30.0,
                      help="abort a streaming request whose client reads nothing for this long (seconds)")
    http.add_argument("--shutdown-grace", type=float, default=30.0,
                      help="on SIGTERM, time in-flight requests get to finish before abort (seconds)")
    http.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                      help="larger request bodies get 413 (bytes)")
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

    adm = parser.add_argument_group("admission (the promise)")
    adm.add_argument("--ttft-slo", type=float, default=2.0, help="time-to-first-token target (seconds)")
    adm.add_argument("--tpot-slo", type=float, default=0.1,
                     help="time-per-output-token target (seconds); caps the running batch to keep it")
    adm.add_argument("--max-queue-wait", type=float, default=1.0,
                     help="refuse (429 + Retry-After) when the expected queue wait exceeds this (seconds)")
    adm.add_argument("--deferred-max-queue-wait", type=float, default=8.0,
                     help="the same limit for deferred classes: priority > 0 or service_tier=flex (seconds)")
    adm.add_argument("--queue-timeout", type=float, default=30.0,
                     help="abort with 503 an admitted request that has not started after this (seconds)")
    adm.add_argument("--max-queue-len", type=int, default=256, help="most requests waiting to start (requests)")
    adm.add_argument("--default-max-tokens", type=int, default=256,
                     help="max_tokens for requests that omit it, echoed in x-kvserve-max-tokens (tokens)")
    adm.add_argument("--require-max-tokens", "--strict", action="store_true",
                     help="refuse (400) requests without max_tokens instead of applying the default")
    adm.add_argument("--retry-budget", type=float, default=0.1,
                     help="retries allowed per admitted request (fraction; 0.1 = at most ~10%%)")
    adm.add_argument("--degrade-wait", type=float, default=None,
                     help="above this expected wait, cap max_tokens instead of refusing (seconds; off by default)")
    adm.add_argument("--degrade-max-tokens", type=int, default=64,
                     help="the max_tokens cap applied when degrading (tokens)")


def configs(args: argparse.Namespace, served_model_name: str) -> tuple[AdmissionConfig, ServerConfig]:
    admission = AdmissionConfig(
        max_queue_wait_s=args.max_queue_wait, deferred_max_queue_wait_s=args.deferred_max_queue_wait,
        queue_timeout_s=args.queue_timeout, max_queue_len=args.max_queue_len,
        default_max_tokens=args.default_max_tokens, require_max_tokens=args.require_max_tokens,
        ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, retry_budget=args.retry_budget,
        degrade_wait_s=args.degrade_wait, degrade_max_tokens=args.degrade_max_tokens)
    server = ServerConfig(
        host=args.host, port=args.port, served_model_name=served_model_name, api_keys_path=args.api_keys,
        stream_stall_timeout_s=args.stream_stall_timeout, shutdown_grace_s=args.shutdown_grace,
        max_body_bytes=args.max_body_bytes, warm_up=args.warm_up)
    return admission, server


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serving = build_serving(args)
    except (ValueError, OSError) as exc:  # bad flags, keys file or model: a message, not a traceback
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(serving, args.gil_switch_interval)


def build_serving(args: argparse.Namespace):
    # Heavy imports only when serving.
    from pathlib import Path

    from kvserve.engine.core import EngineConfig, EngineCore
    from kvserve.model.loader import load_model
    from kvserve.server.serving import Serving
    from kvserve.server.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(args.api_keys) if args.api_keys else TenantDirectory()
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model)
    name = args.served_model_name or Path(loaded.source).name.removesuffix(".gguf")
    admission, server = configs(args, name)
    engine_config = EngineConfig.from_sizes(
        args.kv_cache_memory, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        device=args.device, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    core = EngineCore(loaded.config, loaded.weights, loaded.tokenizer, engine_config, versions=loaded.versions)
    return Serving(core, admission, server, tenants, versions=loaded.versions)


def serve(serving, gil_switch_interval_s: float | None = None) -> int:
    """Run uvicorn until SIGTERM / SIGINT and a graceful drain; 0 on a clean exit."""
    if gil_switch_interval_s is not None:
        sys.setswitchinterval(gil_switch_interval_s)
    from kvserve.server.app import create_app

    app = create_app(serving)
    config = uvicorn.Config(app, host=serving.config.host, port=serving.config.port,
                            log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, serving)
    # Server.run, not asyncio.run(server.serve()): it builds the loop from the
    # config (uvloop when installed), whose C transports write to sockets
    # without a Python selector round per write; measured in
    # docs/performance.md (Overload).
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM / SIGINT drains:
    stop admitting (503, /ready false), give in-flight requests the grace
    period, abort the rest, then exit. A second signal exits at once."""

    def __init__(self, config, serving) -> None:
        super().__init__(config)
        self.serving = serving
        self._drain_task = None

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # exiting, and the default SIGTERM handler would make the exit code -15.
        if self._drain_task is not None:
            self.force_exit = True
            self.should_exit = True
            return
        self._drain_task = "starting"
        # Signal handlers run between bytecodes of the loop's thread; schedule
        # thread-safely so the selector wakes up.
        asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        log.info("shutting down: draining in-flight requests (grace %.1f s)", self.serving.config.shutdown_grace_s)
        try:
            await self.serving.drain(self.serving.config.shutdown_grace_s)
        finally:
            self.should_exit = True
