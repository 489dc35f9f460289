"""Multi-step decode (`sim.fast_forward.plan_decode_run`): k single schedule() /
update() steps and one k-step `DecodeRun` leave identical schedulers."""

import random

import pytest

from kvserve.contract import RequestStatus
from kvserve.sim.fast_forward import plan_decode_run
from tests.scheduler_helpers import EOS, NON_EOS, FakeClock, make_request, make_scheduler, step


def _steady_batch(seed, num_blocks=400, prefix_caching=True, **request_params):
    """A scheduler whose running requests have all finished prefill, built the
    same way every time for a seed."""
    rng = random.Random(seed)
    clock = FakeClock()
    sched, _ = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64, max_seqs=16,
                              max_model_len=120, prefix_caching=prefix_caching, clock=clock)
    for i in range(rng.randint(3, 9)):
        # Some share a prompt (shared prefix blocks, equal block hashes).
        first = 1 if i % 3 == 0 else 100 * i
        params = {"max_tokens": rng.randint(1, 60), "ignore_eos": True, **request_params}
        sched.add_request(make_request(f"r{i}", num_prompt=rng.randint(1, 30), priority=rng.randint(0, 1),
                                       arrival=0.001 * i, first_token=first, **params))
    while sched.waiting.peek(clock.now) is not None or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in sched.running.values()):
        step(sched, clock, NON_EOS)
    return sched, clock


def _run_all(run, clock, dt=0.01):
    """Drive a whole run, its step i ending where k single steps of `step`
    (clock advanced by dt each) would end."""
    for i in range(run.num_steps):
        run.schedule_step(i)
        clock.now += dt
        run.update_step(i, clock.now)
    run.close()


def _state(sched):
    kv = sched.kv_cache
    kv.check_integrity()
    requests = {rid: (r.num_computed_tokens, list(r.output_token_ids), list(r.timestamps.token_times),
                      r.timestamps.first_token, list(kv.block_ids(rid)))
                for rid, r in sched._requests.items()}
    pool = kv.pool
    return (requests, list(sched.running), [b.block_id for b in pool._free],
            pool.eviction_order(), sorted((h, b.block_id) for h, b in pool._by_hash.items()),
            kv.prefix_cache_queries, kv.prefix_cache_hits)


def _finished(requests):
    return {r.request_id: (r.status, r.timestamps.finished, list(r.timestamps.token_times),
                           r.num_output_tokens) for r in requests if r.is_finished}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_k_single_steps_and_one_run_leave_identical_schedulers(seed, prefix_caching):
    single, single_clock = _steady_batch(seed, prefix_caching=prefix_caching)
    multi, multi_clock = _steady_batch(seed, prefix_caching=prefix_caching)
    batch = list(single._requests.values())
    run = plan_decode_run(multi, 40, NON_EOS)
    assert run is not None and run.num_steps >= 10
    _run_all(run, multi_clock)
    for _ in range(run.num_steps):
        out = single.schedule()
        assert all(c.num_new_tokens == 1 for c in out.chunks) and not out.preempted_ids
        single_clock.now += 0.01
        single.update(out, {c.request.request_id: NON_EOS for c in out.chunks})
    assert _state(multi) == _state(single)
    assert _finished(run.requests) == _finished(batch)
    assert any(r.is_finished for r in batch), "some requests must finish inside the run"


@pytest.mark.parametrize("seed", range(6))
def test_a_run_ended_early_hands_an_exact_step_to_update(seed):
    single, single_clock = _steady_batch(seed)
    multi, multi_clock = _steady_batch(seed)
    run = plan_decode_run(multi, 30, NON_EOS)
    stop_after = 7
    for i in range(stop_after):
        run.schedule_step(i)
        multi_clock.now += 0.01
        run.update_step(i, multi_clock.now)
    run.schedule_step(stop_after)
    out = run.in_flight_output(stop_after)
    multi_clock.now += 0.01
    multi.update(out, {c.request.request_id: NON_EOS for c in out.chunks})
    for _ in range(stop_after + 1):
        step(single, single_clock, NON_EOS)
    assert _state(multi) == _state(single)


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_a_stop_token_ends_a_run_where_single_steps_do(min_tokens):
    # Every step samples EOS with ignore_eos off: each request stops at
    # min_tokens output tokens (or its max_tokens, or the model length).
    single, single_clock = _steady_batch(7, ignore_eos=False, min_tokens=min_tokens, max_tokens=60)
    multi, multi_clock = _steady_batch(7, ignore_eos=False, min_tokens=min_tokens, max_tokens=60)
    batch = list(single._requests.values())
    run = plan_decode_run(multi, 70, EOS)
    _run_all(run, multi_clock)
    for _ in range(run.num_steps):
        step(single, single_clock, EOS)
    assert _state(multi) == _state(single)
    assert _finished(run.requests) == _finished(batch)
    assert RequestStatus.FINISHED_STOPPED in {r.status for r in run.requests}


@pytest.mark.parametrize("seed", range(8))
def test_a_run_stops_before_a_step_that_might_preempt(seed):
    # Tight caches: the run ends where the blocks run out, counting only
    # what requests finishing inside it surely free.
    single, single_clock = _steady_batch(seed, num_blocks=36)
    multi, multi_clock = _steady_batch(seed, num_blocks=36)
    run = plan_decode_run(multi, 200, NON_EOS)
    if run is None:
        assert step(single, single_clock, NON_EOS).preempted_ids
        return
    assert run.num_steps < 200
    _run_all(run, multi_clock)
    for _ in range(run.num_steps):
        assert not step(single, single_clock, NON_EOS).preempted_ids
    assert _state(multi) == _state(single)


def test_no_run_while_a_request_waits_or_prefills():
    sched, clock = make_scheduler(num_blocks=64, block_size=4, budget=8)
    sched.add_request(make_request("a", num_prompt=20, max_tokens=10))
    assert plan_decode_run(sched, 10, NON_EOS) is None  # waiting
    step(sched, clock)
    assert plan_decode_run(sched, 10, NON_EOS) is None  # part-way through its prompt
    while sched.running["a"].num_computed_tokens < 20:
        step(sched, clock)
    assert plan_decode_run(sched, 10, NON_EOS) is not None
    sched.add_request(make_request("b", num_prompt=4, max_tokens=10))
    assert plan_decode_run(sched, 10, NON_EOS) is None


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("split", [0, 1, 9])
def test_apply_steps_leaves_what_single_steps_leave(seed, split):
    # apply_steps visits only the steps with events (block boundaries,
    # finishes): the state, finishes and token times match k single steps.
    # `split` steps go through update_step first: the two mix.
    single, single_clock = _steady_batch(seed)
    multi, _ = _steady_batch(seed)
    batch = list(single._requests.values())
    run = plan_decode_run(multi, 40, NON_EOS)
    assert run is not None and run.num_steps > split + 2
    start_s = single_clock.now
    end_times = [start_s + 0.01 * (i + 1) for i in range(run.num_steps)]
    run.schedule_step(0)
    for i in range(split):
        run.update_step(i, end_times[i])
        run.schedule_step(i + 1)
    middle = (split + run.num_steps) // 2
    finished = run.apply_steps(middle, end_times, run.num_steps - 1)
    finished += run.apply_steps(run.num_steps - 1, end_times, run.num_steps - 1)
    run.close()
    single_finished = []
    for i in range(run.num_steps):
        single_clock.now = end_times[i]
        out = single.schedule()
        single.update(out, {c.request.request_id: NON_EOS for c in out.chunks})
        single_finished += [(i, c.request.request_id) for c in out.chunks
                            if c.request.is_finished and i >= split]
    assert _state(multi) == _state(single)
    assert _finished(run.requests) == _finished(batch)
    assert [(i, r.request_id) for i, r in finished] == single_finished
    assert finished, "some requests must finish inside the applied steps"


def _arrival(seed):
    """A request that arrives while the batch decodes (latest arrival, so it
    runs last among equals once started); some prompts outgrow the budget
    the decodes leave (64 tokens a step) and are chunked."""
    return make_request("new", num_prompt=random.Random(seed).randint(1, 70), max_tokens=20,
                        arrival=1.0, first_token=900, ignore_eos=True)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("steps_before", [0, 1, 6])
def test_a_run_step_that_starts_waiting_requests_is_the_ordinary_step(seed, steps_before):
    # A request arrives during step `steps_before - 1` of a run; the next
    # step starts its prompt beside the run's decodes. Run as one more step
    # of the run (decodes applied by the run, the started chunk by update())
    # it leaves what single steps leave, with the same batch.
    single, single_clock = _steady_batch(seed)
    multi, multi_clock = _steady_batch(seed)
    run = plan_decode_run(multi, 40, NON_EOS)
    assert run is not None and run.num_steps > steps_before
    for i in range(steps_before):
        run.schedule_step(i)
        multi_clock.now += 0.01
        run.update_step(i, multi_clock.now)
        step(single, single_clock, NON_EOS)
    single.add_request(_arrival(seed))
    multi.add_request(_arrival(seed))
    expected = single.schedule()
    started = run.schedule_step_with_waiting(steps_before)
    assert started is not None and [c.request.request_id for c in started.chunks] == ["new"]
    decodes = [(r.request_id, start, 1, True) for r, start in run.batch_at(steps_before)]
    assert decodes + [(c.request.request_id, c.start, c.num_new_tokens, c.samples) for c in started.chunks] == \
        [(c.request.request_id, c.start, c.num_new_tokens, c.samples) for c in expected.chunks]
    single_clock.now += 0.01
    single.update(expected, {c.request.request_id: NON_EOS for c in expected.chunks if c.samples})
    multi_clock.now += 0.01
    run.update_step(steps_before, multi_clock.now)
    multi.update(started, {c.request.request_id: NON_EOS for c in started.chunks if c.samples})
    run.close()
    assert _state(multi) == _state(single)


def test_a_run_step_cannot_start_waiting_requests_when_the_budget_misses_a_decode():
    multi, _ = _steady_batch(3)
    run = plan_decode_run(multi, 40, NON_EOS)
    multi.add_request(_arrival(3))
    before = _state(multi)
    multi.set_step_limits(16, len(multi.running) - 1)  # schedule() would leave a decode out
    assert run.schedule_step_with_waiting(0) is None
    assert run.schedule_step_with_waiting(run.num_steps) is None  # past the run
    assert _state(multi) == before


def test_a_run_step_starts_nobody_when_the_running_cap_is_reached():
    single, single_clock = _steady_batch(4)
    multi, multi_clock = _steady_batch(4)
    run = plan_decode_run(multi, 40, NON_EOS)
    for sched in (single, multi):
        sched.add_request(_arrival(4))
        sched.set_step_limits(len(sched.running), None)
    started = run.schedule_step_with_waiting(0)
    assert started is not None and not started.chunks
    expected = step(single, single_clock, NON_EOS)
    assert all(c.request.request_id != "new" for c in expected.chunks)
    multi_clock.now += 0.01
    run.update_step(0, multi_clock.now)
    run.close()
    assert _state(multi) == _state(single)
    assert [r.request_id for r in multi.waiting] == ["new"]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_run_extended_with_the_requests_it_started_goes_on_as_single_steps(seed, prefix_caching):
    # Steps of a run, an arrival started beside step 3, then the run goes on
    # with the newcomer (extend) instead of a new plan: the same state,
    # finishes and batches as single steps all along, also where the
    # newcomer's blocks make the run stop early (a small cache).
    num_blocks = 400 if seed % 2 else 80
    single, single_clock = _steady_batch(seed, num_blocks=num_blocks, prefix_caching=prefix_caching)
    multi, multi_clock = _steady_batch(seed, num_blocks=num_blocks, prefix_caching=prefix_caching)
    batch = list(single._requests.values())
    run = plan_decode_run(multi, 40, NON_EOS)
    assert run is not None and run.num_steps >= 6
    for i in range(3):
        run.schedule_step(i)
        multi_clock.now += 0.01
        run.update_step(i, multi_clock.now)
        step(single, single_clock, NON_EOS)
    # The least urgent class, arriving last: it joins at the end of the order.
    arrival = make_request("new", num_prompt=9, max_tokens=30, priority=1, arrival=1.0, first_token=900,
                           ignore_eos=True)
    single.add_request(arrival)
    multi.add_request(make_request("new", num_prompt=9, max_tokens=30, priority=1, arrival=1.0, first_token=900,
                                   ignore_eos=True))
    started = run.schedule_step_with_waiting(3)
    multi_clock.now += 0.01
    run.update_step(3, multi_clock.now)
    multi.update(started, {c.request.request_id: NON_EOS for c in started.chunks if c.samples})
    step(single, single_clock, NON_EOS)
    if not started.chunks:  # no room to start it: it waits, and nothing extends
        assert not run.extend(4)
        return
    assert run.extend(4)
    assert [r.request_id for r, _ in run.batch_at(4)] == \
        [r.request_id for r in sorted(single.running.values(), key=lambda r: (r.priority, r.arrival_time))]
    end_times = [multi_clock.now + 0.01 * (i - 3) for i in range(run.num_steps)]
    _finish_as_single_steps(run, 4, end_times, multi, single, single_clock)
    assert _finished(run.requests) == _finished(batch + [arrival])


def test_a_run_is_not_extended_with_a_more_urgent_newcomer():
    multi, multi_clock = _steady_batch(2)
    run = plan_decode_run(multi, 40, NON_EOS)
    urgent = make_request("new", num_prompt=4, max_tokens=30, priority=-1, arrival=1.0, first_token=900,
                          ignore_eos=True)
    multi.add_request(urgent)
    started = run.schedule_step_with_waiting(0)
    multi_clock.now += 0.01
    run.update_step(0, multi_clock.now)
    multi.update(started, {c.request.request_id: NON_EOS for c in started.chunks if c.samples})
    before = (len(run.requests), run.num_steps, list(run.num_seqs))
    assert not run.extend(1)  # it would run first, not last
    assert (len(run.requests), run.num_steps, list(run.num_seqs)) == before


def _two_long_decodes(prefix_caching):
    clock = FakeClock()
    sched, _ = make_scheduler(num_blocks=400, block_size=4, budget=64, max_seqs=32, max_model_len=200,
                              prefix_caching=prefix_caching, clock=clock)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", num_prompt=5 + i, max_tokens=60, arrival=0.001 * i,
                                       first_token=1, ignore_eos=True))
    while sched.waiting.peek(clock.now) is not None or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in sched.running.values()):
        step(sched, clock, NON_EOS)
    return sched, clock


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_run_that_takes_in_many_newcomers_goes_on_as_single_steps(prefix_caching):
    # A newcomer at every step joins a run planned for two requests, until
    # the run has held seven times as many (its event keys leave room for
    # as many newcomers again as it holds, then are renumbered); some
    # newcomers share the first requests' prompt blocks, some finish inside
    # the run. The same state, finishes and batches as single steps.
    single, single_clock = _two_long_decodes(prefix_caching)
    multi, multi_clock = _two_long_decodes(prefix_caching)
    run = plan_decode_run(multi, 40, NON_EOS)
    assert run is not None and run.num_steps == 40
    num_arrivals = 12
    for k in range(num_arrivals):
        def arrival():
            return make_request(f"new{k}", num_prompt=3 + k % 5, max_tokens=5 + k, priority=1, arrival=1.0 + k,
                                first_token=1 if k % 2 else 50, ignore_eos=True)
        single.add_request(arrival())
        multi.add_request(arrival())
        started = run.schedule_step_with_waiting(k)
        assert [c.request.request_id for c in started.chunks] == [f"new{k}"]
        multi_clock.now += 0.01
        run.update_step(k, multi_clock.now)
        multi.update(started, {c.request.request_id: NON_EOS for c in started.chunks if c.samples})
        step(single, single_clock, NON_EOS)
        assert run.extend(k + 1)
    assert len(run.requests) == 2 + num_arrivals
    assert any(r.is_finished for r in run.requests), "some newcomers must finish inside the run"
    end_times = [multi_clock.now + 0.01 * (i + 1 - num_arrivals) for i in range(run.num_steps)]
    _finish_as_single_steps(run, num_arrivals, end_times, multi, single, single_clock)


def _finish_as_single_steps(run, first: int, end_times, multi, single, single_clock) -> None:
    """Apply the run's steps first..last at `end_times` in one call, and
    single steps of `single` at the same times: the same batches, finishes
    and end state."""
    run.schedule_step(first)
    finished = run.apply_steps(run.num_steps - 1, end_times, run.num_steps - 1)
    run.close()
    single_finished = []
    for i in range(first, run.num_steps):
        single_clock.now = end_times[i]
        out = step(single, None, NON_EOS)
        assert [(c.request.request_id, c.start) for c in out.chunks] == \
            [(r.request_id, start) for r, start in run.batch_at(i)]
        single_finished += [(i, c.request.request_id) for c in out.chunks if c.request.is_finished]
    assert _state(multi) == _state(single)
    assert [(i, r.request_id) for i, r in finished] == single_finished
