"""A `kvserve serve` process on a tiny random model for the gateway tests:
python -m tests.serve_fleet_backend PORT [--step-delay S] [--no-warm-up]
[--num-blocks N] [--max-queue-wait S] [--api-keys FILE] [--enable-lora]
[--lora-modules NAME=PATH ...] [--max-loras N] [--max-lora-rank R] (the
LoRA flags are `kvserve serve`'s own). A real process, so a test can kill -9
it."""

from __future__ import annotations

import argparse
import sys

from kvserve.admission.tenants import TenantDirectory
from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.server.cli import _add_lora_arguments, load_lora_modules, serve
from kvserve.server.serving import Serving
from tests.server_helpers import MODEL_NAME, slow_steps, tiny_core

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument("--num-blocks", type=int, default=128)
    parser.add_argument("--max-queue-wait", type=float, default=1.0)
    parser.add_argument("--api-keys", default=None)
    _add_lora_arguments(parser)
    args = parser.parse_args()
    config = ServerConfig(port=args.port, served_model_name=MODEL_NAME, shutdown_grace_s=1.0, warm_up=args.warm_up)
    tenants = TenantDirectory.from_file(args.api_keys) if args.api_keys else None
    core = tiny_core(num_blocks=args.num_blocks, enable_lora=args.enable_lora or bool(args.lora_modules),
                     max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    load_lora_modules(core, args, MODEL_NAME)
    core = slow_steps(core, args.step_delay)
    sys.exit(serve(Serving(core, AdmissionConfig(max_queue_wait_s=args.max_queue_wait), config, tenants)))
