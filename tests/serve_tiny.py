"""Run `kvserve serve`'s server loop (kvserve.server.cli.serve) on a tiny
random model, for the SIGTERM test: python -m tests.serve_tiny PORT GRACE_S."""

from __future__ import annotations

import sys

from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.server.cli import serve
from kvserve.server.serving import Serving
from tests.server_helpers import MODEL_NAME, tiny_core

if __name__ == "__main__":
    port, grace_s = int(sys.argv[1]), float(sys.argv[2])
    config = ServerConfig(port=port, served_model_name=MODEL_NAME, shutdown_grace_s=grace_s)
    sys.exit(serve(Serving(tiny_core(num_blocks=128), AdmissionConfig(), config)))
