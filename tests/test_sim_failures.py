"""Failure scenarios of `kvserve simulate` (sim/failures.py) through the
simulator's API and the command: a replica lost at a time (its requests
rerouted or lost, none unaccounted; the autoscaler replaces it), a slow
replica (a load-aware router sends it less), and the flags' errors."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.arrivals import arrival_offsets, parse_arrival
from kvserve.bench.report import build_report
from kvserve.bench.workload import generate_requests
from kvserve.cli import main
from kvserve.config import AdmissionConfig
from kvserve.fleet.autoscale import AutoscaleConfig as FleetAutoscaleConfig
from kvserve.sim.failures import ReplicaLoss, ReplicaSlowdown
from kvserve.sim.simulator import AutoscaleConfig, Simulator
from tests.test_sim_simulator import COST, SLO_2S, fixed_mix, replica_config


def _workload(rate: float, seconds: float, seed: int = 1):
    specs = generate_requests(fixed_mix(200, 30), int(rate * seconds), seed=seed)
    return specs, arrival_offsets(parse_arrival("poisson", rate), len(specs), seed=seed)


def _run(specs, offsets, **fields):
    result = Simulator(replica_config(AdmissionConfig(), **fields), COST).run(specs, offsets)
    return result, build_report(result.records, SLO_2S)["summary"]


def test_losing_one_of_two_replicas_costs_goodput_and_accounts_for_every_request():
    # Two replicas at ~24 req/s each under 40 req/s: queues at the loss.
    specs, offsets = _workload(rate=40, seconds=20)
    base, base_summary = _run(specs, offsets, num_replicas=2)
    lost, summary = _run(specs, offsets, num_replicas=2, losses=(ReplicaLoss(0, 10.0),))
    assert summary["num_good"] < base_summary["num_good"] - 50
    assert summary["goodput"] < base_summary["goodput"]
    # Every request sent ends exactly once, its record counting from its own send.
    assert [r.index for r in lost.records] == list(range(len(specs)))
    assert [r.sent_s for r in lost.records] == offsets
    # Queued there at the loss: sent on to replica 1; streaming there: lost.
    assert lost.num_rerouted > 0 and summary["outcomes"]["error"] > 0
    assert base.num_rerouted == 0 and base_summary["outcomes"]["error"] == 0
    assert lost.replica_timeline == [(0.0, 2), (10.0, 1)]
    lost_replica, other = lost.replicas
    assert lost_replica["lost_at_s"] == 10.0
    # After the loss nothing goes to replica 0; replica 1 gets the rest and the rerouted.
    assert lost_replica["num_routed"] <= sum(t < 10.0 for t in offsets)
    # Each request is routed once unless the front door refused it, again
    # when a replica's 429 was tried on the other, and again when rerouted.
    assert lost_replica["num_routed"] + other["num_routed"] == \
        len(specs) - lost.num_door_refused + lost.num_door_resent + lost.num_rerouted
    ends_after = [r for r in lost.records if r.outcome == "success" and r.end_s > 10.0]
    assert ends_after, "replica 1 goes on serving"


def test_without_a_replica_left_arrivals_get_the_gateways_503():
    specs, offsets = _workload(rate=10, seconds=10)
    result, summary = _run(specs, offsets, losses=(ReplicaLoss(0, 5.0),))
    assert len(result.records) == len(specs)
    after = [r for r in result.records if r.sent_s > 5.0]
    assert after and all(r.outcome == "rejected" and r.status_code == 503 and r.reject_reason == "no_backend"
                         for r in after)


def test_a_failure_after_the_last_request_ended_changes_nothing():
    specs, offsets = _workload(rate=10, seconds=5)
    base, _ = _run(specs, offsets, num_replicas=2)
    late, _ = _run(specs, offsets, num_replicas=2, losses=(ReplicaLoss(0, 1000.0),),
                   slowdowns=(ReplicaSlowdown(1, 2.0, from_s=1000.0),))
    assert late.records == base.records and late.duration_s == base.duration_s < 10


@pytest.mark.parametrize("router", ["least-loaded", "kv-aware"])
def test_a_slow_replica_gets_fewer_new_requests_from_a_load_aware_router(router):
    specs, offsets = _workload(rate=20, seconds=20)
    even, _ = _run(specs, offsets, num_replicas=3, router=router)
    slow, _ = _run(specs, offsets, num_replicas=3, router=router, slowdowns=(ReplicaSlowdown(0, 3.0),))
    routed = [r["num_routed"] for r in slow.replicas]
    assert routed[0] < 0.6 * min(routed[1:]), routed
    assert slow.replicas[0]["slowed_by"] == 3.0
    # Without the slowdown the same router spreads the load about evenly.
    routed_even = [r["num_routed"] for r in even.replicas]
    assert min(routed_even) > 0.8 * max(routed_even), routed_even


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_slowdown_from_a_time_leaves_what_came_before_unchanged(fast_forward):
    specs, offsets = _workload(rate=20, seconds=20)
    base, _ = _run(specs, offsets, num_replicas=2, fast_forward=fast_forward)
    later, _ = _run(specs, offsets, num_replicas=2, fast_forward=fast_forward,
                    slowdowns=(ReplicaSlowdown(0, 4.0, from_s=10.0),))
    before = [r for r in base.records if r.end_s < 10.0]
    assert before and before == [r for r in later.records if r.end_s < 10.0]
    e2e = [r.end_s - r.sent_s for r in base.records if r.sent_s > 12.0]
    e2e_later = [r.end_s - r.sent_s for r in later.records if r.sent_s > 12.0]
    assert sum(e2e_later) > 1.2 * sum(e2e)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_slowdown_takes_effect_in_the_middle_of_a_decode(fast_forward):
    # One long answer alone: a steady decode (a multi-step run when fast-forwarding).
    specs = generate_requests(fixed_mix(200, 400), 1, seed=1)
    result, _ = _run(specs, [0.0], fast_forward=fast_forward, slowdowns=(ReplicaSlowdown(0, 4.0, from_s=2.0),))
    times = [t for t, _ in result.records[0].token_events]
    gaps = [b - a for a, b in zip(times, times[1:])]
    before = [g for a, g in zip(times, gaps) if a < 1.9]
    after = [g for a, g in zip(times, gaps) if a > 2.1]
    assert before and after
    assert max(after) == pytest.approx(4 * max(before)) and min(after) == pytest.approx(4 * min(before))


def test_the_autoscaler_replaces_a_lost_replica_and_the_fleet_recovers():
    specs, offsets = _workload(rate=30, seconds=60)
    rule = AutoscaleConfig(FleetAutoscaleConfig(max_replicas=2), interval_s=2.0, cold_start_s=10.0)
    result, _ = _run(specs, offsets, num_replicas=2, autoscale=rule, losses=(ReplicaLoss(0, 10.0),))
    replacement = result.replicas[2]
    assert (replacement["started_s"], replacement["ready_s"]) == (10.0, 20.0)
    assert result.replica_timeline[:3] == [(0.0, 2), (10.0, 1), (10.0, 2)]
    assert len(result.records) == len(specs)

    def attainment(lo: float, hi: float) -> float:
        window = [r for r in result.records if lo <= r.sent_s < hi]
        return build_report(window, SLO_2S)["summary"]["slo_attainment"]
    # One replica alone cannot hold 30 req/s at a 99% promise (its admission
    # refuses or the SLO is missed for 8% with the default 1.5 s queue-wait
    # limit; the run is deterministic); two again can.
    assert attainment(10.0, 20.0) < 0.95
    assert attainment(25.0, 60.0) > 0.99


def _simulate(tmp_path, *extra: str) -> tuple[int, str]:
    args = ["simulate", "--preset", "llama-3.1-8b", "--hardware", "h100", "--workload", "chat",
            "--num-requests", "300", "--rate", "20", "--max-num-seqs", "16", "--seed", "5",
            "--slo", "ttft=2,tpot=0.1", "--replicas", "2", "--out", str(tmp_path / "out"), *extra]
    return main(args), str(tmp_path / "out")


def test_simulate_reports_what_a_lost_replica_cost(tmp_path, capsys):
    rc, out = _simulate(tmp_path, "--fail-replica", "0@5", "--router", "kv-aware")
    assert rc == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    baseline = json.loads((tmp_path / "out" / "baseline" / "report.json").read_text())
    section = report["failure_scenarios"]
    assert section["scenarios"] == ["replica 0 lost at 5 s"]
    assert section["unaccounted"] == {"baseline": 0, "with_failures": 0}
    assert section["baseline"]["num_good"] == baseline["summary"]["num_good"]
    assert section["with_failures"]["num_good"] == report["summary"]["num_good"]
    assert section["with_failures"]["num_good"] < section["baseline"]["num_good"]
    assert section["cost"]["good_requests_lost"] == \
        section["baseline"]["num_good"] - section["with_failures"]["num_good"]
    assert section["cost"]["goodput_lost"] > 0
    assert [p["from_s"] for p in section["phases"]] == [0.0, 5.0]
    assert "failure_scenarios" not in baseline
    printed = capsys.readouterr().out
    assert "failure scenarios: replica 0 lost at 5 s" in printed and "lost (stream broken)" in printed
    assert "<h2>failure scenarios</h2>" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize("flag, value, message", [
    ("--fail-replica", "0", "INDEX@SECONDS"),
    ("--fail-replica", "x@3", "INDEX@SECONDS"),
    ("--fail-replica", "0@-1", "INDEX@SECONDS"),
    ("--slow-replica", "1", "INDEX:FACTOR"),
    ("--slow-replica", "1:0.5", "INDEX:FACTOR"),
    ("--slow-replica", "1:2@", "INDEX:FACTOR"),
    ("--slow-replica", "1:nan", "INDEX:FACTOR"),
])
def test_bad_failure_flags_are_usage_errors(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        _simulate(tmp_path, flag, value)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--fail-replica", "2@5"], "replica 2 cannot be lost: the fleet starts with 2"),
    (["--slow-replica", "0:2", "--slow-replica", "0:3@4"], "replica 0 is slowed twice"),
    (["--fail-replica", "0@5", "--sweep"], "drop --sweep"),
])
def test_failure_scenarios_that_cannot_run_are_refused(tmp_path, capsys, extra, message):
    rc, _ = _simulate(tmp_path, *extra)
    assert rc == 2
    assert message in capsys.readouterr().err
