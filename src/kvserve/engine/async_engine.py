"""The engine loop off the event loop: a background thread steps EngineCore
and drives admission while asyncio serves HTTP.

Why a thread and not a process: torch releases the GIL inside its kernels,
so the HTTP layer runs while a step computes; a process would add a copy of
every output across a pipe and a second model load. The cost is that Python
work on the event loop (tokenizing, JSON) competes for the GIL with the
engine's own Python between kernels; docs/performance.md records the
measurement.

Threading contract: only the engine thread touches EngineCore, its scheduler
and KV cache, and it alone makes admission decisions. The event loop talks to
it through a command queue (add, abort), consumed between steps, so an abort
frees KV within one step. An added request's prefix-cache lookup, its
admission decision and its entry into the scheduler happen together on the
engine thread; the decision comes back as the first item of the request's
stream. The one admission question the event loop asks itself is the cheap
early refusal (`early_refusal`, before tokenizing under overload), under
`admission_lock`, which the engine thread holds around its own admission
calls and never during a step (a reentrant lock: an expiry's abort reports
to admission from inside before_step). Results come back with
`loop.call_soon_threadsafe`, and every callback (`on_step`) runs on the
event loop thread.

Each turn of the engine thread drives the admission loop in the order a
simulated replica does (admission/loop.py), so the server and the simulator
make the same decisions and set the same step limits step for step:
commands (arrivals decided, aborts) -> before_step (expiry, this step's
limits) -> step -> on_scheduled -> the commands that came during the step
-> on_step_end and the step's finishes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.admission.decision import AdmissionDecision, QueueWait, Reason
from kvserve.admission.loop import AdmissionLoop
from kvserve.admission.step_limits import StepLimits
from kvserve.admission.warm_up import MeasuredStep, warm_up
from kvserve.contract import Request, RequestTimestamps
from kvserve.engine.core import EngineCore
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.speculative import SpecDecodeCounts
from kvserve.scheduler.scheduler import SchedulerOutput, SchedulerStats

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps between command checks
# The abort_reason of every request the engine had when it failed.
ENGINE_FAILED = "engine_failed"


@dataclass(frozen=True)
class Finished:
    """The end of one request, whatever ended it (sent once per request)."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    num_output_tokens: int
    timestamps: RequestTimestamps
    abort_reason: str | None = None  # why it was aborted (disconnect, stalled, queue_timeout, ...)
    error: str | None = None  # the engine refused or failed it
    num_prompt_tokens: int = 0
    # Who asked and what it cost, for the SLO counters and the trace.
    priority: int = 0
    tenant: str = "default"
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    num_preemptions: int = 0
    # The request's own lists (not copies), for a request log that shows text.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepReport:
    """What one engine step did, delivered on the event loop."""

    step_s: float
    num_decode_seqs: int  # chunks that were decodes (ScheduledChunk.is_decode)
    num_prefill_tokens: int  # every other token of the step
    finished: list[Finished]
    stats: SchedulerStats | None  # after the step
    limits: StepLimits | None = None  # what admission limited the step to (None: no admission)
    queue_waits: list[QueueWait] = field(default_factory=list)  # of the requests the step started
    spec_decode: SpecDecodeCounts | None = None  # the step's draft verifications (None: speculation off)
    # After the step: each running and waiting request's tokens (prompt +
    # output so far), and the requests deferred outside the scheduler (a
    # grammar compiling).
    running_context_tokens: list[int] = field(default_factory=list)
    waiting_context_tokens: list[int] = field(default_factory=list)
    num_deferred: int = 0


@dataclass
class RequestStream:
    """One request's outputs, read on the event loop: with admission, its
    AdmissionDecision first (a refusal ends the stream), then RequestOutputs,
    then the Finished record. The buffer holds at most the request's own
    outputs (bounded by max_tokens); a client that stops reading is caught
    at its connection (server/transport.py), not by blocking the engine."""

    request_id: str
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: Finished | None = None

    async def next(self) -> object:
        """The next item: the decision, a RequestOutput, or the Finished record."""
        return await self.items.get()

    def ready(self) -> list:
        """Every item already delivered, without waiting (possibly none):
        lets a reader that fell behind catch up in one go."""
        items = []
        while not self.items.empty():
            items.append(self.items.get_nowait())
        return items

    def put(self, item: object) -> None:
        """Event loop only: deliver one item."""
        self.items.put_nowait(item)


class AsyncEngine:
    """Runs `core.step()` and the admission loop in a thread; per-request
    streams on the event loop."""

    def __init__(self, core: EngineCore, admission: AdmissionLoop | None = None,
                 on_step: Callable[[StepReport], None] | None = None,
                 on_scheduled: Callable[[SchedulerOutput], None] | None = None,
                 on_decision: Callable[[str, AdmissionDecision], None] | None = None) -> None:
        """on_step: each step's report, on the event loop. on_scheduled: each
        step's batch, on the engine thread right after the step (tracing's
        prefill chunks); None costs nothing. on_decision: each request's
        admission decision, on the event loop as it is delivered, so always
        before the on_step that reports the request finished (a stream's
        reader may see the decision only after that)."""
        self.core = core
        self.admission = admission
        self._on_scheduled = on_scheduled
        self._on_decision = on_decision
        self.admission_lock = threading.RLock()
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, RequestStream] = {}  # event loop thread only
        self._requests: dict[str, Request] = {}  # engine thread only: added and not yet finished
        self.dead: str | None = None  # set when the engine loop crashed

    # ---- event loop side ---------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run `fn()` on the engine thread between two steps (the only thread
        that may touch the core) and return its result, or raise its error.
        Before start() there is no engine thread: it runs here."""
        if self._thread is None:
            return fn()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return await future

    def warm_up(self, num_steps: int = 12, max_decode_seqs: int = 16,
                time_budget_s: float = 10.0) -> list[MeasuredStep]:
        """Before `start`: time throwaway steps (admission/warm_up.py) and feed
        them to admission, so the step-time fit exists before the first
        real request. Returns the measured steps."""
        if self._thread is not None:
            raise RuntimeError("warm_up() must run before start()")
        steps = warm_up(self.core, num_steps, max_decode_seqs, time_budget_s)
        if self.admission is not None:
            with self.admission_lock:
                self.admission.on_steps_end(steps)
        return steps

    def add(self, request: Request, is_retry: bool = False) -> RequestStream:
        """Queue `request` for admission and the engine; returns its stream."""
        if self.dead:
            raise RuntimeError(f"engine is not running: {self.dead}")
        stream = RequestStream(request.request_id)
        self.streams[request.request_id] = stream
        self._send("add", (request, is_retry))
        return stream

    def abort(self, request_id: str, reason: str) -> None:
        """Abort a request (any state); its KV is freed within one step and its
        stream ends with Finished(finish_reason="abort", abort_reason=reason)."""
        if request_id in self.streams:
            self._send("abort", (request_id, reason))

    def early_refusal(self, priority: int, tenant: str, is_retry: bool,
                      deadline: float | None) -> AdmissionDecision | None:
        """The refusal every request of this class would get now, whatever its
        size (AdmissionLoop.refusal_for_any_size); None without admission."""
        if self.admission is None:
            return None
        with self.admission_lock:
            return self.admission.refusal_for_any_size(priority, tenant, is_retry, deadline)

    def retry_after_s(self, earliest_s: float | None = None, priority: int = 0,
                      tenant: str = "default") -> int | None:
        """Retry-After for a request turned away now (AdmissionLoop.retry_after_s);
        None without admission."""
        if self.admission is None:
            return None
        with self.admission_lock:
            return self.admission.retry_after_s(earliest_s, priority, tenant)

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

    def _deliver_decision(self, request_id: str, decision: AdmissionDecision) -> None:
        """Event loop: the decision goes first; a refusal ends the stream."""
        if self._on_decision is not None:
            try:
                self._on_decision(request_id, decision)
            except Exception:  # an observer must not lose the request
                log.exception("on_decision callback failed")
        stream = self.streams.get(request_id)
        if stream is None:
            return
        if not decision.admitted:
            del self.streams[request_id]
        stream.put(decision)

    def _deliver(self, outputs: list[RequestOutput], report: StepReport) -> None:
        """Event loop: fan outputs to streams, end finished streams, report."""
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        for done in report.finished:
            stream = self.streams.pop(done.request_id, None)
            if stream is not None:
                stream.finished = done
                stream.put(done)
        if self._on_step is not None:
            try:
                self._on_step(report)
            except Exception:  # a metrics bug must not take the engine down
                log.exception("on_step callback failed")

    # ---- engine thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.run_once():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as exc:  # the engine is broken: fail every stream honestly
            log.exception("engine loop crashed")
            self.dead = f"{type(exc).__name__}: {exc}"
            self._post_fn(self._fail_all)

    def run_once(self) -> bool:
        """One turn of the engine thread (see the module docstring): the
        commands that came, then one step if anything is unfinished. False
        when there was nothing to step."""
        finished = self._run_commands()
        if not self.core.has_unfinished():
            if finished:
                self._post([], self._report(0.0, 0, 0, finished, None))
            return False
        limits = self._before_step(finished)
        clock = self.core.clock
        started_s = clock()
        result = self.core.step()
        step_s = clock() - started_s
        if self._on_scheduled is not None:
            self._on_scheduled(result.scheduled)
        # Requests that outgrew the whole cache ended while the step was
        # scheduled: they end first, as in a simulated replica.
        outgrown = {r.request_id for r in result.scheduled.finished}
        finished += self._finish([o for o in result.outputs if o.request_id in outgrown])
        queue_waits: list[QueueWait] = []
        if self.admission is not None:
            with self.admission_lock:
                queue_waits = self.admission.on_scheduled(result.started_ids, result.scheduled.scheduled_at)
        finished += self._run_commands()  # decided as of the step's start, as the simulator does
        if self.admission is not None:
            with self.admission_lock:
                self.admission.on_step_end(result.num_decode_seqs, result.num_prefill_tokens, step_s,
                                           result.captured_graph)
        finished += self._finish([o for o in result.outputs if o.finished and o.request_id not in outgrown])
        self._post(result.outputs, self._report(step_s, result.num_decode_seqs, result.num_prefill_tokens,
                                                finished, limits, queue_waits, result.spec_decode))
        return True

    def _report(self, step_s: float, num_decode_seqs: int, num_prefill_tokens: int,
                finished: list[Finished], limits: StepLimits | None,
                queue_waits: list[QueueWait] | None = None,
                spec_decode: SpecDecodeCounts | None = None) -> StepReport:
        """The step's report with the scheduler's state after it."""
        running, waiting = self.core.context_lengths()
        return StepReport(step_s, num_decode_seqs, num_prefill_tokens, finished, self.core.stats(), limits,
                          queue_waits or [], spec_decode, running, waiting, self.core.num_deferred)

    def _before_step(self, finished: list[Finished]) -> StepLimits | None:
        """Expired requests aborted (their Finished records join `finished`),
        then the limits the step is built under."""
        if self.admission is None:
            return None

        def expire(request_id: str, reason: Reason) -> None:
            finished.extend(self._abort(request_id, reason))

        with self.admission_lock:
            limits = self.admission.before_step(self.core.num_running, expire, self.core.scheduler)
        self.core.set_step_limits(limits)
        return limits

    def _finish(self, outputs: list[RequestOutput]) -> list[Finished]:
        """The Finished records of these final outputs, reported to admission."""
        finished = [self._finished(o, o.finish_reason or "stop") for o in outputs]
        for done in finished:
            self._admission_finished(done.request_id, done.num_prompt_tokens + done.num_output_tokens)
        return finished

    def _run_commands(self) -> list[Finished]:
        finished: list[Finished] = []
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return finished
            if kind == "add":
                finished.extend(self._add(*payload))
            elif kind == "abort":
                finished.extend(self._abort(*payload))
            elif kind == "call":
                self._call(*payload)

    def _call(self, fn: Callable[[], object], future: asyncio.Future) -> None:
        try:
            result = fn()
        except Exception as exc:  # the caller's error, not the engine's
            self._post_fn(_settle, future, None, exc)
            return
        self._post_fn(_settle, future, result, None)

    def _add(self, request: Request, is_retry: bool) -> list[Finished]:
        """Decide (on the prefix hit the engine's own cache gives), then add."""
        if self.admission is not None:
            num_cached_tokens = self.core.prefix_hit_tokens(request)
            with self.admission_lock:
                decision = self.admission.decide(request, num_cached_tokens, is_retry,
                                                 self.core.scheduler.num_evicted_blocks)
            self._post_fn(self._deliver_decision, request.request_id, decision)
            if not decision.admitted:
                return []
        try:
            self.core.add_request(request)
        except ValueError as exc:  # the engine refuses it (too long for the cache, ...)
            self._admission_finished(request.request_id, None)
            return [Finished(request.request_id, "abort", 0, request.timestamps, error=str(exc),
                             num_prompt_tokens=request.num_prompt_tokens, priority=request.priority,
                             tenant=request.tenant)]
        self._requests[request.request_id] = request
        return []

    def _abort(self, request_id: str, reason: str) -> list[Finished]:
        output = self.core.abort(request_id)
        if output is None:
            return []  # already finished: its Finished record is on its way
        done = self._finished(output, "abort", reason)
        self._admission_finished(request_id, done.num_prompt_tokens + done.num_output_tokens)
        return [done]

    def _finished(self, output: RequestOutput, finish_reason: str, abort_reason: str | None = None) -> Finished:
        """The Finished record of a request's final output (the request leaves `_requests`)."""
        request = self._requests.pop(output.request_id, None)
        if request is None:
            return Finished(output.request_id, finish_reason, len(output.token_ids), output.timestamps,
                            abort_reason, num_prompt_tokens=len(output.prompt_token_ids))
        return Finished(output.request_id, finish_reason, len(output.token_ids), output.timestamps, abort_reason,
                        num_prompt_tokens=len(output.prompt_token_ids), priority=request.priority,
                        tenant=request.tenant, num_cached_tokens=request.num_cached_tokens,
                        num_preemptions=request.num_preemptions, prompt_token_ids=output.prompt_token_ids,
                        output_token_ids=output.token_ids)

    def _admission_finished(self, request_id: str, num_tokens: int | None) -> None:
        if self.admission is not None:
            with self.admission_lock:
                self.admission.on_finished(request_id, num_tokens)

    def _post(self, outputs: list[RequestOutput], report: StepReport) -> None:
        self._post_fn(self._deliver, outputs, report)

    def _post_fn(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _fail_all(self) -> None:
        """Event loop, once the engine thread died: every stream it had (in
        the failed step, waiting, or not yet decided) ends with the error;
        `add` refuses from now on, so no stream is left without an end."""
        for rid, stream in list(self.streams.items()):
            done = Finished(rid, "abort", 0, RequestTimestamps(arrival=0.0), abort_reason=ENGINE_FAILED,
                            error=f"engine failed: {self.dead}")
            stream.finished = done
            stream.put(done)
        self.streams.clear()


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
