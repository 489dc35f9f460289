"""Multi-step decode for the simulator: a steady pure-decode batch advances
several steps with Python work per block boundary and per finish instead of
per sequence per step, leaving exactly the state single schedule() /
update() steps leave (tests/test_sim_decode_run.py), since every simulated
step samples one known token. vLLM's multi-step scheduling, for a caller
that knows the tokens.

`plan_decode_run` asks the scheduler whether its batch is steady and plans
a `DecodeRun`; the run then drives the real scheduler's public calls
(`steps_until_stop`, `stop_status`, `finish`, `start_waiting`) and the KV
cache manager's one-block calls (`append_block`, `cache_next_block`). An
arrival is started beside the run's decodes (`schedule_step_with_waiting`)
and joins the run once it decodes (`extend`). The engine never uses it; it
keeps schedule() / update().

A replica (sim/replica.py) keeps the run it has in flight as an `ActiveRun`
(where its steps stand, when they end) and sizes its runs by `RunLengths`.

Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from typing import Final

from kvserve.contract import Request, RequestStatus
from kvserve.scheduler.scheduler import URGENCY, ScheduledChunk, Scheduler, SchedulerOutput

_RUNNING: Final = RequestStatus.RUNNING

# Decode run lengths: a run ended early (the next arrival at its replica)
# wastes the planning of its remaining steps, one ended by its length costs
# a new plan of the whole batch (far more than a step). Each replica plans
# about three times the mean of the steps its runs used (a moving average:
# the gaps between arrivals vary too much to follow the last one) and times
# them (a cost-model call per step) a stretch of about three quarters of
# that mean at a time, within these bounds.
MIN_RUN_STEPS: Final = 8
MAX_RUN_STEPS: Final = 512
RUN_LENGTH_DECAY: Final = 0.8


def plan_decode_run(scheduler: Scheduler, max_steps: int, token_id: int) -> DecodeRun | None:
    """Up to `max_steps` decode steps of the running batch as one
    `DecodeRun`, when every step samples `token_id` and nothing inside
    the scheduler can change those steps' decisions: no request waits
    (none could start), every running request decodes (no prefill
    left), the token budget holds the whole batch, and each step's new
    blocks surely fit (the run stops before the first step that might
    preempt). The caller must keep each step's token budget >= the
    running batch, must not abort a request or change limits during the
    run (end it first with `in_flight_output`), and after adding a
    request must end the run with the step in flight (`update_step`,
    then `close`): adding only queues it. None when not steady. No
    state change."""
    if max_steps < 1 or not scheduler.running or len(scheduler.waiting) \
            or len(scheduler.running) > scheduler.max_batched_tokens:
        return None
    batch = sorted(scheduler.running.values(), key=URGENCY)
    starts = [r.num_computed_tokens for r in batch]
    # Steady: each request has only its last sampled token left to run
    # (list comparisons in C: this runs at every step start).
    if [len(r.prompt_token_ids) + len(r.output_token_ids) for r in batch] != [s + 1 for s in starts]:
        return None
    run = DecodeRun(scheduler, batch, starts, token_id, max_steps)
    return run if run.num_steps > 0 else None


def _key_stride(num_requests: int) -> int:
    """The N of a decode run's event keys for `num_requests` requests: room
    for as many newcomers again, so `extend` appends the keys of requests
    joining the run and renumbers the others only when the run's requests
    outgrow it (a Python pass over every key)."""
    return 2 * num_requests


class DecodeRun:
    """Several consecutive steps of an unchanging pure-decode batch, applied
    with Python work per event (a block boundary, a finish) instead of per
    running request per step: vLLM's multi-step scheduling, for callers that
    know every step samples the same token (the simulator).

    Made only by `plan_decode_run`, when nothing can change the
    next `num_steps` decisions. Drive it as the engine drives a step, in
    order, for i = 0, 1, ...: `schedule_step(i)` when step i starts, then
    `update_step(i, now)` when it ends. After each call the KV cache (block
    tables, prefix-cache registrations, free and evictable blocks), the
    running set and every finished request are exactly what schedule() /
    update() would have left. `apply_steps` does the same for a stretch of
    steps whose end times are known, visiting only the steps with events.
    The progress of a request with no finish in a step (num_computed_tokens,
    output tokens, token timestamps) lags until `in_flight_output` or
    `close` brings every request up to date; a block it completes is
    registered without it, since the block's tokens past the request's
    known ones are all the run's token.

    Requests that arrive end the batch's steadiness, not the run: the step
    after their arrival can start them beside the run's decodes
    (`schedule_step_with_waiting`, then the ordinary update() for their
    chunks), and once they decode `extend` takes them into the run, which
    goes on without a new plan of the whole batch.

    The events are one sorted list of integer keys, built from ranges (no
    Python loop per event while planning): with N above every request's
    index, request i's allocation for step s is key (2s - 1) * N + i, its
    update at step s (a completed block, a finish) key 2s * N + i.
    Ascending keys are the order single steps run them in: schedule(s)
    allocates in batch order, update(s) registers and finishes in batch
    order, then schedule(s + 1).
    """

    def __init__(self, scheduler: Scheduler, batch: list[Request], starts: list[int], token_id: int,
                 max_steps: int) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv_cache
        self._token_id = token_id
        self.requests = batch  # schedule()'s chunk order: most urgent first
        self._start = starts  # each request's num_computed_tokens when the run starts
        self._synced = [0] * len(batch)  # steps applied to each request's fields
        self.end_times: list[float] = []  # of the steps updated so far
        # Per request: the step that ends it (may lie past the run).
        self._last_step = [scheduler.steps_until_stop(r, token_id) - 1 for r in batch]
        self._events: list[int] = []  # ascending keys (see the class docstring)
        self._n = _key_stride(len(batch))  # the N of the keys
        # Blocks each request finishing inside the run surely frees: only its
        # blocks from this run are surely its alone (shared prefix blocks
        # may stay held), a lower bound.
        self._freed = [0] * len(batch)
        self._num_allocations = 0  # allocation events planned (at least those left)
        max_steps = min(max_steps, max(self._last_step) + 1)  # no step after the batch is done
        self._add_events(range(len(batch)), 0, max_steps)
        self._events.sort()
        self.num_steps = self._steps_that_fit(max_steps)
        self._finish_steps = sorted(last for last in self._last_step if last < self.num_steps)
        # Per step: decoding sequences (step_shapes adds the KV tokens read).
        self.num_seqs: list[int] = []
        self._stretches: list[tuple[int, int, int, int]] = []  # (first, last step, sequences, context)
        self._describe_steps(0)

    def _add_events(self, indexes: range, first_step: int, max_steps: int) -> None:
        """Append the events of requests `indexes` from step `first_step` to
        the run's last (max_steps - 1), unsorted: C-level ranges of keys."""
        kv, n, events = self._kv, self._n, self._events
        block_size, caching = kv.block_size, kv.enable_prefix_caching
        stride = 2 * n * block_size  # between one request's events block_size steps apart
        for index in indexes:
            start, last_step = self._start[index], self._last_step[index]
            last = min(last_step, max_steps - 1)
            # Step i runs position start + i: it needs a new block when that
            # position passes the blocks held, then every block_size steps.
            first = max(first_step, kv.num_held_blocks(self.requests[index].request_id) * block_size - start)
            allocations = range((2 * first - 1) * n + index, (2 * last - 1) * n + index + 1, stride)
            events += allocations
            self._num_allocations += len(allocations)
            last_update = 2 * last * n + index
            completes_last = False
            if caching:  # step i completes a block when start + i + 1 is a multiple
                first_completion = first_step + (-(start + first_step + 1)) % block_size
                completions = range(2 * first_completion * n + index, last_update + 1, stride)
                events += completions
                completes_last = bool(completions) and completions[-1] == last_update
            if last_step < max_steps:
                if not completes_last:
                    events.append(last_update)
                self._freed[index] = len(allocations)

    def _steps_that_fit(self, max_steps: int) -> int:
        """How many steps surely fit the KV cache, cutting the events past
        them: the run stops before the first step whose new blocks might
        not fit, so a preemption still happens in an ordinary step."""
        available = self._kv.num_free_blocks
        if self._num_allocations <= available:
            return max_steps  # frees only add: every step fits
        events, n, last_steps = self._events, self._n, self._last_step
        for key in events:
            step2 = key // n  # divmod() without its tuple (kvserve/compiled)
            index = key - step2 * n
            if step2 & 1:  # an allocation for step (step2 + 1) / 2
                if available == 0:
                    num_steps = (step2 + 1) >> 1
                    del events[bisect.bisect_left(events, (2 * num_steps - 1) * n):]
                    return num_steps
                available -= 1
            elif last_steps[index] == step2 >> 1:  # a finish frees its blocks after the step
                available += self._freed[index]
        return max_steps

    def _describe_steps(self, first_step: int) -> None:
        """num_seqs and the stretches of steps with an unchanged batch (from
        which step_shapes derives each step's KV read), from `first_step`."""
        num_steps = self.num_steps
        active = [(last, start) for last, start in zip(self._last_step, self._start) if last >= first_step]
        num_active, context = len(active), sum(start for _, start in active)
        ending = sorted(pair for pair in active if pair[0] < num_steps)
        del self.num_seqs[first_step:]
        self._stretches = []
        first = first_step  # the first step not yet described
        for last, start in ending + [(num_steps - 1, 0)]:
            if last >= first:  # steps first..last run `num_active` sequences
                self.num_seqs += [num_active] * (last + 1 - first)
                self._stretches.append((first, last, num_active, context))
                first = last + 1
            num_active -= 1
            context -= start

    def extend(self, step: int) -> bool:
        """Continue the run at step `step` (the steps before it updated) with
        the running batch, as plan_decode_run would plan it at that step,
        keeping the events planned for the run's own requests: requests
        started beside the step before (schedule_step_with_waiting) that
        now decode join the run. Their events stop at the run's last step;
        the run may end sooner, before a step whose blocks might not fit.
        False, with no change, when plan_decode_run would not plan the
        batch, or the newcomers are not the least urgent (they join at the
        end of the run's order)."""
        scheduler = self._scheduler
        if step >= self.num_steps or len(scheduler.waiting) or \
                len(scheduler.running) > scheduler.max_batched_tokens:
            return False
        batch = sorted(scheduler.running.values(), key=URGENCY)
        staying = [r for r, last in zip(self.requests, self._last_step) if last >= step]
        new = batch[len(staying):]
        if batch[:len(staying)] != staying or any(
                len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens != 1 for r in new):
            return False
        events, n = self._events, self._n
        del events[:bisect.bisect_left(events, (2 * step - 1) * n)]  # applied already
        if len(self.requests) + len(new) > n:  # out of indexes: each key q * N + i becomes q * N' + i
            stride = _key_stride(len(self.requests) + len(new))
            events[:] = [key + (key // n) * (stride - n) for key in events]
            self._n = stride
        first_new = len(self.requests)
        self.requests += new
        self._start += [r.num_computed_tokens - step for r in new]  # position at step s = start + s
        self._synced += [step] * len(new)  # up to date: update() ran their last step
        self._last_step += [step + scheduler.steps_until_stop(r, self._token_id) - 1 for r in new]
        self._freed += [0] * len(new)
        self._add_events(range(first_new, len(self.requests)), step, self.num_steps)
        events.sort()
        self.num_steps = self._steps_that_fit(self.num_steps)
        self._finish_steps = sorted(last for last in self._last_step if step <= last < self.num_steps)
        self._describe_steps(step)
        return True

    def step_shapes(self, first: int, stop: int) -> list[tuple[int, int]]:
        """(decoding sequences, KV tokens read) of steps first..stop - 1 (up
        to the run's last): a request at context c reads c + 1 tokens and
        computes one query over them. Built on demand: a run is planned
        longer than most runs last."""
        shapes: list[tuple[int, int]] = []
        stretches = self._stretches
        # The stretch holding step `first` (stretches start at 0 and follow each other).
        index = bisect.bisect_right(stretches, (first, self.num_steps)) - 1
        while first < stop and index < len(stretches):
            _, stretch_last, active, context = stretches[index]
            end = min(stop, stretch_last + 1)
            shapes += zip([active] * (end - first),
                          range(context + active * (first + 1), context + active * end + 1, active))
            first, index = end, index + 1
        return shapes

    def num_finishing(self, first: int, last: int) -> int:
        """How many requests steps first..last finish (no state change): a
        caller can know the running count after those steps without
        applying them."""
        return bisect.bisect_right(self._finish_steps, last) - bisect.bisect_left(self._finish_steps, first)

    def batch_at(self, step: int) -> list[tuple[Request, int]]:
        """(request, first position run) of every request in step `step`."""
        return [(r, self._start[i] + step) for i, r in enumerate(self.requests) if self._last_step[i] >= step]

    def schedule_step(self, step: int) -> None:
        """Allocate the blocks step `step` needs (what schedule() does for it)."""
        events, n = self._events, self._n
        base = (2 * step - 1) * n
        for position in range(bisect.bisect_left(events, base), bisect.bisect_left(events, base + n)):
            self._allocate(events[position] - base)

    def schedule_step_with_waiting(self, step: int) -> SchedulerOutput | None:
        """Step `step` as schedule() builds it while requests wait: the
        run's decodes take their tokens first (schedule_step), then waiting
        requests start, in policy order, in the token budget the decodes
        leave. Returns the chunks of the requests started; the decodes stay
        in the run, which ends with this step: update it (update_step or
        apply_steps), pass the returned output to the ordinary update(),
        then close. None, with no change, when the budget cannot hold every
        decode (schedule() would leave some out) or the step lies past the
        run. The caller sets the step's limits first, as for schedule()."""
        scheduler = self._scheduler
        if step >= self.num_steps or scheduler.max_batched_tokens < self.num_seqs[step]:
            return None
        self.schedule_step(step)
        now = scheduler.clock()
        out = SchedulerOutput(scheduled_at=now)
        scheduler.start_waiting(out, scheduler.max_batched_tokens - self.num_seqs[step], now)
        out.num_batched_tokens = sum(c.num_new_tokens for c in out.chunks)
        return out

    def update_step(self, step: int, now: float) -> list[Request]:
        """Apply step `step`'s results at `now` (what update() does for it):
        register completed blocks, finish requests that stop. Returns the
        requests finished, in batch order."""
        if len(self.end_times) != step:
            raise ValueError(f"update_step({step}) after {len(self.end_times)} updated steps")
        self.end_times.append(now)
        events, n = self._events, self._n
        base = 2 * step * n
        finished = []
        for position in range(bisect.bisect_left(events, base), bisect.bisect_left(events, base + n)):
            request = self._update(events[position] - base, step, now)
            if request is not None:
                finished.append(request)
        return finished

    def apply_steps(self, last: int, end_times: list[float], last_scheduled: int) -> list[tuple[int, Request]]:
        """Update the steps after those updated so far through `last`, step i
        ending at end_times[i], scheduling step i + 1 after each update while
        i < `last_scheduled`: the same as update_step(i, end_times[i]) then
        schedule_step(i + 1) for each i, with Python work only for the
        events. The caller has called schedule_step for the first of them.
        Returns (step, request) of the requests finished, in order."""
        first = len(self.end_times)
        if last < first:
            return []
        self.end_times.extend(end_times[first:last + 1])
        events, n = self._events, self._n
        # Step first's allocations are done; the next step's only if scheduled.
        lo = bisect.bisect_left(events, 2 * first * n)
        hi = bisect.bisect_left(events, (2 * last + (2 if last < last_scheduled else 1)) * n, lo)
        finished = []
        # _allocate and _update inline (the hot loop of a simulated hour).
        requests, starts, last_steps = self.requests, self._start, self._last_step
        kv = self._kv  # its methods called through a local (kvserve/compiled)
        token_id = self._token_id
        for key in events[lo:hi]:
            step2 = key // n  # divmod() without its tuple (kvserve/compiled)
            index = key - step2 * n
            if step2 & 1:  # the allocation for step (step2 + 1) / 2: one new block
                if kv.append_block(requests[index].request_id) is None:
                    raise AssertionError("a planned decode step ran out of KV blocks")
            elif last_steps[index] != step2 >> 1:  # a completed block
                kv.cache_next_block(requests[index], starts[index] + (step2 >> 1) + 1, token_id)
            else:
                step = step2 >> 1
                finished.append((step, self._finish_request(index, step, end_times[step])))
        return finished

    def _allocate(self, index: int) -> None:
        # Planned where the step's position enters a new block: one block
        # (what allocate_slots gives, without reading the lagging request).
        if self._kv.append_block(self.requests[index].request_id) is None:
            raise AssertionError("a planned decode step ran out of KV blocks")

    def _update(self, index: int, step: int, now: float) -> Request | None:
        """Request `index`'s event at the end of step `step`: register its
        completed block (its tokens past the request's known ones are all
        the run's token), or bring it up to date and finish it. Returns it
        when it finished."""
        if self._last_step[index] != step:
            self._kv.cache_next_block(self.requests[index], self._start[index] + step + 1, self._token_id)
            return None
        return self._finish_request(index, step, now)

    def _finish_request(self, index: int, step: int, now: float) -> Request:
        """Request `index` stops at the end of step `step`, its last."""
        request = self.requests[index]
        self._sync(index, step + 1)
        self._kv.cache_computed_blocks(request)
        status = self._scheduler.stop_status(request, self._token_id)
        if status is None:
            raise AssertionError(f"{request.request_id} planned to stop at step {step} but does not")
        self._scheduler.finish(request, status, now)
        return request

    def in_flight_output(self, step: int) -> SchedulerOutput:
        """End the run early after schedule_step(step): bring every request up
        to date and return the step's output for the ordinary update()."""
        out = SchedulerOutput()
        for index, request in enumerate(self.requests):
            if request.status == RequestStatus.RUNNING:
                self._sync(index, step)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1,
                                                 self._kv.block_ids(request.request_id), True))
        out.num_batched_tokens = len(out.chunks)
        return out

    def close(self) -> None:
        """After the last update_step: bring every request up to date."""
        # _sync of every running request, inline: once per run and request.
        end_times, synced, token_id = self.end_times, self._synced, self._token_id
        num_steps = len(end_times)
        for index, request in enumerate(self.requests):
            done = synced[index]
            if done == num_steps or request.status != _RUNNING:
                continue
            times = end_times[done:]
            request.num_computed_tokens += num_steps - done
            request.output_token_ids += [token_id] * (num_steps - done)
            stamps = request.timestamps
            if stamps.first_token is None:
                stamps.first_token = times[0]
            stamps.token_times += times
            synced[index] = num_steps

    def _sync(self, index: int, num_steps: int) -> None:
        """Apply the first `num_steps` steps' tokens to request `index`."""
        done = self._synced[index]
        if num_steps <= done:
            return
        request = self.requests[index]
        times = self.end_times[done:num_steps]
        request.num_computed_tokens += num_steps - done
        request.output_token_ids += [self._token_id] * (num_steps - done)
        stamps = request.timestamps
        if stamps.first_token is None:
            stamps.first_token = times[0]
        stamps.token_times += times
        self._synced[index] = num_steps


class RunLengths:
    """How many steps a replica's next decode run plans and times at once,
    from the steps its runs used: the mean steps between events is
    estimated from the runs an event ended (an exponential mean from
    samples of which some are cut short: each run that ran out of steps
    adds its steps but no end)."""

    def __init__(self) -> None:
        self.steps_planned = MIN_RUN_STEPS
        self.steps_timed = MIN_RUN_STEPS  # steps of a run timed at once
        # Decayed sums of the steps runs used and of the runs an event ended
        # (the rest ran out of steps: their gap to the next event was longer).
        self._steps_used = float(MIN_RUN_STEPS)
        self._ended_by_events = 1.0

    def record(self, steps_used: int, ended_by_event: bool) -> None:
        """A run used `steps_used` steps, cut by an event (an arrival, a
        cancel) or not."""
        self._steps_used = RUN_LENGTH_DECAY * self._steps_used + steps_used
        self._ended_by_events = RUN_LENGTH_DECAY * self._ended_by_events + ended_by_event
        mean_steps = self._steps_used / max(self._ended_by_events, 1e-3)
        self.steps_planned = max(MIN_RUN_STEPS, min(MAX_RUN_STEPS, int(3 * mean_steps) + 8))
        self.steps_timed = max(MIN_RUN_STEPS, min(MAX_RUN_STEPS, int(0.75 * mean_steps) + 4))


class ActiveRun:
    """The decode run a replica has in flight, and where its steps stand."""

    __slots__ = ("run", "started_s", "end_times", "next_update", "first_step", "last_step")

    def __init__(self, run: DecodeRun, started_s: float, end_times: list[float]) -> None:
        self.run = run
        self.started_s = started_s
        self.end_times = end_times  # of the steps timed so far
        self.next_update = 0  # steps of the run updated so far
        self.first_step = 0  # where the run last started or took in new requests
        self.last_step = run.num_steps - 1  # the run ends after updating this step

    def step_started_s(self, step: int) -> float:
        return self.end_times[step - 1] if step else self.started_s
