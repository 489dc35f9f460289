"""`kvserve ray` stops on a signal within its bound: SIGTERM while a stream
is in flight that would run for minutes; the stream ends at the grace as
`kvserve serve` ends it at its own (a last chunk with finish_reason
"abort", then [DONE]; not the error event of a replica killed under it),
the command exits 0 within the grace plus its margin, and no process of
the cluster it started is left.

The signal goes to one of Ray's threads (tgkill), as the kernel may hand a
process's signal to any of its threads: the main thread must still see it.
The command runs in its own session; every process Ray starts stays in it,
so "none left" is "no process in that session"."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve.ray.cli import SHUTDOWN_MARGIN_S
from tests.load_helpers import wait_until

pytestmark = pytest.mark.ray

GRACE_S = 3.0
# ray.shutdown and the interpreter's exit after the drain, on a loaded 2-core machine.
EXIT_SLACK_S = 45.0
SYS_TGKILL = 234  # x86_64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(text[:text.rindex(")") + 1])
    return found


def _blocks(pid: int, tid: int, sig: int) -> bool:
    """Whether thread tid has sig in its signal mask (/proc's SigBlk)."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _signal_a_non_main_thread(pid: int, sig: int) -> int:
    """Send sig to one of the driver's non-main threads, as the kernel does with
    a process-directed signal when it picks such a thread: only a thread that
    does not block it (Ray's gRPC threads block signals; a signal sent to one
    of those would stay pending on it, which a `kill` never does)."""
    threads = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid)
    receivers = [tid for tid in threads if not _blocks(pid, tid, sig)]
    assert receivers, "Ray's driver runs threads beside the main one that take signals"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, receivers[-1], sig) == 0, os.strerror(ctypes.get_errno())
    return receivers[-1]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill and /proc")
def test_sigterm_drains_within_the_grace_exits_0_and_leaves_no_ray_process(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # A simulated replica (the real server and scheduler; each step a sleep of
    # an 8B model's step on an L4, ~0.07 s): 3000 tokens take minutes.
    command = [sys.executable, "-m", "kvserve.cli", "ray", "--simulate", "--preset", "llama-3.1-8b",
               "--hardware", "l4", "--served-model-name", "sim", "--kv-cache-memory", "1GiB", "--no-warm-up",
               "--num-replicas", "1", "--replica-cpus", "0.5", "--num-cpus", "2", "--stats-period", "0.5",
               "--shutdown-grace", str(GRACE_S), "--host", "127.0.0.1", "--port", str(port)]
    log_path = tmp_path / "kvserve-ray.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: _ready(url) or proc.poll() is not None, timeout_s=300, period_s=1.0)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert wait_until(lambda: "Ctrl-C to stop" in log_path.read_text(), timeout_s=120, period_s=0.5)

        events: list[bytes] = []
        first_token = threading.Event()

        def stream() -> None:
            body = {"model": "sim", "prompt": "keep going", "max_tokens": 3000, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line.encode())
                        first_token.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_token.wait(120), "the stream never started"

        _signal_a_non_main_thread(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        rc = proc.wait(timeout=GRACE_S + SHUTDOWN_MARGIN_S + EXIT_SLACK_S)
        took_s = time.monotonic() - signalled
        reader.join(timeout=30)
        output = log_path.read_text()
        assert rc == 0, output[-3000:]
        assert "SIGTERM received" in output and "kvserve ray stopped" in output
        assert took_s >= GRACE_S * 0.9, f"it stopped before the in-flight stream had its grace ({took_s:.1f} s)"

        # The stream was cut at the grace, not run to its end, and ended as an abort.
        tokens = [e for e in events if e.startswith(b"data: {") and b'"choices"' in e]
        assert 0 < len(tokens) < 3000
        assert events[-1] == b"data: [DONE]", events[-3:]
        last = json.loads(events[-2][len(b"data: "):])
        assert "error" not in last, last
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert "drain begun on 1 model replicas" in output
        # Ray's processes (raylet, GCS, workers, dashboard) went with the cluster.
        assert wait_until(lambda: not _session_processes(proc.pid), timeout_s=30, period_s=0.5), \
            _session_processes(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
