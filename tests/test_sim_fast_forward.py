"""Fast forward (multi-step decode runs) changes nothing the simulator
reports: the same workload with it on and off gives identical per-request
timestamps, outcomes, preemptions and admission decisions."""

import dataclasses
from types import SimpleNamespace

import pytest

from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.sim.cost_model import LinearCostModel
from kvserve.fleet.autoscale import AutoscaleConfig as FleetAutoscaleConfig
from kvserve.sim.simulator import AutoscaleConfig, SimConfig, Simulator

COST = LinearCostModel(intercept_s=0.004, per_prefill_token_s=2e-5, per_decode_seq_s=2e-4,
                       per_kv_token_read_s=1e-7, per_attention_pair_s=1e-9)


def _workload(num_requests, seed, cancel=0.0, **shape):
    mix = (LengthClass("a", 1.0, LengthDist("uniform", (("min", 8), ("max", 200))),
                       LengthDist("uniform", (("min", 1), ("max", 120)))),)
    return generate_requests(WorkloadSpec(mix, cancel_rate=cancel, cancel_after_s=(0.05, 0.5), **shape),
                             num_requests, seed=seed)


def _simulate(config, specs, offsets, fast_forward, record_trace=True):
    config = dataclasses.replace(config, fast_forward=fast_forward, record_trace=record_trace)
    sim = Simulator(config, COST)
    result = sim.run(specs, offsets)
    # What each replica's admission controller measured from the steps
    # (an untraced run feeds a run's steps at once).
    step_models = [None if r.admission is None else
                   (r.admission.controller.step_model.fit(), r.admission.controller.step_model.mean_step_s,
                    r.admission.controller.step_model.mean_decode_seqs) for r in sim.replicas]
    return SimpleNamespace(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)},
                           step_models=step_models)


def _admission_calls(result):
    return [[e[1:] for e in trace if e[0] == "admission" and e[2] not in ("expired", "step_limits")]
            for trace in result.traces]


def _compare(config, specs, offsets):
    """(fast, slow, untraced fast) after checking they agree."""
    fast = _simulate(config, specs, offsets, True)
    assert fast.num_decode_runs >= 3, "the fast path must run multi-step decodes"
    slow = _simulate(config, specs, offsets, False)
    assert slow.num_decode_runs == slow.num_joined_steps == 0
    assert fast.records == slow.records  # every timestamp, outcome, token count
    assert fast.replicas == slow.replicas  # steps, busy time, preemptions, prefix hits
    assert fast.num_steps == slow.num_steps and fast.duration_s == slow.duration_s
    assert fast.replica_timeline == slow.replica_timeline
    # Every admission call that changes or decides something, with its time,
    # arguments (measured step times included) and answer. A run skips only
    # the pure queries expired() and step_limits(), which cannot bind in it.
    assert _admission_calls(fast) == _admission_calls(slow)
    schedules = [[e for e in trace if e[0] == "schedule"] for trace in slow.traces]
    fast_schedules = [[e for e in trace if e[0] == "schedule"] for trace in fast.traces]
    assert [[e[1:2] + e[3:] for e in t] for t in fast_schedules] == [[e[1:2] + e[3:] for e in t] for t in schedules]
    # Without a trace a run applies only the steps with events (and a
    # router's load read applies none): the very same results.
    untraced = _simulate(config, specs, offsets, True, record_trace=False)
    assert untraced.records == slow.records and untraced.replicas == slow.replicas
    assert untraced.step_models == slow.step_models == fast.step_models
    assert untraced.num_steps == slow.num_steps and untraced.duration_s == slow.duration_s
    assert untraced.replica_timeline == slow.replica_timeline
    return fast, slow, untraced


def _config(admission, num_blocks=400, num_replicas=1, router="least-queue", autoscale=None):
    return SimConfig(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=24, max_model_len=1024),
                     CacheConfig(num_blocks=num_blocks, block_size=16), admission,
                     num_replicas=num_replicas, router=router, autoscale=autoscale)


# Shared prefixes (prefix-cache hits, hashed blocks evicted in LRU order),
# priorities (urgency order, preemption victims) and tenants (namespaces).
SHARING = {"num_prefix_groups": 3, "prefix_tokens": 48, "prefix_share": 0.6,
           "priorities": ((0, 0.7), (1, 0.3)), "tenants": (("a", 0.5), ("b", 0.5))}


def test_fast_forward_is_exact_with_kv_pressure_and_preemptions():
    specs = _workload(150, seed=1, **SHARING)
    offsets = [i * 0.02 for i in range(len(specs))]
    fast, slow, _ = _compare(_config(None, num_blocks=60), specs, offsets)
    assert sum(r["num_preemptions"] for r in slow.replicas) > 0, "the workload must preempt"
    assert sum(r["prefix_cache_hits"] for r in slow.replicas) > 0
    assert all(r.outcome == "success" for r in slow.records)


def test_fast_forward_is_exact_with_admission_refusals_and_timeouts():
    specs = _workload(300, seed=2, **SHARING)
    offsets = [i * 0.004 for i in range(len(specs))]
    admission = AdmissionConfig(max_queue_wait_s=0.3, max_queue_len=8, queue_timeout_s=0.5)
    fast, slow, _ = _compare(_config(admission, num_blocks=120), specs, offsets)
    outcomes = {r.outcome for r in slow.records}
    assert {"rejected", "success"} <= outcomes
    assert sum(1 for e in fast.traces[0] if e[0] == "admission" and e[2] == "step_limits") < \
        sum(1 for e in slow.traces[0] if e[0] == "admission" and e[2] == "step_limits"), "runs must happen"


def test_fast_forward_is_exact_across_replicas_with_cancels_and_autoscale():
    specs = _workload(400, seed=3, cancel=0.2)
    offsets = [i * 0.01 for i in range(len(specs))]
    autoscale = AutoscaleConfig(FleetAutoscaleConfig(max_replicas=4), interval_s=0.5, cold_start_s=1.0)
    _, slow, untraced = _compare(_config(AdmissionConfig(max_queue_wait_s=0.5), num_blocks=150, num_replicas=2,
                                         autoscale=autoscale), specs, offsets)
    assert {"cancelled", "success"} <= {r.outcome for r in slow.records}
    assert len(slow.replica_timeline) > 1
    assert untraced.num_joined_steps >= 3, "arrivals must start beside a run's decodes"


@pytest.mark.parametrize("seed", range(3))
def test_fast_forward_is_exact_for_light_steady_traffic(seed):
    # Light load: long decode runs, ended early by arrivals, each arrival's
    # prompt started beside the run's decodes in one more step of the run.
    specs = _workload(80, seed=10 + seed)
    offsets = [i * 0.15 for i in range(len(specs))]
    _, _, untraced = _compare(_config(AdmissionConfig(), num_replicas=3, router="round-robin"), specs, offsets)
    assert untraced.num_joined_steps >= 3
