"""The admission loop is written once: the server's engine loop (AsyncEngine's
engine thread) and a simulated replica, given the same arrivals and step
times, make the same admission calls with the same answers and build every
step under the same limits."""

from types import SimpleNamespace

import pytest

from kvserve.admission.controller import AdmissionController
from kvserve.admission.decision import AdmissionDecision, AdmissionRequest, Outcome, Reason
from kvserve.admission.loop import AdmissionLoop
from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request, RequestFactory, SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.core import StepResult
from kvserve.engine.outputs import RequestOutput
from kvserve.scheduler.scheduler import Scheduler
from kvserve.sim.clock import VirtualClock
from kvserve.sim.cost_model import LinearCostModel, chunk_shape
from kvserve.sim.replica import Recorded
from kvserve.sim.simulator import SIM_EOS_TOKEN_ID, SIM_TOKEN_ID, SimConfig, Simulator, synth_prompt

COST = LinearCostModel(intercept_s=0.004, per_prefill_token_s=4e-5, per_decode_seq_s=1.5e-3,
                       per_kv_token_read_s=2e-7)
# A small cache and batch, a tight queue and timeout: admits, degrades,
# refusals (kv_cache, queue_full), queue timeouts and step limits that move.
CONFIG = SimConfig(SchedulerConfig(max_num_batched_tokens=160, max_num_seqs=10, max_model_len=1024),
                   CacheConfig(num_blocks=64, block_size=16),
                   AdmissionConfig(max_queue_wait_s=0.25, max_queue_len=8, queue_timeout_s=0.3, tpot_slo_s=0.012,
                                   degrade_wait_s=0.05, degrade_max_tokens=12),
                   record_trace=True, fast_forward=False,
                   # Both sides start cold: the engine loop here runs no warm-up
                   # (a simulated replica warms up through admission/warm_up.py's
                   # warm_up, the server's own: tests/test_sim_burst_admission.py).
                   warm_up=False)
QUERIES = ("expired", "step_limits")  # pure questions; a simulated replica also asks them as it goes idle


def _output(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, request.prompt_token_ids, "", "", list(request.output_token_ids), [],
                         request.is_finished, request.finish_reason, request.num_cached_tokens, request.timestamps)


class _ReplicaCore:
    """What the engine thread needs of an EngineCore, with the runner's
    forward pass replaced as the simulator replaces it: the real scheduler,
    the step timed by the same cost model on a virtual clock, one fixed
    sampled token. `during_step` runs at each step's end, before its results
    are applied: the HTTP side adding the requests that arrived meanwhile."""

    def __init__(self, config: SimConfig, clock: VirtualClock, during_step) -> None:
        self.clock = clock
        self.scheduler = Scheduler(config.scheduler, config.cache, clock)
        self.during_step = during_step
        self.schedules: list[tuple] = []

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return None if request is None else _output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self):
        return self.scheduler.stats()

    def context_lengths(self):
        return self.scheduler.context_lengths()

    num_deferred = 0  # no grammars here

    def prefix_hit_tokens(self, request: Request) -> int:
        return self.scheduler.prefix_hit_tokens(request)

    def set_step_limits(self, limits) -> None:
        self.scheduler.set_step_limits(*limits)

    def step(self) -> StepResult:
        s = self.scheduler
        out = s.schedule()
        self.schedules.append(("schedule", self.clock.now_s, (s.max_running, s.max_batched_tokens, s.cap_idle_steps),
                               [(c.request.request_id, c.start, c.num_new_tokens, c.samples) for c in out.chunks],
                               list(out.preempted_ids)))
        self.clock.advance_to(self.clock.now_s + COST.step_time_s(chunk_shape(out.chunks)))
        self.during_step()
        progressed = s.update(out, {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples})
        return StepResult([_output(r) for r in out.finished] + [_output(r) for r in progressed], out, False)


def _specs(num_requests: int, seed: int):
    mix = (LengthClass("a", 1.0, LengthDist("uniform", (("min", 10), ("max", 200))),
                       LengthDist("uniform", (("min", 2), ("max", 60)))),)
    return generate_requests(WorkloadSpec(mix, priorities=((0, 0.8), (1, 0.2)), tenants=(("x", 0.5), ("y", 0.5))),
                             num_requests, seed=seed)


def _serve(specs, seed: int):
    """Drive the server's engine loop (AsyncEngine.run_once, the body of its
    thread) with the requests arriving in groups: during a step (decided as
    it ends) or, while the engine is idle, after a pause. Returns the
    admission calls, the steps built and each request's arrival time."""
    clock, log = VirtualClock(), []
    pending, start = [], 0
    while start < len(specs):  # groups of 1, 2, 3, 1, 2, ... requests
        pending.append(list(specs[start:start + 1 + len(pending) % 3]))
        start += len(pending[-1])
    arrivals: dict[int, float] = {}
    streams = {}
    requests = RequestFactory((SIM_EOS_TOKEN_ID,), CONFIG.cache_namespace, clock)
    steps = iter(range(10**9))

    def arrive() -> None:
        for spec in pending.pop(0):
            arrivals[spec.index] = clock.now_s
            streams[spec.index] = engine.add(requests.build(synth_prompt(spec), SamplingParams(max_tokens=spec.output_tokens,
                                                                          ignore_eos=True),
                                      request_id=f"r{spec.index}", priority=spec.priority, tenant=spec.tenant))

    def during_step() -> None:
        if pending and next(steps) % (2 + seed) == 0:
            arrive()

    core = _ReplicaCore(CONFIG, clock, during_step)
    controller = AdmissionController(CONFIG.admission, CONFIG.cache.num_blocks, CONFIG.cache.block_size,
                                     CONFIG.scheduler.max_num_seqs, clock)
    engine = AsyncEngine(core, AdmissionLoop(Recorded(controller, clock, log)))
    engine._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: fn(*args))  # the event loop, inline
    while pending or core.has_unfinished():
        if not core.has_unfinished():
            clock.advance_to(clock.now_s + 0.05)
            arrive()
        engine.run_once()
    assert not engine.streams  # every stream ended: refused, finished or aborted
    decisions = {index: stream.items.get_nowait() for index, stream in streams.items()}  # each one's first item
    return log, core.schedules, [arrivals[s.index] for s in specs], decisions


def _calls(log):
    """(time, method, args, answer) of each call that decides or changes
    something. A start carries its own time (the schedule's) and reads no
    clock, so when it is reported does not count: the engine thread learns
    of it when the step returns, a replica as it schedules."""
    return [(None if entry[2] == "on_start" else entry[1], *entry[2:]) for entry in log
            if entry[0] == "admission" and entry[2] not in QUERIES]


@pytest.mark.parametrize("seed", range(3))
def test_server_engine_loop_and_simulated_replica_decide_and_limit_alike(seed):
    specs = _specs(150, seed)
    served_log, served_steps, arrival_s, _ = _serve(specs, seed)
    result = Simulator(CONFIG, COST).run(specs, arrival_s)
    (trace,) = result.traces
    simulated_steps = [e for e in trace if e[0] == "schedule"]
    assert served_steps == simulated_steps  # every step: its time, its limits, its chunks, its preemptions
    assert _calls(served_log) == _calls(trace)  # every decision, start, finish and step time, with its answer
    # The comparison is only as strong as what happened.
    decisions = [e[4] for e in trace if e[0] == "admission" and e[2] == "decide"]
    outcomes = {(d.outcome, d.reason) for d in decisions}
    assert {(Outcome.ADMIT, None), (Outcome.DEGRADE, None)} <= outcomes
    assert any(d.outcome == Outcome.REJECT for d in decisions)
    assert any(r.outcome == "timed_out" and r.reject_reason == Reason.QUEUE_TIMEOUT for r in result.records)
    assert len({e[2] for e in simulated_steps}) >= 4, "the step limits must move"


def test_each_stream_opens_with_its_decision_and_a_degraded_request_runs_capped():
    specs = _specs(150, 0)
    log, _, _, decisions = _serve(specs, 0)
    decided = {e[3][0].request_id: e[4] for e in log if e[2] == "decide"}
    assert all(isinstance(d, AdmissionDecision) for d in decisions.values())
    assert {f"r{index}": d for index, d in decisions.items()} == decided
    held = {e[3][0]: e[3][1] for e in log if e[2] == "on_finish"}  # prompt + output tokens at the end
    capped = [s for s in specs if decided[f"r{s.index}"].outcome == Outcome.DEGRADE]
    assert capped and all(held[f"r{s.index}"] <= s.prompt_tokens + 12 < s.prompt_tokens + s.output_tokens
                          for s in capped if s.output_tokens > 12)


def test_a_degraded_request_leaves_the_decision_with_max_and_min_tokens_capped():
    # A full cache and one request queued already (within the cold allowance):
    # a long request fits only degraded (as test_admission's degrade test).
    clock = VirtualClock()
    config = AdmissionConfig(degrade_wait_s=0.5, degrade_max_tokens=16)
    loop = AdmissionLoop(AdmissionController(config, 10, 16, 64, clock))
    factory = RequestFactory((0,), "ns", clock)
    for _ in range(9):
        assert loop.decide(factory.build([1] * 16, SamplingParams(max_tokens=16)), 0).admitted
    long = factory.build([1] * 16, SamplingParams(max_tokens=64, min_tokens=30))
    params = long.sampling_params
    decision = loop.decide(long, 0)
    assert (decision.outcome, decision.max_tokens) == (Outcome.DEGRADE, 16)
    assert (long.sampling_params.max_tokens, long.sampling_params.min_tokens) == (16, 16)
    assert long.sampling_params == SamplingParams(max_tokens=16, min_tokens=16) and params.max_tokens == 64


def test_while_the_cache_evicts_a_queued_request_counts_only_the_prefix_hit_a_running_request_holds():
    # A prompt served once leaves its blocks cached but held by no one; the
    # same prompt sent again is admitted on that hit. Once another request's
    # allocation evicts blocks, unheld ones are the next to go: the queued
    # request's prefill is counted in full again, and the backlog the next
    # arrival waits behind says so from the next step on (counted at the
    # door's value, a queue re-sending prompts the cache was dropping
    # waited 9 s behind a 1.5 s limit).
    clock = VirtualClock()
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=1024),
                          CacheConfig(num_blocks=24, block_size=16), clock)
    controller = AdmissionController(AdmissionConfig(max_queue_wait_s=10.0, tpot_slo_s=1.0, ttft_slo_s=40.0),
                                     24, 16, 4, clock)
    controller.observe_steps([(0, p, 0.002 * p) for p in (64, 128, 256)] * 4)  # 2 ms a prompt token
    loop = AdmissionLoop(controller)
    requests = RequestFactory((SIM_EOS_TOKEN_ID,), CONFIG.cache_namespace, clock)
    prompt = list(range(1, 257))  # 16 blocks

    def run_to_end(request: Request) -> None:
        scheduler.add_request(request)
        while not request.is_finished:
            out = scheduler.schedule()
            scheduler.update(out, {c.request.request_id: SIM_TOKEN_ID for c in out.chunks if c.samples})

    run_to_end(requests.build(prompt, SamplingParams(max_tokens=1, ignore_eos=True), request_id="first"))
    other = requests.build(list(range(1000, 1256)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="other")
    scheduler.add_request(other)  # ahead in the scheduler's queue, not admission's
    again = requests.build(prompt, SamplingParams(max_tokens=1, ignore_eos=True), request_id="again")
    hit = scheduler.prefix_hit_tokens(again)
    assert hit >= 224, hit
    assert loop.decide(again, hit, num_evicted_blocks=scheduler.num_evicted_blocks).admitted
    scheduler.add_request(again)
    arrival = AdmissionRequest("next", 256, 1)
    before_s, _ = controller.expected_wait_s(arrival)
    loop.before_step(0, lambda rid, reason: None, scheduler)  # nothing evicted yet: nothing changes
    assert controller.expected_wait_s(arrival)[0] == before_s

    out = scheduler.schedule()  # `other`'s 16 prompt blocks: 8 come from evicting `first`'s
    assert [c.request.request_id for c in out.chunks] == ["other"] and scheduler.num_evicted_blocks >= 8
    scheduler.update(out, {"other": SIM_TOKEN_ID})  # prefilled: it decodes on, holding its blocks
    assert scheduler.prefix_hit_tokens(again) > 0  # a head survives, held by no one: the next eviction's
    assert scheduler.held_prefix_hit_tokens("again") == 0
    loop.before_step(1, lambda rid, reason: None, scheduler)
    after_s, binding = controller.expected_wait_s(arrival)
    assert binding == Reason.PREFILL_BACKLOG
    # Before, only the KV blocks `again` pins (its whole prompt) were ahead;
    # now its whole prefill is too.
    assert before_s < 0.9 * 0.002 * hit <= after_s, (before_s, after_s)
    assert scheduler.held_prefix_hit_tokens("other") is None  # started: not a queued request

    # A hit on blocks a running request holds is not at risk: `other` holds
    # its prompt's blocks while it runs, so a prompt behind its first 128
    # tokens can count them.
    sibling = requests.build(list(range(1000, 1128)) + list(range(5000, 5128)),
                             SamplingParams(max_tokens=1, ignore_eos=True), request_id="sibling")
    scheduler.add_request(sibling)
    assert scheduler.held_prefix_hit_tokens("sibling") == 128
