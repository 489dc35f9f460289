"""The simulated fleet runs the gateway's front door (fleet/door.py):
refused before any replica is asked when none could start a request within
its class's queue-wait limit, and a replica's own 429 tried on one other
replica within the fleet's retry budget, as `kvserve gateway` does."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

from kvserve.cli import main
from kvserve.config import AdmissionConfig
from tests.test_sim_fast_forward import SHARING, _config, _simulate, _workload


def _burst(policy: str, admission: AdmissionConfig, front_door: bool | None = None, num_replicas: int = 3,
           num_requests: int = 240, gap_s: float = 0.008):
    specs = _workload(num_requests, seed=7, **SHARING)
    offsets = [i * gap_s for i in range(len(specs))]
    config = dataclasses.replace(_config(admission, num_blocks=150, num_replicas=num_replicas, router=policy),
                                 front_door=front_door)
    return specs, _simulate(config, specs, offsets, fast_forward=True)


def _rejected(result) -> int:
    return sum(r.outcome == "rejected" for r in result.records)


def test_a_replicas_429_is_tried_on_one_other_replica():
    admission = AdmissionConfig(max_queue_wait_s=0.5)
    specs, with_door = _burst("round-robin", admission)
    _, without = _burst("round-robin", admission, front_door=False)
    assert with_door.num_door_resent > 0 and without.num_door_resent == 0
    # Round-robin alone sends a request to its turn's replica however full;
    # the door's second try takes some of what that replica refused.
    assert _rejected(with_door) < _rejected(without)
    # Each re-send is routed again over the replicas not yet tried.
    routes = Counter()
    for request, states, _ in with_door.route_trace:
        routes[len(states)] += 1
    assert routes[3] == len(specs) - with_door.num_door_refused
    assert routes[2] == with_door.num_door_resent and set(routes) == {2, 3}
    routed = sum(r["num_routed"] for r in with_door.replicas)
    assert routed == len(specs) - with_door.num_door_refused + with_door.num_door_resent
    assert [r.index for r in with_door.records] == list(range(len(specs)))


def test_the_door_refuses_before_any_replica_when_none_could_start_the_request():
    # Arrivals at twice what the three replicas drain: once their drain is
    # measured and their queues pass the limit, the door turns arrivals
    # away itself, with the gateway's 429 and reason.
    admission = AdmissionConfig(max_queue_wait_s=0.2)
    specs, result = _burst("least-loaded", admission, num_requests=600, gap_s=0.002)
    assert result.num_door_refused > 0
    refused = [r for r in result.records if r.outcome == "rejected"]
    assert all(r.status_code == 429 for r in refused)
    assert {r.reject_reason for r in refused} <= {"batch_slots", "kv_cache", "prefill_backlog"}
    assert sum(r.reject_reason in ("batch_slots", "kv_cache") for r in refused) >= result.num_door_refused
    # Without the door the replicas queue what it would have refused.
    _, without = _burst("least-loaded", admission, front_door=False, num_requests=600, gap_s=0.002)
    assert without.num_door_refused == 0
    assert sum(r["num_routed"] for r in without.replicas) == len(specs)
    assert len(result.route_trace) == len(specs) - result.num_door_refused + result.num_door_resent


def test_the_fleets_retry_budget_bounds_the_re_sends():
    generous = AdmissionConfig(max_queue_wait_s=0.5)
    spent = AdmissionConfig(max_queue_wait_s=0.5, retry_budget=0.0, retry_budget_burst=1.0)
    _, with_budget = _burst("round-robin", generous)
    _, without_budget = _burst("round-robin", spent)
    assert with_budget.num_door_resent > 1
    assert without_budget.num_door_resent <= 1  # the bucket's one starting token, never earned back


def test_one_replica_has_no_door_and_no_admission_has_none():
    admission = AdmissionConfig(max_queue_wait_s=0.5)
    _, default = _burst("round-robin", admission, num_replicas=1)
    _, off = _burst("round-robin", admission, front_door=False, num_replicas=1)
    assert default.records == off.records and default.num_door_resent == default.num_door_refused == 0
    assert not _config(None, num_replicas=3).has_front_door()
    assert _config(admission, num_replicas=2).has_front_door()


def test_simulate_reports_what_its_front_door_did(tmp_path, capsys):
    # Two replicas past their capacity: the door refuses some arrivals and
    # sends some replicas' 429s on; the report and the summary line say so.
    out = tmp_path / "out"
    assert main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "l4", "--workload", "chat",
                 "--num-requests", "300", "--rate", "30", "--max-num-seqs", "16", "--seed", "5",
                 "--router", "round-robin", "--replicas", "2", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    door = report["config"]["simulation"]["front_door"]
    assert door["on"] and door["refused"] > 0 and door["resent_on_429"] > 0
    assert report["summary"]["outcomes"]["rejected"] >= door["refused"]
    assert f"front door: {door['refused']} refused there" in capsys.readouterr().out
    # The same fleet behind a plain load balancer: each replica's 429 reaches the client.
    assert main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "l4", "--workload", "chat",
                 "--num-requests", "300", "--rate", "30", "--max-num-seqs", "16", "--seed", "5",
                 "--router", "round-robin", "--replicas", "2", "--no-fleet-door", "--out", str(tmp_path / "lb")]) == 0
    plain = json.loads((tmp_path / "lb" / "report.json").read_text())
    assert plain["config"]["simulation"]["front_door"] == {"on": False, "refused": 0, "resent_on_429": 0}
    assert plain["summary"]["outcomes"]["rejected"] > 0
    assert main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "l4", "--workload", "chat",
                 "--num-requests", "20", "--rate", "1", "--out", str(tmp_path / "one")]) == 0
    assert not json.loads((tmp_path / "one" / "report.json").read_text())["config"]["simulation"]["front_door"]["on"]
