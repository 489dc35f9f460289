"""The engine loop off the event loop: a background thread steps EngineCore
while asyncio serves HTTP.

Why a thread and not a process: torch releases the GIL inside its kernels,
so the HTTP layer runs while a step computes; a process would add a copy of
every output across a pipe and a second model load. The cost is that Python
work on the event loop (tokenizing, JSON) competes for the GIL with the
engine's own Python between kernels; docs/performance.md records the
measurement.

Threading contract: only the engine thread touches EngineCore and its
scheduler. The event loop talks to it through a command queue (add, abort,
set the step limits), consumed at the top of every step, so an abort frees
KV within one step. Results come back with `loop.call_soon_threadsafe`, and
every callback (`on_step`) runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.contract import Request, RequestTimestamps

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps between command checks


@dataclass(frozen=True)
class Finished:
    """The end of one request, whatever ended it (sent once per request)."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    num_output_tokens: int
    timestamps: RequestTimestamps
    abort_reason: str | None = None  # why it was aborted (disconnect, stalled, queue_timeout, ...)
    error: str | None = None  # the engine refused or failed it


@dataclass
class StepReport:
    """What one engine step did, delivered on the event loop."""

    step_s: float
    num_decode_seqs: int  # chunks that were decodes (ScheduledChunk.is_decode)
    num_prefill_tokens: int  # every other token of the step
    started_ids: list[str]
    finished: list[Finished]
    stats: object | None  # SchedulerStats after the step


@dataclass
class RequestStream:
    """One request's outputs, read on the event loop. The buffer holds at
    most the request's own outputs (bounded by max_tokens); a consumer that
    stops reading is caught by the stall watchdog, not by blocking the engine."""

    request_id: str
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_progress: float = field(default_factory=time.monotonic)
    finished: Finished | None = None

    async def next(self) -> object:
        """The next RequestOutput, or the Finished record that ends the stream."""
        item = await self.items.get()
        self.last_progress = time.monotonic()
        return item

    def _put(self, item: object) -> None:
        if self.items.empty():
            self.last_progress = time.monotonic()  # a stall counts from the first unread item
        self.items.put_nowait(item)


class AsyncEngine:
    """Runs `core.step()` in a thread; per-request streams on the event loop."""

    def __init__(self, core, on_step: Callable[[StepReport], None] | None = None) -> None:
        self.core = core
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, RequestStream] = {}  # event loop thread only
        self._pending_start: set[str] = set()  # engine thread only
        self.dead: str | None = None  # set when the engine loop crashed

    # ---- event loop side ---------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> RequestStream:
        """Queue `request` for the engine; returns its output stream."""
        if self.dead:
            raise RuntimeError(f"engine is not running: {self.dead}")
        stream = RequestStream(request.request_id)
        self.streams[request.request_id] = stream
        self._send("add", request)
        return stream

    def abort(self, request_id: str, reason: str) -> None:
        """Abort a request (any state); its KV is freed within one step and its
        stream ends with Finished(finish_reason="abort", abort_reason=reason)."""
        if request_id in self.streams:
            self._send("abort", (request_id, reason))

    def set_step_limits(self, max_running: int, max_batched_tokens: int | None) -> None:
        """Scheduler.set_step_limits, applied before the next step."""
        self._send("limits", (max_running, max_batched_tokens))

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def stalled(self, now: float, timeout_s: float) -> list[str]:
        """Streams whose reader took nothing for `timeout_s` while output waited."""
        return [rid for rid, s in self.streams.items()
                if s.finished is None and not s.items.empty() and now - s.last_progress > timeout_s]

    async def stop(self) -> None:
        """Stop the engine thread (callers drain or abort requests first)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def _send(self, kind: str, payload: object) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _deliver(self, outputs: list, report: StepReport) -> None:
        """Event loop: fan outputs to streams, end finished streams, report."""
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream._put(output)
        for done in report.finished:
            stream = self.streams.pop(done.request_id, None)
            if stream is not None:
                stream.finished = done
                stream._put(done)
        if self._on_step is not None:
            try:
                self._on_step(report)
            except Exception:  # a metrics bug must not take the engine down
                log.exception("on_step callback failed")

    # ---- engine thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                finished = self._run_commands()
                if not self.core.has_unfinished():
                    if finished:
                        self._post([], StepReport(0.0, 0, 0, [], finished, self._stats()))
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._step(finished)
        except Exception as exc:  # the engine is broken: fail every stream honestly
            log.exception("engine loop crashed")
            self.dead = f"{type(exc).__name__}: {exc}"
            self._post_fn(self._fail_all)

    def _step(self, finished: list[Finished]) -> None:
        t0 = time.perf_counter()
        outputs = self.core.step()
        step_s = time.perf_counter() - t0
        started = [rid for rid in self._pending_start if self._is_started(rid)]
        self._pending_start.difference_update(started)
        for output in outputs:
            if output.finished:
                self._pending_start.discard(output.request_id)
                finished.append(Finished(output.request_id, output.finish_reason or "stop",
                                         len(output.token_ids), output.timestamps))
        last = self.core.last_scheduled
        report = StepReport(step_s, last.num_decode_seqs, last.num_prefill_tokens,
                            started, finished, self._stats())
        self._post(outputs, report)

    def _run_commands(self) -> list[Finished]:
        finished: list[Finished] = []
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return finished
            if kind == "add":
                finished.extend(self._add(payload))
            elif kind == "abort":
                finished.extend(self._abort(*payload))
            elif kind == "limits":
                self.core.scheduler.set_step_limits(*payload)

    def _add(self, request: Request) -> list[Finished]:
        try:
            self.core.add_request(request)
        except ValueError as exc:  # the engine refuses it (too long for the cache, ...)
            return [Finished(request.request_id, "abort", 0, request.timestamps, error=str(exc))]
        self._pending_start.add(request.request_id)
        return []

    def _abort(self, request_id: str, reason: str) -> list[Finished]:
        request = self.core.scheduler.get_request(request_id)
        if request is None:
            return []  # already finished: its Finished record is on its way
        self.core.abort(request_id)
        self._pending_start.discard(request_id)
        return [Finished(request_id, "abort", request.num_output_tokens, request.timestamps,
                         abort_reason=reason)]

    def _is_started(self, request_id: str) -> bool:
        request = self.core.scheduler.get_request(request_id)
        return request is not None and request.timestamps.scheduled is not None

    def _stats(self):
        return self.core.scheduler.stats()

    def _post(self, outputs: list, report: StepReport) -> None:
        self._post_fn(self._deliver, outputs, report)

    def _post_fn(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _fail_all(self) -> None:
        for rid, stream in list(self.streams.items()):
            done = Finished(rid, "abort", 0, RequestTimestamps(arrival=0.0), error=f"engine failed: {self.dead}")
            stream.finished = done
            stream._put(done)
        self.streams.clear()
