"""SIGTERM: stop admitting (503 with Retry-After, /ready false), let in-flight
requests finish within the grace period, exit 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.load_helpers import wait_until
from tests.server_helpers import MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests_and_exits_zero():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # this tree's src/ first
    # 5 ms per engine step: the 400-token request below lasts >= 2 s.
    proc = subprocess.Popen([sys.executable, "-m", "tests.serve_tiny", str(port), "20", "0.005"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            try:
                return httpx.get(base + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, 60, 0.2), proc.stdout.read1().decode() if proc.poll() is not None else "no start"
        result = {}
        streaming = threading.Event()

        def long_stream():
            body = {"model": MODEL_NAME, "prompt": "drain me", "max_tokens": 400, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                result["status"] = r.status_code
                chunks = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        streaming.set()
                result["finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]

        client = threading.Thread(target=long_stream)
        client.start()
        assert streaming.wait(30)  # the request is running: its first tokens arrived
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not ready(), 5)
        refused = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                             headers={"x-request-id": "late-1"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        # Come back after the drain (20 s grace): no sooner, since this server admits nothing before.
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        assert refused.headers["x-request-id"] == "late-1" and refused.headers["x-kvserve-model-revision"]
        client.join(60)
        assert result == {"status": 200, "finish": "length"}  # finished, not cut
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
