"""Scheduler behaviour through its public interface: schedule / update / abort."""

import pytest

from kvserve.contract import Request, RequestStatus, SamplingParams
from tests.scheduler_helpers import EOS, NON_EOS, make_request, make_scheduler, step


def test_decode_is_not_starved_by_a_long_prefill():
    sched, clock = make_scheduler(num_blocks=2048, block_size=16, budget=256, max_seqs=16)
    decoders = [make_request(f"d{i}", num_prompt=20, max_tokens=500) for i in range(8)]
    for r in decoders:
        sched.add_request(r)
    step(sched, clock)  # all 8 prefill in one step (160 tokens)
    sched.add_request(make_request("long", num_prompt=4000, max_tokens=4, first_token=1000))
    long_chunks = []
    for _ in range(30):
        out = step(sched, clock)
        got = {c.request.request_id: c.num_new_tokens for c in out.chunks}
        assert all(got[r.request_id] == 1 for r in decoders), "a decoding sequence missed a step"
        assert out.num_batched_tokens <= 256
        long_chunks.append(got.get("long", 0))
    # The long prompt used the rest of each step's budget: 16 full chunks, the
    # remainder, then one token per step (decode) until max_tokens.
    assert long_chunks[:17] == [248] * 16 + [4000 - 16 * 248]
    assert long_chunks[17:20] == [1, 1, 1] and long_chunks[20:] == [0] * 10


def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end():
    sched, clock = make_scheduler(budget=32)
    r = make_request("r", num_prompt=80, max_tokens=2)
    sched.add_request(r)
    outs = [step(sched, clock) for _ in range(3)]
    assert [(c.start, c.num_new_tokens, c.samples) for o in outs for c in o.chunks] == [
        (0, 32, False), (32, 32, False), (64, 16, True)]
    assert r.output_token_ids == [NON_EOS]
    assert r.timestamps.first_token is not None



def test_any_of_several_eos_ids_stops_the_request():
    """Models ship several end tokens (Llama 3 Instruct: <|eot_id|> and
    <|end_of_text|>); each must end the request, not only the first."""
    sched, clock = make_scheduler()
    second_eos = NON_EOS + 1
    both = Request("both", [1, 2, 3], SamplingParams(max_tokens=10), arrival_time=0.0,
                   eos_token_ids=(EOS, second_eos))
    only_first = make_request("first-only", max_tokens=10)
    for r in (both, only_first):
        sched.add_request(r)
    step(sched, clock, token=NON_EOS)
    step(sched, clock, token=second_eos)
    assert both.status == RequestStatus.FINISHED_STOPPED and both.output_token_ids == [NON_EOS, second_eos]
    assert only_first.status == RequestStatus.RUNNING
    sched.kv_cache.check_integrity()

def test_stop_conditions():
    sched, clock = make_scheduler()
    eos = make_request("eos", max_tokens=10)
    ignore = make_request("ignore", max_tokens=3, ignore_eos=True)
    min_tok = make_request("min", max_tokens=10, min_tokens=2)
    stop_id = make_request("stopid", max_tokens=10, stop_token_ids=(NON_EOS,), ignore_eos=True)
    for r in (eos, ignore, min_tok, stop_id):
        sched.add_request(r)
    step(sched, clock, token=EOS)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.finish_reason == "stop"
    assert ignore.status == RequestStatus.RUNNING
    assert min_tok.status == RequestStatus.RUNNING  # EOS before min_tokens does not stop
    assert stop_id.status == RequestStatus.RUNNING
    step(sched, clock, token=NON_EOS)
    assert stop_id.status == RequestStatus.FINISHED_STOPPED
    step(sched, clock, token=EOS)
    assert min_tok.status == RequestStatus.FINISHED_STOPPED
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.finish_reason == "length"
    assert ignore.output_token_ids == [EOS, NON_EOS, EOS]
    assert not sched.has_unfinished()
    sched.kv_cache.check_integrity()
    assert sched.kv_cache.usage() == 0


def test_max_model_len_finishes_with_length():
    sched, clock = make_scheduler(max_model_len=12)
    r = make_request("r", num_prompt=10, max_tokens=100)
    sched.add_request(r)
    while sched.has_unfinished():
        step(sched, clock)
    assert r.num_tokens == 12 and r.finish_reason == "length"


def test_prompt_that_cannot_fit_is_refused_at_add():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("big", num_prompt=20))
    with pytest.raises(ValueError, match="context"):
        sched.add_request(make_request("long", num_prompt=100))
    assert not sched.has_unfinished()


def test_preemption_victim_is_lowest_priority_latest_arrival_and_resumes_first():
    # 6 blocks of 4 tokens; three requests of 8-token prompts (2 blocks each) fill the cache.
    sched, clock = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    urgent = make_request("urgent", priority=0, arrival=0.0, max_tokens=12, first_token=100)
    early_batch = make_request("early", priority=1, arrival=0.0, max_tokens=12, first_token=200)
    late_batch = make_request("late", priority=1, arrival=0.5, max_tokens=12, first_token=300)
    for r in (urgent, early_batch, late_batch):
        sched.add_request(r)
    step(sched, clock)
    assert sched.kv_cache.num_free_blocks == 0
    assert sched.stats().num_allocation_failures == 0
    out = step(sched, clock)  # each needs a 3rd block now: someone must go
    assert out.preempted_ids[0] == "late"
    assert late_batch.status == RequestStatus.PREEMPTED and late_batch.num_computed_tokens == 0
    assert sched.stats().num_preemptions >= 1
    # Its 8 prompt tokens' KV was dropped: they are computed again on resume.
    assert sched.stats().num_recomputed_tokens == 8 * sched.stats().num_preemptions
    assert sched.stats().num_allocation_failures >= 1
    # The preempted request keeps its output and recomputes it on resume.
    assert late_batch.num_output_tokens == 1
    assert sched.waiting.peek(clock.now) is late_batch
    while sched.has_unfinished():
        step(sched, clock)
        sched.kv_cache.check_integrity()
    assert late_batch.num_output_tokens == 12 and late_batch.finish_reason == "length"


def test_request_alone_that_outgrows_the_cache_finishes_with_length():
    sched, clock = make_scheduler(num_blocks=3, block_size=4, prefix_caching=False)
    r = make_request("r", num_prompt=8, max_tokens=100)
    sched.add_request(r)
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        finished += out.finished
        sched.update(out, {c.request.request_id: NON_EOS for c in out.chunks if c.samples})
    # 12 slots hold 12 tokens' KV; the 13th was sampled but never needs KV.
    assert finished == [r] and r.finish_reason == "length" and r.num_tokens == 13
    assert sched.kv_cache.usage() == 0


def test_priority_order_and_aging():
    sched, clock = make_scheduler(max_seqs=1, aging_s=10.0)
    blocker = make_request("blocker", max_tokens=3)
    sched.add_request(blocker)
    step(sched, clock)
    batch = make_request("batch", priority=2, arrival=0.0)
    sched.add_request(batch)
    clock.now = 5.0
    fresh = make_request("fresh", priority=0, arrival=5.0)
    sched.add_request(fresh)
    assert sched.waiting.peek(clock.now) is fresh  # batch: 2 - 0.5 > fresh: 0
    sched.abort("fresh")
    clock.now = 25.0
    sched.add_request(make_request("fresh2", priority=0, arrival=25.0))
    # batch has waited 25 s = 2.5 classes: it now overtakes a fresh priority-0 request.
    assert sched.waiting.peek(clock.now) is batch


def test_tenants_share_a_class_fairly():
    sched, clock = make_scheduler(max_seqs=1, prefix_caching=False)
    for i in range(6):
        sched.add_request(make_request(f"flood{i}", tenant="flood", arrival=0.0 + i * 1e-3))
    sched.add_request(make_request("quiet0", tenant="quiet", arrival=1.0))
    sched.add_request(make_request("quiet1", tenant="quiet", arrival=1.1))
    order = []
    while sched.has_unfinished():
        out = step(sched, clock)
        order += [c.request.request_id for c in out.chunks if c.start == 0]
    # Quiet's requests are interleaved, not queued behind the whole flood.
    assert order.index("quiet0") <= 2 and order.index("quiet1") <= 4


def test_abort_frees_everything_in_any_state():
    sched, clock = make_scheduler(num_blocks=8, block_size=4, budget=8, max_seqs=2)
    running = make_request("running", num_prompt=4)
    partial = make_request("partial", num_prompt=20, first_token=50)
    waiting = make_request("waiting", num_prompt=4, first_token=90)
    for r in (running, partial, waiting):
        sched.add_request(r)
    step(sched, clock)
    assert partial.status == RequestStatus.RUNNING and 0 < partial.num_computed_tokens < 20
    for r in (running, partial, waiting):
        assert sched.abort(r.request_id) is r
        assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    assert sched.abort("running") is None  # idempotent
    assert not sched.has_unfinished()
    assert sched.kv_cache.usage() == 0 and len(sched.waiting) == 0
    sched.kv_cache.check_integrity()


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched, clock = make_scheduler()
    r = make_request("r")
    sched.add_request(r)
    out = sched.schedule()
    sched.abort("r")
    assert sched.update(out, {"r": NON_EOS}) == []
    assert r.output_token_ids == []
    sched.kv_cache.check_integrity()


def test_sequence_cap_and_set_step_limits():
    sched, clock = make_scheduler(max_seqs=4)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", first_token=10 * i + 1))
    out = step(sched, clock)
    assert len(out.chunks) == 4
    sched.set_step_limits(2, None)
    while sched.has_unfinished():
        running_before = len(sched.running)
        out = step(sched, clock)
        assert len(out.chunks) <= max(running_before, 2)
        if running_before <= 2:
            assert len(out.chunks) <= 2


def test_step_token_limit_caps_the_whole_step_and_decodes_come_first():
    sched, clock = make_scheduler(num_blocks=256, budget=64, max_seqs=16)
    decoders = [make_request(f"d{i}", num_prompt=8, max_tokens=50, first_token=100 * i + 1)
                for i in range(4)]
    for r in decoders:
        sched.add_request(r)
    step(sched, clock)  # 4 x 8 prompt tokens within the config's 64
    sched.set_step_limits(5, 8)
    sched.add_request(make_request("long", num_prompt=40, max_tokens=5, first_token=900))
    long_chunks = []
    for _ in range(12):
        out = step(sched, clock)
        got = {c.request.request_id: c.num_new_tokens for c in out.chunks}
        assert out.num_batched_tokens <= 8
        assert all(got.get(r.request_id) == 1 for r in decoders), "a decode missed a step"
        long_chunks.append((got.get("long", 0), out.num_decode_seqs, out.num_prefill_tokens))
    # The prompt gets what the 4 decodes leave of the 8 tokens, chunk by chunk,
    # then decodes beside them.
    assert long_chunks[:10] == [(4, 4, 4)] * 10
    assert long_chunks[10] == (1, 5, 0)
    assert sched.get_request("long").num_output_tokens == 3


def test_step_token_limit_is_clamped_to_the_config_and_none_restores_it():
    sched, clock = make_scheduler(budget=32)
    sched.add_request(make_request("r", num_prompt=100, max_tokens=2))
    sched.set_step_limits(16, 10_000)
    assert step(sched, clock).num_batched_tokens == 32
    sched.set_step_limits(16, 0)
    assert step(sched, clock).num_batched_tokens == 1
    sched.set_step_limits(16, None)
    assert step(sched, clock).num_batched_tokens == 32


def test_a_token_cap_that_spares_idle_steps_binds_as_soon_as_a_request_decodes():
    sched, clock = make_scheduler(budget=64)
    sched.set_step_limits(16, 8, cap_idle_steps=False)
    sched.add_request(make_request("a", num_prompt=100, max_tokens=5))
    # Nothing decodes (nothing runs, then "a" is part-way through its
    # prompt): the config's 64 tokens, not 8.
    assert [step(sched, clock).num_batched_tokens for _ in range(2)] == [64, 36]
    sched.add_request(make_request("b", num_prompt=40, max_tokens=5, first_token=200))
    # "a" decodes from here: the cap binds in the very step it first does.
    beside = step(sched, clock)
    assert (beside.num_decode_seqs, beside.num_prefill_tokens) == (1, 7)
    sched.set_step_limits(16, 8)  # binding every step, as before the fit
    sched.add_request(make_request("c", num_prompt=40, max_tokens=1, first_token=300))
    sched.abort("a")
    sched.abort("b")
    assert step(sched, clock).num_batched_tokens == 8


def test_step_shape_splits_decodes_from_prefill_tokens():
    sched, clock = make_scheduler(budget=64)
    sched.add_request(make_request("a", num_prompt=10, max_tokens=5))
    first = step(sched, clock)
    assert (first.num_decode_seqs, first.num_prefill_tokens) == (0, 10)
    sched.add_request(make_request("b", num_prompt=20, max_tokens=5, first_token=50))
    mixed = step(sched, clock)
    assert (mixed.num_decode_seqs, mixed.num_prefill_tokens) == (1, 20)
    assert mixed.num_decode_seqs + mixed.num_prefill_tokens == mixed.num_batched_tokens


def test_timestamps_are_stamped_from_the_injected_clock():
    sched, clock = make_scheduler()
    clock.now = 100.0
    r = make_request("r", max_tokens=2, arrival=99.0)
    sched.add_request(r)
    step(sched, clock, dt=0.5)
    step(sched, clock, dt=0.5)
    t = r.timestamps
    assert (t.arrival, t.queued, t.scheduled, t.first_token, t.token_times, t.finished) == (
        99.0, 100.0, 100.0, 100.5, [100.5, 101.0], 101.0)


def test_a_step_says_which_requests_it_started_and_when_only_on_their_first_schedule():
    # Admission's queue wait ends at the first schedule, not at a resume after preemption.
    sched, clock = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    clock.now = 3.0
    for rid, priority, arrival in (("urgent", 0, 0.0), ("early", 1, 0.0), ("late", 1, 0.5)):
        sched.add_request(make_request(rid, priority=priority, arrival=arrival, max_tokens=12))
    first = step(sched, clock)
    assert first.started_ids == ["urgent", "early", "late"] and first.scheduled_at == 3.0
    started_later = []
    while sched.has_unfinished():
        out = step(sched, clock)
        started_later += out.started_ids
        assert out.scheduled_at == pytest.approx(clock.now - 0.01)
    assert sched.stats().num_preemptions >= 1, "a preempted request resumes without starting again"
    assert started_later == []


def test_prefix_hit_tokens_asks_without_taking_and_reset_forgets_cached_blocks_and_totals():
    sched, clock = make_scheduler(num_blocks=16, block_size=4, budget=64)
    sched.add_request(make_request("a", num_prompt=13, max_tokens=2))
    while sched.has_unfinished():
        step(sched, clock)
    stats = sched.stats()
    again = make_request("b", num_prompt=13, max_tokens=2)
    assert sched.prefix_hit_tokens(again) == 12
    assert sched.stats() == stats and sched.kv_cache.pool.num_cached_blocks > 0
    sched.reset_prefix_cache()
    assert sched.prefix_hit_tokens(make_request("c", num_prompt=13, max_tokens=2)) == 0
    s = sched.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (0, 0, 0)
    assert (s.num_evicted_blocks, s.num_allocation_failures, s.num_recomputed_tokens) == (0, 0, 0)
    assert sched.kv_cache.pool.num_cached_blocks == 0
    sched.kv_cache.check_integrity()
