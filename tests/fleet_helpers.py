"""Real processes on 127.0.0.1 for the gateway tests: tiny-model backends
(`tests.serve_fleet_backend`), simulated backends (`kvserve serve
--simulate`) and `kvserve gateway`, each started, waited for and stopped
(SIGKILL on demand)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120  # tiny backends warm up; a shared 2-core machine can take a while


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A spawned server: `url`, `wait_ready()`, `kill9()`, `stop()`."""

    def __init__(self, command: list[str], port: int, name: str) -> None:
        self.command, self.port, self.name = command, port, name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvserve-test-{name}-{port}.log"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> Proc:
        # this tree's src/ first: the venv's editable install may be another checkout's
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()
        if not self._log.closed:
            self._log.close()


def tiny_backend(port: int | None = None, *flags: str) -> Proc:
    port = port or free_port()
    return Proc([sys.executable, "-m", "tests.serve_fleet_backend", str(port), *flags], port, "backend")


def simulated_backend(port: int | None = None, *flags: str) -> Proc:
    port = port or free_port()
    return Proc([sys.executable, "-m", "kvserve.cli", "serve", "--simulate", "--port", str(port), *flags],
                port, "simulated")


def gateway(backends: list[str], *flags: str, config: dict | None = None, tmp_path: Path | None = None,
            port: int | None = None) -> Proc:
    port = port or free_port()
    command = [sys.executable, "-m", "kvserve.cli", "gateway", "--port", str(port), "--log-level", "warning"]
    for url in backends:
        command += ["--backend", url]
    if config is not None:
        assert tmp_path is not None
        path = tmp_path / f"gateway-{port}.json"
        path.write_text(json.dumps(config))
        command += ["--config", str(path)]
    return Proc(command + list(flags), port, "gateway")


def start_all(*procs: Proc) -> list[Proc]:
    """Wait for processes started together (their start-ups overlap); a
    gateway also until every backend given to it gets traffic."""
    try:
        for p in procs:
            p.wait_ready()
            if p.name == "gateway":
                wait_backends(p)
    except Exception:
        for p in procs:
            p.stop()
        raise
    return list(procs)


def wait_backends(gw: Proc, timeout_s: float = 30) -> None:
    """Until the gateway routes to all its backends (each probed ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [line for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines()
                  if line.startswith("kvserve_gateway_breaker_state{")]
        num_backends = len(states) // 3  # one line per breaker state
        if num_backends and backend_counter(gw.url, "kvserve_fleet_ready_backends") == num_backends:
            return
        time.sleep(0.2)
    raise RuntimeError(f"gateway never saw all its backends ready: {gw.log()}")


def backend_counter(url: str, name: str) -> float:
    """Sum of a /metrics sample over its labels; `name` may include the
    start of a label set (`name{backend="x"`), which then must match."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if "{" in name and line.startswith(name.rstrip("}")) or \
                line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
