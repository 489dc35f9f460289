"""vLLM's spec_decode counters on /metrics count exactly what the engine did
on a scripted workload, and `kvserve bench`'s report reads them back."""

from __future__ import annotations

import httpx

from kvserve.bench.client import parse_metrics
from kvserve.bench.report import format_table, server_metrics_block
from tests.load_helpers import metric, scrape
from tests.server_helpers import MODEL_NAME, live_server, tiny_core
from tests.tiny_models import tiny_llama


def test_spec_decode_counters_match_a_scripted_workload(tmp_path):
    # The target as its own draft accepts every draft. A 10-token prompt with
    # max_tokens 11, k = 4: the prefill gives token 1; a verification of 4
    # drafts gives 5 more (6); the next may verify max_tokens - 6 - 1 = 4
    # drafts and gives the last 5 (11). Per request: 2 drafts, 8 draft
    # tokens, 8 accepted, 2 at each position.
    tiny_llama(seed=0).save_pretrained(tmp_path, safe_serialization=True)
    from tests.server_helpers import byte_tokenizer

    byte_tokenizer()._backend.save(str(tmp_path / "tokenizer.json"))
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 4}
    core = tiny_core(num_blocks=32, speculative_config=spec)
    with live_server(core, warm_up=False) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        before = parse_metrics(httpx.get(srv.base_url + "/metrics").text, 0.0)
        for i in range(3):
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(range(1, 11)),
                                                   "max_tokens": 11, "stream": i == 1})
            assert r.status_code == 200
        text = httpx.get(srv.base_url + "/metrics").text
        s = scrape(srv.base_url)
    assert metric(s, "vllm:spec_decode_num_drafts_total") == 6
    assert metric(s, "vllm:spec_decode_num_draft_tokens_total") == 24
    assert metric(s, "vllm:spec_decode_num_accepted_tokens_total") == 24
    for position in range(4):
        assert metric(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == 6
    assert metric(s, "vllm:generation_tokens_total") == 33
    block = server_metrics_block([before, parse_metrics(text, 1.0)])["spec_decode"]
    assert block["num_drafts"] == 6 and block["acceptance_rate"] == 1.0
    assert block["mean_accepted_length"] == 5.0 and block["acceptance_by_position"] == [1.0] * 4


def test_bench_table_shows_acceptance_beside_tpot():
    spec = {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 20.0, "acceptance_rate": 0.5,
            "mean_accepted_length": 3.0, "acceptance_by_position": [0.8, 0.6, 0.4, 0.2]}
    row = {"mean": 0.02, "p50": 0.02, "p90": 0.03, "p95": 0.03, "p99": 0.04}
    summary = {name: row for name in ("ttft", "tpot", "itl", "e2e", "queue_time")}
    summary.update(outcomes={k: 0 for k in ("success", "rejected", "failed", "cancelled", "timed_out")},
                   request_throughput=1.0, output_token_throughput=10.0, duration_s=1.0)
    summary["outcomes"]["rejected_reasons"] = {}
    from kvserve.bench import report

    summary["outcomes"] = {k: 0 for k in report.OUTCOMES} | {"rejected_reasons": {}}
    line = [ln for ln in format_table({"summary": summary, "server_metrics": {"spec_decode": spec}}).splitlines()
            if "speculative" in ln][0]
    assert "acceptance 50.0%" in line and "3 tokens per verifying step" in line
    assert "80.0%, 60.0%, 40.0%, 20.0%" in line and "TPOT p50 20.0 ms" in line
