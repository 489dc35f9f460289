"""The server's sockets: what a connection may queue, and the stall abort.

A client that stops reading must not hold a running slot and its KV blocks
until max_tokens. The kernel hides such a client from the server: loopback
send buffers autotune to megabytes, more than a whole output, so the
server's writes keep succeeding long after the reader went quiet. Two
things fix that, per accepted connection:

- Bounded queues. SO_SNDBUF is set (which turns kernel autotuning off for
  the socket) and the transport's write buffer gets a small high-water
  mark, so a connection holds tens of KiB of unread response, not MiB.
- A reader clock. While a response is in flight, the connection is sampled
  every WATCH_PERIOD_S: the bytes the peer's TCP stack has acknowledged
  (TCP_INFO's tcpi_bytes_acked on Linux; elsewhere, the transport buffer
  shrinking) is the reader taking bytes. A connection with bytes waiting
  and no progress for `stall_timeout_s` is aborted: the app sees a
  disconnect, the request is aborted with reason "stalled" and its KV is
  freed within one engine step. A slow reader that keeps taking bytes is
  never aborted, however far behind the engine it falls.

The reader's own receive buffer is the limit of what anyone can see: bytes
its kernel accepted count as taken, so a silent client is aborted
`stall_timeout_s` after its receive buffer filled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# SO_SNDBUF asked of the kernel (Linux doubles it for its bookkeeping): a few
# hundred SSE events, or a 32 KiB JSON body in one write.
SEND_BUFFER_BYTES = 32 * 1024
# The transport's own buffer above which uvicorn's send() waits for a drain.
WRITE_BUFFER_HIGH_BYTES = 32 * 1024
WATCH_PERIOD_S = 0.1
# ASGI scope extension under which a request finds its ConnectionState.
CONNECTION_EXTENSION = "kvserve.connection"

# struct tcp_info (linux/tcp.h), a stable, append-only ABI: the fields read here.
_TCP_INFO_BYTES = 152
_TCPI_UNACKED = struct.Struct("=I")  # segments sent and not acknowledged
_TCPI_UNACKED_OFFSET = 24
_TCPI_BYTES_ACKED = struct.Struct("=Q")
_TCPI_BYTES_ACKED_OFFSET = 120
_TCPI_NOTSENT = struct.Struct("=I")  # bytes queued in the kernel, not yet sent
_TCPI_NOTSENT_OFFSET = 144


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may queue and how long its reader may pause.

    stall_timeout_s: abort a connection whose reader took no bytes for this
      long while response bytes were waiting.
    send_buffer_bytes: SO_SNDBUF; None keeps the kernel's autotuned buffer.
    write_buffer_high_bytes: the transport's high-water mark; None keeps
      the event loop's default (64 KiB).
    """

    stall_timeout_s: float
    send_buffer_bytes: int | None = SEND_BUFFER_BYTES
    write_buffer_high_bytes: int | None = WRITE_BUFFER_HIGH_BYTES

    def __post_init__(self) -> None:
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")


class ReaderSample(NamedTuple):
    """One look at a connection's outgoing side."""

    bytes_acked: int | None  # acknowledged by the peer so far; None where TCP_INFO is missing
    buffered_bytes: int  # in the transport's buffer, not yet handed to the kernel
    in_kernel: bool  # sent and unacknowledged, or queued in the kernel


class StallClock:
    """Decides, from periodic samples, whether a reader has stalled: bytes
    are waiting for it and it took none for `timeout_s`. Pure: time comes
    in with each sample."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._progress_at: float | None = None  # last time the reader took bytes (or first wait)
        self._last: ReaderSample | None = None

    def stalled(self, now: float, sample: ReaderSample) -> bool:
        waiting = sample.buffered_bytes > 0 or sample.in_kernel
        if not waiting:
            self._progress_at = None  # the reader has everything: nothing to time
        elif self._progress_at is None or self._took_bytes(sample):
            self._progress_at = now
        self._last = sample
        return self._progress_at is not None and now - self._progress_at >= self.timeout_s

    def _took_bytes(self, sample: ReaderSample) -> bool:
        last = self._last
        if last is None:
            return True
        if sample.bytes_acked is not None and last.bytes_acked is not None:
            return sample.bytes_acked > last.bytes_acked
        # Without TCP_INFO: the kernel took some of the transport's buffer.
        return sample.buffered_bytes < last.buffered_bytes


class ConnectionState:
    """Shared by every request on one connection (the ASGI scope extension
    CONNECTION_EXTENSION): whether it was aborted for a stalled reader."""

    def __init__(self) -> None:
        self.stalled = False


def reader_stalled(scope: dict[str, Any] | None) -> bool:
    """True when this request's connection was aborted for a stalled reader."""
    state = ((scope or {}).get("extensions") or {}).get(CONNECTION_EXTENSION)
    return bool(state is not None and state.stalled)


def sample_connection(transport: asyncio.Transport) -> ReaderSample:
    buffered = transport.get_write_buffer_size()
    info = _tcp_info(transport.get_extra_info("socket"))
    if info is None:
        return ReaderSample(None, buffered, False)
    acked = _TCPI_BYTES_ACKED.unpack_from(info, _TCPI_BYTES_ACKED_OFFSET)[0]
    unacked = _TCPI_UNACKED.unpack_from(info, _TCPI_UNACKED_OFFSET)[0]
    notsent = _TCPI_NOTSENT.unpack_from(info, _TCPI_NOTSENT_OFFSET)[0]
    return ReaderSample(acked, buffered, unacked > 0 or notsent > 0)


def _tcp_info(sock) -> bytes | None:
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    return info if len(info) >= _TCP_INFO_BYTES else None  # a kernel too old for these fields


def bound_connection(transport: asyncio.Transport, limits: ConnectionLimits) -> None:
    """Apply the queue bounds to a freshly accepted connection."""
    if limits.write_buffer_high_bytes is not None:
        transport.set_write_buffer_limits(high=limits.write_buffer_high_bytes)
    sock = transport.get_extra_info("socket")
    if limits.send_buffer_bytes is not None and sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
        except OSError:  # not a socket that takes it (a pipe in a test harness): keep going
            log.debug("could not set SO_SNDBUF", exc_info=True)


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded queues and the stall clock."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.connection_state = ConnectionState()
        self._clock: StallClock | None = None
        self._tick: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        bound_connection(transport, self.limits)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watch()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions = self.scope.setdefault("extensions", {})  # type: ignore[typeddict-item]
        extensions[CONNECTION_EXTENSION] = self.connection_state

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._tick is None:
            self._clock = StallClock(self.limits.stall_timeout_s)
            self._tick = self.loop.call_later(WATCH_PERIOD_S, self._watch)

    def _watch(self) -> None:
        self._tick = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._clock is None:
            return
        if not self._response_in_flight():
            return  # idle keep-alive: the next request restarts the clock
        if self._clock.stalled(self.loop.time(), sample_connection(transport)):
            self.connection_state.stalled = True
            log.info("aborting connection from %s: its reader took no bytes for %.1f s",
                     self.client, self.limits.stall_timeout_s)
            transport.abort()
            return
        self._tick = self.loop.call_later(WATCH_PERIOD_S, self._watch)

    def _response_in_flight(self) -> bool:
        cycle = self.cycle
        return (cycle is not None and not cycle.response_complete) or self.transport.get_write_buffer_size() > 0

    def _stop_watch(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits, **options) -> uvicorn.Config:
    """uvicorn's Config for kvserve: every accepted connection bounded and watched."""
    protocol = functools.partial(BoundedHttpProtocol, limits=limits)
    return uvicorn.Config(app, host=host, port=port, http=protocol, **options)  # type: ignore[arg-type]
