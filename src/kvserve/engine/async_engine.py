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
from typing import NamedTuple

from kvserve.contract import Request, RequestTimestamps, SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps between command checks
# Prefix-cache namespace of warm-up requests: no served request hashes into
# it, so nothing a warm-up computes can ever be a real prefix hit.
WARM_UP_NAMESPACE = "kvserve-warm-up"
# Prefill lengths of the warm-up's chunks, as shares of the prefill room; the
# order mixes long and short chunks so prefill tokens do not grow with the
# number of decodes beside them (the fit must tell the two factors apart).
WARM_UP_PREFILL_SHARES = (0.125, 1.0, 0.25, 0.5, 0.0625, 0.75)
# Share of the KV cache the warm-up may hold at once.
WARM_UP_KV_SHARE = 0.75
# The longest warm-up prefill chunk should span at least this many blocks.
WARM_UP_MIN_PREFILL_BLOCKS = 4


class MeasuredStep(NamedTuple):
    """One timed engine step: its shape and its wall time."""

    num_decode_seqs: int
    num_prefill_tokens: int
    step_s: float


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
    captured_graph: bool = False  # step_s includes a one-off CUDA graph capture


@dataclass
class RequestStream:
    """One request's outputs, read on the event loop. The buffer holds at
    most the request's own outputs (bounded by max_tokens); a client that
    stops reading is caught at its connection (server/transport.py), not by
    blocking the engine."""

    request_id: str
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: Finished | None = None

    async def next(self) -> object:
        """The next RequestOutput, or the Finished record that ends the stream."""
        return await self.items.get()

    def ready(self) -> list:
        """Every item already delivered, without waiting (possibly none):
        lets a reader that fell behind catch up in one go."""
        items = []
        while not self.items.empty():
            items.append(self.items.get_nowait())
        return items

    def _put(self, item: object) -> None:
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

    def warm_up(self, num_steps: int = 12, max_decode_seqs: int = 16,
                time_budget_s: float = 10.0) -> list[MeasuredStep]:
        """Before `start`: run throwaway requests through the engine and time
        at least `num_steps` steps of varied shapes, so the step-time fit
        exists before the first real request (a cold server would otherwise
        admit a burst on guesses). The ramp adds one request per step (decode
        batches of 0..N-1 sequences beside prefill chunks of varied length,
        N <= max_decode_seqs), then decode-only steps at N and N/2 sequences.
        One unmeasured step first pays one-time costs (allocation, kernel
        selection). The ramp stops early past half of `time_budget_s`.

        Leaves no trace: the requests are aborted, their prefix-cache entries
        dropped, and the prefix-cache and preemption totals restored, so KV
        usage and every counter start at zero."""
        if self._thread is not None:
            raise RuntimeError("warm_up() must run before start()")
        scheduler, kv = self.core.scheduler, self.core.scheduler.kv_cache
        totals = (kv.prefix_cache_queries, kv.prefix_cache_hits, scheduler.num_preemptions)
        plan = _WarmUpPlan(self.core, num_steps, max_decode_seqs)
        added: list[str] = []
        measured: list[MeasuredStep] = []
        try:
            self._warm_up_add(plan, added)
            self.core.step()  # unmeasured: one-time costs
            deadline = time.perf_counter() + time_budget_s / 2
            while len(added) < plan.num_seqs and time.perf_counter() < deadline:
                self._warm_up_add(plan, added)
                self._timed_step(measured)
            for i in range(max(plan.num_decode_steps, num_steps - len(measured))):
                if i == plan.num_decode_steps // 2:  # halve the batch for a second decode size
                    for request_id in added[len(added) // 2 + 1:]:
                        self.core.abort(request_id)
                self._timed_step(measured)
        finally:
            for request_id in added:
                self.core.abort(request_id)
            kv.pool.reset_prefix_cache()
            kv.prefix_cache_queries, kv.prefix_cache_hits, scheduler.num_preemptions = totals
        return measured

    def _warm_up_add(self, plan: "_WarmUpPlan", added: list[str]) -> None:
        index = len(added)
        request = Request(f"warm-up-{index}", plan.prompt(index), plan.params, arrival_time=self.core.clock(),
                          cache_namespace=WARM_UP_NAMESPACE)
        self.core.add_request(request)
        added.append(request.request_id)

    def _timed_step(self, measured: list[MeasuredStep]) -> None:
        """One step, appended to `measured` unless it paid a one-off graph capture."""
        t0 = time.perf_counter()
        self.core.step()
        step_s = time.perf_counter() - t0
        if not self.core.last_step_captured:
            last = self.core.last_scheduled
            measured.append(MeasuredStep(last.num_decode_seqs, last.num_prefill_tokens, step_s))

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

    def set_step_limits(self, max_running: int, max_batched_tokens: int | None,
                        cap_idle_steps: bool = True) -> None:
        """Scheduler.set_step_limits, applied before the next step."""
        self._send("limits", (max_running, max_batched_tokens, cap_idle_steps))

    @property
    def num_streams(self) -> int:
        return len(self.streams)

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
                            started, finished, self._stats(), self.core.last_step_captured)
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


class _WarmUpPlan:
    """Sizes of the warm-up: how many sequences, their prompts and outputs,
    within the engine's batch, token budget, context and a share of its KV."""

    def __init__(self, core, num_steps: int, max_decode_seqs: int) -> None:
        scheduler = core.scheduler
        block_size = scheduler.kv_cache.block_size
        self.num_decode_steps = 4
        num_seqs = max(1, min(scheduler.config.max_num_seqs, max_decode_seqs))
        # Every request outlives the warm-up: one token per step it is in.
        max_tokens = num_seqs + max(self.num_decode_steps, num_steps) + 2
        kv_tokens = int(scheduler.kv_cache.num_blocks * WARM_UP_KV_SHARE) * block_size
        while True:
            step_room = scheduler.config.max_num_batched_tokens - num_seqs
            room = min(step_room, core.max_model_len - max_tokens - 1,
                       kv_tokens // num_seqs - max_tokens - block_size)  # a block of rounding each
            # Fewer sequences rather than prefill chunks too short to measure.
            if room >= min(step_room, WARM_UP_MIN_PREFILL_BLOCKS * block_size) or num_seqs == 1:
                break
            num_seqs //= 2
            max_tokens = num_seqs + max(self.num_decode_steps, num_steps) + 2
        self.num_seqs = num_seqs
        self.room = max(1, room)
        self.vocab_size = core.model_config.vocab_size
        self.params = SamplingParams(max_tokens=max(1, max_tokens), temperature=0.0, ignore_eos=True)

    def prompt(self, index: int) -> list[int]:
        share = WARM_UP_PREFILL_SHARES[index % len(WARM_UP_PREFILL_SHARES)]
        length = max(1, int(self.room * share))
        # Distinct tokens per request: no warm-up prompt is a prefix hit on another.
        return [(index * 7919 + j * 31 + 1) % self.vocab_size for j in range(length)]
