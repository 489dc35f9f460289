"""The capacity report's resource, task, per-unit and startup sections."""

from __future__ import annotations

import json
import os

import pytest

from kvserve import cli
from kvserve.bench.capacity import ResourceMeter, per_unit, startup_summary, task_summary
from kvserve.bench.report import SLO, RequestRecord
from tests.fake_openai_server import FakeOpenAIServer, Script, serve_in_thread

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.5)


def _record(index: int, outcome: str = "success", ttft_s: float = 0.1, sent_s: float | None = None) -> RequestRecord:
    sent = float(index) if sent_s is None else sent_s
    events = ((sent + ttft_s, 1), (sent + ttft_s + 0.05, 1)) if outcome == "success" else ()
    return RequestRecord(index, outcome, sent, sent, token_events=events, end_s=sent + ttft_s + 0.05,
                         output_tokens=2 if outcome == "success" else 0)


def test_a_task_succeeds_only_when_all_its_requests_do():
    records = [_record(0), _record(1), _record(2, "rejected"),  # task 0: one refused
               _record(3), _record(4, ttft_s=2.0), _record(5),  # task 1: one slow
               _record(6)]  # task 2: a partial group
    tasks = task_summary(records, 3, SLO_1S)
    assert tasks == {"task_size": 3, "num_tasks": 3, "successful_tasks": 2, "good_tasks": 1}
    unit = per_unit({"outcomes": {"success": 6}, "cost_total": 12.0}, {"energy_j": 600.0}, tasks)
    assert unit == {"cost_per_successful_request": 2.0, "cost_per_successful_task": 6.0,
                    "energy_per_successful_request_j": 100.0, "energy_per_successful_task_j": 300.0}
    with pytest.raises(ValueError):
        task_summary(records, 0, SLO_1S)


def test_startup_lists_the_first_requests_ttft_in_send_order():
    records = [_record(i, ttft_s=0.5 if i < 2 else 0.1, sent_s=10.0 - i) for i in range(8)]
    startup = startup_summary(records, time_to_ready_s=3.5)
    # Sent last-index-first: the two slow ones (indexes 0, 1) were sent last.
    assert startup["first_requests_ttft_s"] == pytest.approx([0.1] * 5)
    assert startup["later_ttft"]["count"] == 3 and startup["later_ttft"]["p50"] == pytest.approx(0.5)
    assert startup["time_to_ready_s"] == 3.5


def test_the_meter_counts_this_process_cpu_and_a_stated_power():
    meter = ResourceMeter(server_pid=os.getpid(), watts=50.0)
    meter.start()
    sum(i * i for i in range(2_000_000))  # some CPU
    out = meter.stop()
    assert out["server_cpu_s"] > 0 and out["server_cpu_utilization"] > 0
    if out["energy_source"] != "rapl":  # where RAPL is readable it wins
        assert out["energy_j"] == pytest.approx(50.0 * out["wall_s"])


def test_bench_writes_the_capacity_sections(tmp_path, capsys):
    with serve_in_thread(FakeOpenAIServer(Script(chunks=((0.02, 1), (0.01, 1))))) as server:
        rc = cli.main(["bench", "--base-url", server.base_url + "/v1", "--model", "fake", "--out", str(tmp_path),
                       "--no-progress", "--workload", "short", "--rate", "30", "--num-requests", "10",
                       "--task-size", "3", "--watts", "100", "--price-per-hour", "3.6",
                       "--server-pid", str(os.getpid()), "--slo", "ttft=1,tpot=0.5"])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tasks"]["num_tasks"] == 4 and report["tasks"]["successful_tasks"] == 4
    assert report["resources"]["server_cpu_s"] >= 0 and report["resources"]["energy_j"] > 0
    unit = report["per_unit"]
    assert unit["cost_per_successful_task"] == pytest.approx(report["summary"]["cost_total"] / 4)
    assert unit["energy_per_successful_request_j"] == pytest.approx(report["resources"]["energy_j"] / 10)
    assert len(report["startup"]["first_requests_ttft_s"]) == 5
    assert report["startup"]["time_to_ready_s"] is None  # not started by the run
    printed = capsys.readouterr().out
    assert "tasks of 3: 4/4 successful" in printed and "startup:" in printed


def test_simulate_states_energy_and_tasks_from_its_flags(tmp_path):
    out = tmp_path / "sim"
    assert cli.main(["simulate", "--preset", "llama-3.1-8b", "--hardware", "h100", "--rate", "5",
                     "--num-requests", "40", "--workload", "chat", "--replicas", "2", "--watts", "700",
                     "--task-size", "4", "--out", str(out), "--seed", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    duration = report["config"]["simulation"]["simulated_s"]
    assert report["resources"]["energy_j"] == pytest.approx(700 * 2 * duration)
    assert report["tasks"]["num_tasks"] == 10
    assert report["per_unit"]["energy_per_successful_task_j"] == pytest.approx(
        report["resources"]["energy_j"] / report["tasks"]["successful_tasks"])
