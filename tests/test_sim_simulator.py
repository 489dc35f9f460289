"""Simulator behaviour through its public interface: overload with and
without admission, routing, scale-out with and without a warm pool, and the
`kvserve simulate` command."""

import json

import pytest

from kvserve.bench.arrivals import arrival_offsets, parse_arrival
from kvserve.bench.report import SLO, build_report
from kvserve.bench.workload import LengthClass, LengthDist, WorkloadSpec, generate_requests
from kvserve.cli import main
from kvserve.config import AdmissionConfig, CacheConfig, SchedulerConfig
from kvserve.sim.cost_model import LinearCostModel
from kvserve.fleet.autoscale import AutoscaleConfig as FleetAutoscaleConfig
from kvserve.sim.simulator import AutoscaleConfig, SimConfig, Simulator

# 20 ms per step + 0.05 ms per prefill token + 0.5 ms per decoding sequence:
# with 32 sequences and 200:30-token requests a replica sustains ~24 req/s.
COST = LinearCostModel(intercept_s=0.02, per_prefill_token_s=5e-5, per_decode_seq_s=5e-4,
                       per_kv_token_read_s=0.0)
SLO_2S = SLO(ttft_s=2.0, tpot_s=0.1)


def fixed_mix(prompt: int, output: int, **workload) -> WorkloadSpec:
    return WorkloadSpec((LengthClass("fixed", 1.0, LengthDist("fixed", (("value", prompt),)),
                                     LengthDist("fixed", (("value", output),))),), **workload)


def simulate(config: SimConfig, workload: WorkloadSpec, rate: float, seconds: float):
    specs = generate_requests(workload, int(rate * seconds), seed=1)
    offsets = arrival_offsets(parse_arrival("poisson", rate), len(specs), seed=1)
    result = Simulator(config, COST).run(specs, offsets)
    return result, build_report(result.records, SLO_2S)["summary"]


def replica_config(admission: AdmissionConfig | None, **fields) -> SimConfig:
    return SimConfig(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32),
                     CacheConfig(num_blocks=1024), admission, **fields)


def test_below_capacity_every_request_is_good_either_way():
    for admission in (AdmissionConfig(), None):
        _, summary = simulate(replica_config(admission), fixed_mix(200, 30), rate=15, seconds=20)
        assert summary["outcomes"]["success"] == 300
        assert summary["slo_attainment"] == 1.0


def test_admission_holds_goodput_where_no_admission_collapses():
    workload = fixed_mix(200, 30)
    _, guarded = simulate(replica_config(AdmissionConfig()), workload, rate=60, seconds=40)
    _, open_door = simulate(replica_config(None), workload, rate=60, seconds=40)
    # With the front door: the excess is refused at once and the admitted
    # work meets the promise at about the replica's capacity.
    assert guarded["outcomes"]["rejected"] > 0
    assert guarded["goodput"] > 15
    assert guarded["ttft"]["p99"] < 2.0
    # Without it: everything queues, TTFT grows without bound, goodput collapses.
    assert open_door["outcomes"]["rejected"] == 0
    assert open_door["ttft"]["p99"] > 20
    assert open_door["goodput"] < guarded["goodput"] / 4


def test_prefix_affinity_keeps_shared_prefixes_in_one_cache():
    workload = fixed_mix(300, 10, num_prefix_groups=8, prefix_tokens=256, prefix_share=1.0)
    hits = {}
    for router in ("round-robin", "prefix-affinity"):
        result, summary = simulate(replica_config(AdmissionConfig(), num_replicas=4, router=router),
                                   workload, rate=40, seconds=10)
        assert summary["outcomes"]["success"] == 400
        hits[router] = sum(r["prefix_cache_hits"] for r in result.replicas)
    # Round-robin computes each group's prefix on all 4 replicas; affinity on one.
    assert hits["prefix-affinity"] > hits["round-robin"]


def test_least_queue_spreads_load():
    result, summary = simulate(replica_config(AdmissionConfig(), num_replicas=3, router="least-queue"),
                               fixed_mix(200, 30), rate=45, seconds=10)
    steps = [r["num_steps"] for r in result.replicas]
    assert min(steps) > 0.5 * max(steps)
    assert summary["slo_attainment"] > 0.95


def test_a_warm_pool_serves_a_burst_that_a_cold_start_misses():
    burst = "step:rates=10/50,step=20"
    workload = fixed_mix(200, 30)
    offsets = arrival_offsets(parse_arrival(burst), None, 60.0, seed=2)
    specs = generate_requests(workload, len(offsets), seed=2)
    good = {}
    for warm_pool in (0, 2):
        scale = AutoscaleConfig(FleetAutoscaleConfig(max_replicas=3), interval_s=5, cold_start_s=60,
                                warm_pool=warm_pool)
        result = Simulator(replica_config(AdmissionConfig(), autoscale=scale), COST).run(specs, offsets)
        # The burst starts at 20 s; the check at 25 s sees rejections and scales out.
        assert result.replica_timeline[:2] == [(0.0, 1), (25, 2)]
        good[warm_pool] = build_report(result.records, SLO_2S)["summary"]["num_good"]
    assert good[2] > good[0] * 1.3


def test_simulate_cli_writes_the_bench_report_schema(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "h100", "--rate", "10",
               "--num-requests", "200", "--workload", "chat", "--max-num-seqs", "128",
               "--max-num-batched-tokens", "2048", "--out", str(out), "--seed", "4"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"schema_version", "config", "slo", "summary", "by_tenant",
                           "by_priority", "requests"}
    summary = report["summary"]
    assert summary["outcomes"]["success"] == 200
    # Decode on an H100 reads 16 GB of weights per step (~6 ms at 80% of
    # 3.35 TB/s) plus 2 ms overhead: TPOT sits between 8 and 30 ms.
    assert 0.008 <= summary["tpot"]["p50"] <= 0.03
    assert len(report["requests"]) == 200
    assert report["config"]["simulation"]["cost_model"]["kind"] == "roofline"
    assert "simulated" in capsys.readouterr().out


def test_a_long_simulation_keeps_its_summary_exact_and_a_sample_of_request_rows(tmp_path, monkeypatch):
    # Past EXACT_EVENTS_MAX_REQUESTS a run keeps first/last token times and
    # every k-th request's row (an hour is 180k of them); TTFT, TPOT and
    # E2E stay those of the exact run.
    from kvserve.sim import cli as sim_cli

    args = ["simulate", "--preset", "llama-3.1-8b", "--hardware", "h100", "--rate", "10",
            "--num-requests", "60", "--workload", "chat", "--seed", "4"]
    assert main(args + ["--out", str(tmp_path / "exact")]) == 0
    monkeypatch.setattr(sim_cli, "EXACT_EVENTS_MAX_REQUESTS", 50)
    assert main(args + ["--out", str(tmp_path / "long")]) == 0
    exact, long = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("exact", "long"))
    # Every second request's row (60 > 50): enough for the plots.
    assert len(exact["requests"]) == 60
    assert [r["index"] for r in long["requests"]] == list(range(0, 60, 2))
    assert all(len(r["token_events"]) <= 2 for r in long["requests"])
    assert long["config"]["simulation"]["requests_sampled_every"] == 2
    assert long["config"]["simulation"]["requests_omitted"] == 30
    assert long["config"]["simulation"]["exact_token_events"] is False
    html = (tmp_path / "long" / "report.html").read_text()
    assert "1 request in 2 (30 of 60)" in html and html.count("<svg") >= 4
    for metric in ("ttft", "tpot", "e2e"):
        assert long["summary"][metric] == exact["summary"][metric]
    assert long["summary"]["outcomes"] == exact["summary"]["outcomes"]


def test_simulate_cli_rejects_bad_input(capsys):
    assert main(["simulate", "--preset", "llama-3.1-70b", "--hardware", "l4"]) == 2
    assert "exceed" in capsys.readouterr().err
    assert main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "tpu9"]) == 2
    assert "unknown hardware" in capsys.readouterr().err


def test_simulate_cli_uses_a_local_profile_and_its_cache_size(tmp_path, capsys):
    from kvserve.sim.cost_model import profile_json

    profile = tmp_path / "profile.json"
    model = LinearCostModel(0.05, 1e-3, 1e-2, 0.0)
    profile.write_text(json.dumps(profile_json(model, {"r2": 1.0}, {"num_blocks": 300}, {}, [])))
    out = tmp_path / "sim"
    rc = main(["simulate", "--preset", "smollm2-135m", "--hardware", str(profile), "--rate", "0.5",
               "--num-requests", "20", "--workload", "short", "--slo", "ttft=3,tpot=0.5",
               "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    sim = report["config"]["simulation"]
    assert sim["num_blocks"] == 300 and sim["cost_model"]["kind"] == "linear"
    # One request alone: TTFT = one prefill step of 16..64 tokens = 50 ms + 1 ms/token.
    assert 0.066 <= report["summary"]["ttft"]["p50"] <= 0.3


def test_profiled_step_jitter_widens_the_simulated_tail_reproducibly(tmp_path):
    # One step in ten takes twice its median: at low load TTFT is about one
    # prefill step, so its p99 doubles while its p50 stays the model's.
    from kvserve.sim.cost_model import profile_json

    jitter = (1.0,) * 9 + (2.0,)
    for name, model in (("plain", LinearCostModel(0.05, 1e-3, 1e-2, 0.0)),
                        ("jitter", LinearCostModel(0.05, 1e-3, 1e-2, 0.0, step_jitter=jitter))):
        (tmp_path / f"{name}.json").write_text(
            json.dumps(profile_json(model, {"r2": 1.0}, {"num_blocks": 300}, {}, [])))

    def summary(profile: str, run: str, *flags: str) -> dict:
        rc = main(["simulate", "--preset", "smollm2-135m", "--hardware", str(tmp_path / profile),
                   "--rate", "0.02", "--num-requests", "200", "--workload", "short", "--slo", "ttft=3,tpot=0.5",
                   # A TPOT promise that never chunks these prompts, so a TTFT is one step.
                   "--tpot-slo", "0.5", "--out", str(tmp_path / run), *flags])
        assert rc == 0
        return json.loads((tmp_path / run / "report.json").read_text())["summary"]

    plain, jittered = summary("plain.json", "a"), summary("jitter.json", "b")
    assert jittered["ttft"]["p99"] > 1.5 * plain["ttft"]["p99"]
    assert jittered["ttft"]["p50"] == pytest.approx(plain["ttft"]["p50"], rel=0.1)
    assert jittered["tpot"]["p50"] > plain["tpot"]["p50"]  # a TPOT averages its steps: mean ratio 1.1
    assert summary("jitter.json", "c") == jittered  # seeded by --seed
    assert summary("jitter.json", "e", "--jitter-seed", "0") == jittered
    other = summary("jitter.json", "f", "--jitter-seed", "1")  # another realization
    assert other != jittered and other["ttft"]["p99"] > 1.5 * plain["ttft"]["p99"]
    assert summary("jitter.json", "d", "--seed", "0", "--step-jitter", "none") == plain


def test_simulator_and_planner_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, argparse\n"
            "import kvserve.sim.simulator, kvserve.sim.cost_model, kvserve.sim.cli, kvserve.plan.cli\n"
            "kvserve.sim.cli.add_arguments(argparse.ArgumentParser())\n"
            "assert 'torch' not in sys.modules, 'the simulator imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_frontend_latency_adds_to_ttft_and_e2e_not_tpot():
    # The same run seen by the client 15 ms later: every request's TTFT and
    # E2E grow by exactly that, token gaps do not change, and the engine's
    # schedule is the same one shifted in time.
    workload = fixed_mix(64, 8)
    base, _ = simulate(replica_config(AdmissionConfig()), workload, rate=5, seconds=6)
    later, _ = simulate(replica_config(AdmissionConfig(), frontend_latency_s=0.015), workload, rate=5, seconds=6)
    assert len(base.records) == len(later.records) == 30
    for a, b in zip(base.records, later.records):
        assert b.sent_s == pytest.approx(a.sent_s, abs=1e-9)
        assert b.token_events[0][0] - b.sent_s == pytest.approx(a.token_events[0][0] - a.sent_s + 0.015, abs=1e-9)
        assert b.end_s - b.sent_s == pytest.approx(a.end_s - a.sent_s + 0.015, abs=1e-9)
        assert _gaps(b) == pytest.approx(_gaps(a), abs=1e-9)
    assert later.num_steps == base.num_steps


def _gaps(record) -> list[float]:
    times = [t for t, _ in record.token_events]
    return [later - earlier for earlier, later in zip(times, times[1:])]


def test_simulate_cli_takes_a_frontend_latency(tmp_path, capsys):
    out = tmp_path / "sim"
    args = ["simulate", "--preset", "smollm2-135m", "--hardware", "l4", "--workload", "short",
            "--num-requests", "10", "--rate", "5", "--seed", "3"]
    assert main([*args, "--out", str(out / "a")]) == 0
    assert main([*args, "--frontend-latency-ms", "20", "--out", str(out / "b")]) == 0
    a = json.loads((out / "a" / "report.json").read_text())["summary"]
    b = json.loads((out / "b" / "report.json").read_text())["summary"]
    assert b["ttft"]["p50"] == pytest.approx(a["ttft"]["p50"] + 0.020, abs=1e-9)
    assert b["tpot"]["p50"] == pytest.approx(a["tpot"]["p50"], abs=1e-12)
    assert main([*args, "--frontend-latency-ms", "-1", "--out", str(out / "c")]) != 0


def test_the_serving_overhead_lengthens_every_simulated_step():
    # The same run on a profile that measured 4 ms of serving loop per
    # step: each token gap is one step, so every gap and every TTFT (one
    # prefill step for a request alone) grows by exactly 4 ms.
    import dataclasses

    workload, config = fixed_mix(64, 8), replica_config(None)
    specs = generate_requests(workload, 10, seed=1)
    offsets = [2.0 * i for i in range(10)]  # each request alone
    base = Simulator(config, COST).run(specs, offsets)
    served = Simulator(config, dataclasses.replace(COST, serving_overhead_s=0.004)).run(specs, offsets)
    assert len(base.records) == len(served.records) == 10
    for a, b in zip(base.records, served.records):
        assert b.token_events[0][0] - b.sent_s == pytest.approx(a.token_events[0][0] - a.sent_s + 0.004, abs=1e-9)
        assert _gaps(b) == pytest.approx([gap + 0.004 for gap in _gaps(a)], abs=1e-9)
        assert len(_gaps(a)) == 7


def test_a_measured_speed_drift_slows_whole_requests_in_its_slow_stretches():
    # A machine that runs 2x slow for every other second: requests alone,
    # one every 2.5 s (each is one prefill and seven decode steps, ~0.2 s),
    # land in fast and slow seconds. Every token gap of a request in a slow
    # second doubles (the drift is the machine's, not a step's), so request
    # TPOTs split into two groups, where per-step jitter would spread each
    # request's steps around one mean.
    import dataclasses

    from kvserve.sim.cost_model import JitteredCostModel, SpeedDrift

    workload, config = fixed_mix(64, 8), replica_config(None)
    specs = generate_requests(workload, 12, seed=1)
    offsets = [2.5 * i for i in range(12)]
    drift = SpeedDrift(bin_s=1.0, factors=(1.0, 2.0) * 8, block_s=16.0)  # one block: the trace as measured
    base = Simulator(config, COST).run(specs, offsets)
    drifting = Simulator(config, JitteredCostModel(COST, (), 0, drift)).run(specs, offsets)
    ratios = []
    for a, b in zip(base.records, drifting.records):
        per_gap = [gb / ga for ga, gb in zip(_gaps(a), _gaps(b))]
        assert max(per_gap) == pytest.approx(min(per_gap), rel=1e-9)  # all in one stretch
        ratios.append(per_gap[0])
    assert {round(r, 9) for r in ratios} == {1.0, 2.0}
    # Seeded: the same drift draws give the same run; no drift is the model.
    again = Simulator(config, JitteredCostModel(COST, (), 0, drift)).run(specs, offsets)
    assert [r.token_events for r in again.records] == [r.token_events for r in drifting.records]
    steady = dataclasses.replace(drift, factors=(1.0,) * 16)
    flat = Simulator(config, JitteredCostModel(COST, (), 0, steady)).run(specs, offsets)
    for a, b in zip(base.records, flat.records):
        assert _gaps(b) == pytest.approx(_gaps(a), abs=1e-12)
