"""The stall abort: a client that stops reading is aborted --stream-stall-timeout
seconds after its receive buffer last took bytes, and its KV is freed, while a
slow reader that keeps taking bytes is served to the end. The clock itself
(StallClock) is tested on samples."""

from __future__ import annotations

import array
import fcntl
import json
import socket
import sys
import termios
import threading
import time

import pytest

from kvserve.server.transport import ReaderSample, StallClock
from tests.load_helpers import metric, scrape, wait_until
from tests.server_helpers import MODEL_NAME, live_server, slow_steps, tiny_core

STALL_TIMEOUT_S = 1.0
STEP_S = 0.02  # each engine step takes at least this long
RECEIVE_BUFFER_BYTES = 2048


# ---- the clock -----------------------------------------------------------------

def waiting(acked: int | None, buffered: int = 0) -> ReaderSample:
    return ReaderSample(acked, buffered, in_kernel=True)


def test_clock_times_from_the_last_byte_taken():
    clock = StallClock(1.0)
    assert not clock.stalled(0.0, waiting(100))
    assert not clock.stalled(0.5, waiting(200))  # took bytes: the clock restarts at 0.5
    assert not clock.stalled(1.4, waiting(200))
    assert clock.stalled(1.5, waiting(200))


def test_clock_does_not_run_while_nothing_waits():
    clock = StallClock(1.0)
    assert not clock.stalled(0.0, waiting(100))
    assert not clock.stalled(5.0, ReaderSample(100, 0, in_kernel=False))  # the reader has everything
    assert not clock.stalled(5.5, waiting(100))  # waiting again from 5.5
    assert clock.stalled(6.5, waiting(100))


def test_clock_without_tcp_info_counts_the_transport_buffer_draining():
    clock = StallClock(1.0)
    assert not clock.stalled(0.0, waiting(None, buffered=5000))
    assert not clock.stalled(0.9, waiting(None, buffered=4000))  # the kernel took some
    assert not clock.stalled(1.8, waiting(None, buffered=4000))
    assert clock.stalled(2.0, waiting(None, buffered=4500))  # grew (a write), no drain for 1.1 s


# ---- a live server -------------------------------------------------------------

def _open_stream(base_url: str, max_tokens: int) -> socket.socket:
    """A streaming completion on a socket whose receive buffer is set small
    before connecting (so the TCP window is small from the start)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    sock.connect((host, int(port)))
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _unread_bytes(sock: socket.socket) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


def _silent_reader(sock: socket.socket, aborted: threading.Event) -> float:
    """Reads up to the first SSE event, then nothing; returns the last
    moment its receive buffer took bytes (the abort is timed from there)."""
    data = b""
    while b"data: " not in data:
        data += sock.recv(4096)
    last_taken_at, last_unread = time.monotonic(), -1
    while not aborted.is_set():
        unread = _unread_bytes(sock)
        if unread != last_unread:
            last_taken_at, last_unread = time.monotonic(), unread
        time.sleep(0.01)
    return last_taken_at


def _slow_reader(sock: socket.socket, out: dict) -> None:
    """Takes 512 bytes every 0.1 s (slower than the engine writes) to the end."""
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(512)
        if not chunk:
            break
        data += chunk
        time.sleep(0.1)
    events = [json.loads(line[6:]) for line in data.decode().split("\n")
              if line.startswith("data: {")]
    out["finish"] = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    out["done"] = b"data: [DONE]" in data


def _stalled_count(base_url: str) -> float:
    return metric(scrape(base_url), "kvserve_cancellations_total", reason="stalled")


@pytest.mark.skipif(sys.platform != "linux", reason="FIONREAD on a socket and TCP_INFO are Linux's")
def test_silent_reader_is_aborted_and_freed_while_a_slow_reader_is_served():
    # >= 20 ms per step: the silent request's 480 tokens would run ~10 s,
    # far past the timeout; the slow reader's 150 tokens take ~3 s to
    # generate and longer to read at 5 KB/s.
    core = slow_steps(tiny_core(num_blocks=64), STEP_S)
    with live_server(core, stream_stall_timeout_s=STALL_TIMEOUT_S) as srv:
        slow_out: dict = {}
        slow = threading.Thread(target=_slow_reader, args=(_open_stream(srv.base_url, 150), slow_out))
        slow.start()
        silent_sock = _open_stream(srv.base_url, 480)
        aborted = threading.Event()
        result = {}
        silent = threading.Thread(target=lambda: result.update(last_taken_at=_silent_reader(silent_sock, aborted)))
        silent.start()
        try:
            assert wait_until(lambda: _stalled_count(srv.base_url) == 1, STALL_TIMEOUT_S + 8, 0.02)
            aborted_at = time.monotonic()
        finally:
            aborted.set()
            silent.join(5)
        # Within the timeout + one step, plus the watch period (0.1 s) and
        # this test's polling (scrapes on a shared CPU).
        assert aborted_at - result["last_taken_at"] <= STALL_TIMEOUT_S + STEP_S + 0.6
        # Out of the running batch at once (the slow request may still run).
        assert metric(scrape(srv.base_url), "vllm:num_requests_running") <= 1
        slow.join(30)
        assert slow_out == {"finish": "length", "done": True}
        assert _stalled_count(srv.base_url) == 1  # the slow reader was never aborted
        assert wait_until(lambda: _kv_and_running_idle(srv.base_url), 5)
        silent_sock.close()


def _kv_and_running_idle(base_url: str) -> bool:
    samples = scrape(base_url)
    return (metric(samples, "vllm:num_requests_running") == 0.0
            and metric(samples, "vllm:kv_cache_usage_perc") == 0.0)
