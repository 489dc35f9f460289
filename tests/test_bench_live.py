"""`kvserve bench` against a live `kvserve serve` (tiny random model): a short
mixed run whose server-side request counts match the client's."""

from __future__ import annotations

import json

import pytest

from kvserve import cli
from tests.server_helpers import MODEL_NAME, live_server, slow_steps, tiny_core


def _server_successes(report: dict) -> float:
    """Requests the server finished normally (finished_reason length or stop,
    not abort) during the run, from its /metrics counters."""
    deltas = report["server_metrics"]["counters_delta"]
    return sum(v for k, v in deltas.items() if k.startswith("vllm:request_success_total")
               and 'finished_reason="abort"' not in k)


def _counter_sum(report: dict, name: str, *labels: str) -> float:
    deltas = report["server_metrics"]["counters_delta"]
    return sum(v for k, v in deltas.items() if k.startswith(name + "{") and all(lab in k for lab in labels))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_short_mixed_run_counts_match_the_server(tmp_path, endpoint):
    with live_server(default_max_tokens=16) as server:
        rc = cli.main([
            "bench", "--base-url", server.base_url, "--model", MODEL_NAME, "--endpoint", endpoint,
            "--workload", "prompt=uniform:min=8,max=40;output=uniform:min=2,max=8",
            "--arrival", "gamma:burstiness=2", "--rate", "8", "--num-requests", "16",
            "--priorities", "0:1,1:1", "--timeout", "60", "--out", str(tmp_path),
            "--metrics-interval", "0.25", "--no-progress", "--seed", "3"])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    outcomes = report["summary"]["outcomes"]
    assert sum(outcomes[k] for k in ("success", "cancelled", "rejected", "timed_out", "error")) == 16
    assert outcomes["error"] == 0 and outcomes["timed_out"] == 0
    assert outcomes["success"] >= 1
    # The server's own count of finished requests equals the client's successes.
    assert _server_successes(report) == outcomes["success"]
    # kvserve's own counters reach the report too: one front-door decision
    # per request, and an SLO verdict for every request it finished.
    assert _counter_sum(report, "kvserve_admission_decisions_total") == 16
    assert _counter_sum(report, "kvserve_admission_decisions_total", 'outcome="reject"') == outcomes["rejected"]
    assert _counter_sum(report, "kvserve_slo_requests_total", 'slo="both"') == outcomes["success"]
    # ignore_eos + min_tokens: every success produced exactly the planned tokens.
    for r in report["requests"]:
        if r["outcome"] == "success":
            assert r["output_tokens"] == r["expected_output_tokens"]
    assert report["summary"]["ttft"]["p50"] is not None
    assert "num_requests_running" in report["server_metrics"]["series"]


@pytest.mark.slow
def test_spawn_runs_against_the_default_model(tmp_path):
    """`kvserve bench --spawn`: starts `kvserve serve` on the default model,
    runs, stops it (loads SmolLM2 on this machine's CPU: slow)."""
    rc = cli.main(["bench", "--spawn", "--num-requests", "4", "--rate", "2",
                   "--out", str(tmp_path), "--no-progress", "--timeout", "120"])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    outcomes = report["summary"]["outcomes"]
    assert outcomes["success"] + outcomes["rejected"] == 4 and outcomes["success"] >= 1
    assert _server_successes(report) == outcomes["success"]


def test_server_slo_counters_and_bench_goodput_agree_with_cancellations(tmp_path):
    # Steps slowed to >= 50 ms: each request runs >= 1 s, so every cancel
    # (0.2-0.6 s after sending) lands while its request is in flight.
    core = slow_steps(tiny_core(max_num_seqs=16), 0.05)
    with live_server(core, max_queue_wait_s=30.0, ttft_slo_s=30.0, tpot_slo_s=5.0) as server:
        rc = cli.main([
            "bench", "--base-url", server.base_url, "--model", MODEL_NAME,
            "--workload", "prompt=uniform:min=8,max=16;output=uniform:min=20,max=20",
            "--rate", "20", "--num-requests", "12", "--cancel-rate", "0.4", "--cancel-after", "0.2,0.6",
            "--slo", "ttft=30,tpot=5", "--timeout", "90", "--out", str(tmp_path),
            "--metrics-interval", "0.25", "--no-progress", "--seed", "5"])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["summary"]
    outcomes = summary["outcomes"]
    assert outcomes["cancelled"] >= 1 and outcomes["success"] >= 1 and outcomes["rejected"] == 0, outcomes
    # Every request that ended has a verdict: the cancelled ones as their own result.
    assert _counter_sum(report, "kvserve_slo_requests_total", 'slo="both"') == \
        outcomes["success"] + outcomes["cancelled"]
    assert _counter_sum(report, "kvserve_slo_requests_total", 'slo="both"', 'result="cancelled"') == \
        outcomes["cancelled"]
    # Goodput read off the server is the client's.
    assert _counter_sum(report, "kvserve_slo_requests_total", 'slo="both"', 'result="met"') == summary["num_good"]
