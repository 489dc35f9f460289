"""KV accounting of speculative lookahead, on the pure scheduler: drafts get
slots for their step, rejected drafts give them back, aborts mid-speculation
leak nothing, and a request never holds more than admission projected
(prompt + max_tokens)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.scheduler_helpers import EOS, make_request, make_scheduler

workload = st.fixed_dictionaries({
    "requests": st.lists(st.fixed_dictionaries({
        "num_prompt": st.integers(1, 40), "max_tokens": st.integers(1, 30),
        "abort_at": st.one_of(st.none(), st.integers(0, 40))}), min_size=1, max_size=12),
    "num_blocks": st.integers(12, 40),
    "block_size": st.sampled_from([2, 4, 8]),
    "budget": st.integers(4, 64),
    "num_drafts": st.integers(1, 6),
    "prefix_caching": st.booleans(),
    "seed": st.integers(0, 2**16),
})


def held_blocks_never_exceed_the_projection(sched) -> None:
    kv = sched.kv_cache
    for request in sched.running.values():
        assert kv.num_held_blocks(request.request_id) <= kv.blocks_for_tokens(request.max_num_tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_lookahead_slots_are_released_and_never_leak(w):
    rng = random.Random(w["seed"])
    sched, clock = make_scheduler(num_blocks=w["num_blocks"], block_size=w["block_size"], budget=w["budget"],
                                  max_seqs=8, max_model_len=64, prefix_caching=w["prefix_caching"])
    requests = []
    for i, spec in enumerate(w["requests"]):
        request = make_request(f"r{i}", num_prompt=spec["num_prompt"], max_tokens=spec["max_tokens"],
                               first_token=1 + 3 * i)
        try:
            sched.add_request(request)
        except ValueError:
            continue
        requests.append((request, spec["abort_at"]))
    verified = 0
    for step_no in range(2000):
        for request, abort_at in requests:
            if abort_at == step_no and not request.is_finished:
                sched.abort(request.request_id)  # possibly carrying drafts, or mid-verification
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        held_blocks_never_exceed_the_projection(sched)
        sampled, accepted = {}, {}
        for chunk in out.chunks:
            if chunk.samples:
                sampled[chunk.request.request_id] = EOS if rng.random() < 0.03 else 5 + rng.randrange(3)
            if chunk.spec_token_ids:
                verified += 1
                accepted[chunk.request.request_id] = rng.randint(0, len(chunk.spec_token_ids))
        clock.now += 0.01
        sched.update(out, sampled, accepted)
        sched.kv_cache.check_integrity()
        held_blocks_never_exceed_the_projection(sched)
        for request in sched.running.values():
            if request.num_computed_tokens == request.num_tokens - 1:
                n = min(w["num_drafts"], sched.max_spec_tokens(request))
                request.spec_token_ids = [5 + rng.randrange(3) for _ in range(n)]
                # Admission's projection covers every draft that could be accepted.
                assert request.num_tokens + n <= request.max_num_tokens
    assert not sched.has_unfinished()
    assert sched.kv_cache.usage() == 0
    sched.kv_cache.check_integrity()


def test_rejected_drafts_give_their_blocks_back():
    sched, clock = make_scheduler(num_blocks=16, block_size=2, budget=64, prefix_caching=False)
    request = make_request("r", num_prompt=3, max_tokens=20)
    sched.add_request(request)
    out = sched.schedule()
    sched.update(out, {"r": 5})
    request.spec_token_ids = [6, 6, 6, 6, 6, 6]
    out = sched.schedule()
    assert out.chunks[0].num_new_tokens == 7 and out.num_batched_tokens == 7
    assert sched.kv_cache.num_held_blocks("r") == 5  # 10 slots: positions 0..9
    sched.update(out, {"r": 9}, {"r": 1})
    assert request.output_token_ids == [5, 6, 9]
    assert request.num_computed_tokens == 5
    assert sched.kv_cache.num_held_blocks("r") == 3  # the pending token's slot (position 5) kept


def test_drafts_without_room_are_dropped_not_preempting():
    sched, _ = make_scheduler(num_blocks=4, block_size=2, budget=64, prefix_caching=False)
    first, second = make_request("a", num_prompt=3, max_tokens=20), make_request("b", num_prompt=3, max_tokens=20)
    for request in (first, second):
        sched.add_request(request)
    sched.update(sched.schedule(), {"a": 5, "b": 5})
    first.spec_token_ids = [6, 6, 6, 6]  # would need 2 more blocks: only 0 free
    out = sched.schedule()
    assert [c.num_new_tokens for c in out.chunks] == [1, 1]
    assert not out.preempted_ids and first.spec_token_ids == []


def test_drafts_count_against_the_token_budget():
    sched, _ = make_scheduler(num_blocks=64, block_size=4, budget=4, prefix_caching=False)
    request = make_request("r", num_prompt=3, max_tokens=20)
    sched.add_request(request)
    sched.update(sched.schedule(), {"r": 5})
    request.spec_token_ids = [6] * 8
    out = sched.schedule()
    assert out.chunks[0].spec_token_ids == (6, 6, 6) and out.num_batched_tokens == 4
