"""Run `kvserve serve`'s server loop (kvserve.server.cli.serve) on a tiny
random model, for the SIGTERM test: python -m tests.serve_tiny PORT GRACE_S
[STEP_DELAY_S]. A step delay makes a long request last long enough to be
in flight when the signal comes, however fast or loaded the machine."""

from __future__ import annotations

import sys

from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.server.cli import serve
from kvserve.server.serving import Serving
from tests.server_helpers import MODEL_NAME, slow_steps, tiny_core

if __name__ == "__main__":
    port, grace_s = int(sys.argv[1]), float(sys.argv[2])
    step_delay_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    config = ServerConfig(port=port, served_model_name=MODEL_NAME, shutdown_grace_s=grace_s)
    core = slow_steps(tiny_core(num_blocks=128), step_delay_s)
    sys.exit(serve(Serving(core, AdmissionConfig(), config)))
