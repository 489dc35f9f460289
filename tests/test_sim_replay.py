"""The simulator drives the real scheduler and admission controller: replaying
the calls it made into fresh instances gives identical decisions."""

from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.admission.controller import AdmissionController
from kvserve.scheduler.scheduler import Scheduler
from kvserve.sim.cost_model import LinearCostModel
from kvserve.sim.simulator import SIM_EOS_TOKEN_ID, SIM_TOKEN_ID, SimConfig, Simulator


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _workload(num_requests: int):
    mix = (LengthClass("a", 1.0, LengthDist("uniform", (("min", 20), ("max", 160))),
                       LengthDist("uniform", (("min", 5), ("max", 60)))),)
    return generate_requests(WorkloadSpec(mix), num_requests, seed=3)


def _config(admission: AdmissionConfig | None) -> SimConfig:
    # A small cache and a tight queue: preemptions and rejections both happen.
    return SimConfig(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=12, max_model_len=1024),
                     CacheConfig(num_blocks=48, block_size=16), admission, record_trace=True)


COST = LinearCostModel(intercept_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3,
                       per_kv_token_read_s=1e-6)


def _replay(trace, config: SimConfig):
    """Drive a fresh Scheduler (and AdmissionController) with the logged calls;
    return what they answered."""
    clock = ManualClock()
    scheduler = Scheduler(config.scheduler, config.cache, clock)
    admission = None if config.admission is None else AdmissionController(
        config.admission, config.cache.num_blocks, config.cache.block_size,
        config.scheduler.max_num_seqs, clock)
    outputs, answers, pending = [], [], None
    for entry in trace:
        clock.now_s = entry[1]
        kind = entry[0]
        if kind == "add":
            _, now, rid, prompt, max_tokens, priority, tenant, namespace = entry
            scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          arrival_time=now, eos_token_ids=(SIM_EOS_TOKEN_ID,),
                                          priority=priority, tenant=tenant, cache_namespace=namespace))
        elif kind == "schedule":
            scheduler.set_step_limits(*entry[2])
            pending = scheduler.schedule()
            outputs.append(([(c.request.request_id, c.start, c.num_new_tokens, c.samples)
                             for c in pending.chunks], list(pending.preempted_ids)))
        elif kind == "update":
            scheduler.update(pending, {c.request.request_id: SIM_TOKEN_ID for c in pending.chunks
                                       if c.samples})
        elif kind == "abort":
            scheduler.abort(entry[2])
        elif kind == "admission":
            _, _, method, args, _ = entry
            answers.append(getattr(admission, method)(*args))
    return outputs, answers


def _recorded(trace):
    outputs = [(e[3], e[4]) for e in trace if e[0] == "schedule"]
    answers = [e[4] for e in trace if e[0] == "admission"]
    return outputs, answers


def test_replay_reproduces_every_schedule_and_preemption_without_admission():
    specs = _workload(60)
    offsets = [i * 0.05 for i in range(len(specs))]
    config = _config(None)
    result = Simulator(config, COST).run(specs, offsets)
    trace = result.traces[0]
    outputs, _ = _replay(trace, config)
    recorded, _ = _recorded(trace)
    assert sum(len(p) for _, p in recorded) > 0, "the workload must force preemptions"
    assert outputs == recorded
    assert all(r.outcome == "success" for r in result.records)
    assert [r.output_tokens for r in result.records] == [s.output_tokens for s in specs]


def test_replay_reproduces_admission_decisions_and_schedules():
    specs = _workload(120)
    offsets = [i * 0.01 for i in range(len(specs))]  # overload: some are refused
    config = _config(AdmissionConfig(max_queue_wait_s=0.5, max_queue_len=16, queue_timeout_s=2.0))
    result = Simulator(config, COST).run(specs, offsets)
    trace = result.traces[0]
    outputs, answers = _replay(trace, config)
    recorded_outputs, recorded_answers = _recorded(trace)
    decisions = [a for e, a in zip([e for e in trace if e[0] == "admission"], recorded_answers)
                 if e[2] == "decide"]
    assert any(not d.admitted for d in decisions) and any(d.admitted for d in decisions)
    assert outputs == recorded_outputs
    assert answers == recorded_answers
    outcomes = {r.outcome for r in result.records}
    assert "rejected" in outcomes and "success" in outcomes
