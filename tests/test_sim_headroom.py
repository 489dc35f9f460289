"""The headroom decision (`kvserve simulate --replicas 2,3,4 --price-per-hour
--breach-price`): the same deterministic workload on each fleet size; more
replicas never breach more, and the recommended size has the smallest stated
total."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim.headroom import FleetRun, headroom_decision

# One H100 replica of Llama-3.1-8B capped at 8 running sequences cannot keep
# up with 30 chat requests/s: the fleet sizes breach very differently.
WORKLOAD = ["simulate", "--preset", "llama-3.1-8b", "--hardware", "h100", "--workload", "chat",
            "--num-requests", "240", "--rate", "30", "--max-num-seqs", "8", "--seed", "5",
            "--slo", "ttft=2,tpot=0.1", "--price-per-hour", "4", "--breach-price", "0.05"]


def _decision(tmp_path, *extra: str) -> dict:
    out = tmp_path / "headroom"
    assert main([*WORKLOAD, "--replicas", "1,2,4", "--out", str(out), *extra]) == 0
    report = json.loads((out / "report.json").read_text())
    for n in (1, 2, 4):
        assert (out / f"replicas_{n}" / "report.json").exists()
    return report


def _check(decision: dict) -> None:
    rows = decision["rows"]
    assert [r["replicas"] for r in rows] == [1, 2, 4]
    breaches = [r["breaches_per_hour"] for r in rows]
    assert breaches[0] > 0, "the workload must breach on the smallest fleet"
    assert all(later <= earlier for earlier, later in zip(breaches, breaches[1:])), breaches
    assert [r["fleet_cost_per_hour"] for r in rows] == [4, 8, 16]
    assert [r["headroom_cost_per_hour"] for r in rows] == [0, 4, 12]
    best = min(rows, key=lambda r: r["total_cost_per_hour"])
    assert decision["recommended_replicas"] == best["replicas"]


def test_the_decision_table_on_a_steady_workload(tmp_path, capsys):
    report = _decision(tmp_path)
    decision = report["headroom_decision"]
    _check(decision)
    # report.json is the recommended size's own report.
    assert len(report["config"]["simulation"]["replicas"]) == decision["recommended_replicas"]
    printed = capsys.readouterr().out
    assert "headroom decision" in printed and "<- recommended" in printed


def test_the_decision_table_on_a_diurnal_curve(tmp_path):
    _check(_decision(tmp_path, "--arrival", "diurnal:period=8,amplitude=0.8")["headroom_decision"])


def test_the_decision_arithmetic():
    runs = [FleetRun(3, 7200.0, 1000, 1000), FleetRun(2, 3600.0, 1000, 900)]
    decision = headroom_decision(runs, price_per_hour=4.0, breach_price=0.05)
    small, large = decision["rows"]
    assert small == {"replicas": 2, "fleet_cost_per_hour": 8.0, "headroom_cost_per_hour": 0.0,
                     "breach_share": 0.1, "breaches_per_hour": 100.0, "breach_cost_per_hour": 5.0,
                     "total_cost_per_hour": 13.0}
    assert large["total_cost_per_hour"] == 12.0 and decision["recommended_replicas"] == 3
    # A cheaper breach makes the headroom not worth its price.
    assert headroom_decision(runs, 4.0, 0.03)["recommended_replicas"] == 2
    with pytest.raises(ValueError):
        FleetRun(2, 3600.0, 10, 11)


def test_the_decision_needs_both_prices(capsys):
    args = [a for a in WORKLOAD if a not in ("--breach-price", "0.05")]
    assert main([*args, "--replicas", "1,2"]) == 2
    assert "--breach-price" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        main([*WORKLOAD, "--replicas", "1,x"])
    assert exit_info.value.code == 2
