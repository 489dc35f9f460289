"""Property tests over random workloads: the scheduler's invariants hold after
every step, whatever arrives, aborts or gets preempted."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.contract import RequestStatus
from tests.scheduler_helpers import EOS, NON_EOS, make_request, make_scheduler

request_spec = st.fixed_dictionaries({
    "arrival_step": st.integers(0, 30),
    "num_prompt": st.integers(1, 60),
    "max_tokens": st.integers(1, 24),
    "priority": st.integers(0, 2),
    "tenant": st.sampled_from(["a", "b"]),
    "prefix": st.integers(0, 2),  # requests with the same prefix id share leading tokens
    "abort_after": st.one_of(st.none(), st.integers(0, 20)),
    "eos_at": st.one_of(st.none(), st.integers(1, 24)),
})

workload = st.fixed_dictionaries({
    "requests": st.lists(request_spec, min_size=1, max_size=25),
    "num_blocks": st.integers(16, 48),
    "block_size": st.sampled_from([2, 4, 8]),
    "budget": st.integers(8, 96),
    "max_seqs": st.integers(1, 8),
    "prefix_caching": st.booleans(),
})


def build(spec, i):
    prefix = [1000 * (spec["prefix"] + 1) + k for k in range(min(spec["num_prompt"], 24))]
    tail = [10 * i + k + 1 for k in range(spec["num_prompt"] - len(prefix))]
    req = make_request(f"r{i}", max_tokens=spec["max_tokens"], priority=spec["priority"],
                       tenant=spec["tenant"])
    req.prompt_token_ids[:] = prefix + tail
    return req


def waiting_effective(sched, now):
    return {r.request_id: (r.priority, sched.waiting.effective_priority(r, now)) for r in sched.waiting}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workloads_keep_every_invariant(w):
    sched, clock = make_scheduler(num_blocks=w["num_blocks"], block_size=w["block_size"],
                                  budget=w["budget"], max_seqs=w["max_seqs"],
                                  prefix_caching=w["prefix_caching"], aging_s=0.5)
    specs = w["requests"]
    reqs = [build(s, i) for i, s in enumerate(specs)]
    added, refused = {}, set()
    max_steps = 40 + sum(s["num_prompt"] + s["max_tokens"] for s in specs) * 4
    for step_no in range(max_steps):
        for i, (spec, req) in enumerate(zip(specs, reqs)):
            if spec["arrival_step"] == step_no:
                req.arrival_time = clock.now
                req.timestamps.arrival = clock.now
                try:
                    sched.add_request(req)
                    added[req.request_id] = step_no
                except ValueError:
                    refused.add(req.request_id)  # can never fit this cache
            abort_after = spec["abort_after"]
            if abort_after is not None and added.get(req.request_id) == step_no - abort_after:
                sched.abort(req.request_id)
        before = waiting_effective(sched, clock.now)
        out = sched.schedule()
        # Budget and sequence cap are never exceeded.
        assert out.num_batched_tokens <= w["budget"]
        assert sum(c.num_new_tokens for c in out.chunks) == out.num_batched_tokens
        assert len(out.chunks) <= w["max_seqs"] and len(sched.running) <= w["max_seqs"]
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        check_priority_order(sched, out, before)
        sampled = {}
        for c in out.chunks:
            if c.samples:
                spec = specs[int(c.request.request_id[1:])]
                eos = spec["eos_at"] is not None and c.request.num_output_tokens + 1 == spec["eos_at"]
                sampled[c.request.request_id] = EOS if eos else NON_EOS
        clock.now += 0.01
        sched.update(out, sampled)
        sched.kv_cache.check_integrity()
        if step_no > max(s["arrival_step"] for s in specs) and not sched.has_unfinished():
            break
    # Every request finished or was aborted within the step bound.
    assert not sched.has_unfinished(), "requests still unfinished after the step bound"
    for req in reqs:
        assert req.request_id in refused or req.status.is_finished
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.sampling_params.max_tokens or \
                req.num_tokens > sched.kv_cache.num_blocks * w["block_size"] - 1
    # No block leaks: idle means everything is free or cached.
    assert sched.kv_cache.usage() == 0
    assert sched.kv_cache.num_free_blocks == w["num_blocks"]


def check_priority_order(sched, out, before):
    """A request that started this step came from a class whose longest-waiting
    member had aged to at least the urgency of every higher-priority request
    left waiting."""
    started = [c.request for c in out.chunks if c.request.request_id in before]
    still_waiting = waiting_effective(sched, sched.clock())
    for s in started:
        class_best = min(eff for prio, eff in before.values() if prio == s.priority)
        for rid, (prio, eff) in still_waiting.items():
            if rid in before and prio < s.priority:
                assert class_best <= eff + 1e-9, f"{s.request_id} (p{s.priority}) passed {rid} (p{prio})"
