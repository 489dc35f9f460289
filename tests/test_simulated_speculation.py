"""`kvserve serve --simulate` with speculative decoding: the engine's own
speculator and policy propose placeholder drafts, the simulated runner draws
their fate at --spec-acceptance-rate and adds the proposer's time, and
/metrics reports vLLM's spec_decode counters as a live server would, over
HTTP."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx

from kvserve.sim.cost_model import LinearCostModel, chunk_shape
from kvserve.sim.simulated_runner import SimulatedRunner
from kvserve.sim.speculation import SimSpeculation
from tests.fleet_helpers import simulated_backend
from tests.load_helpers import metric, scrape

# The policy off: every decoding request speculates every step it has room to.
ALWAYS = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}


def completion_tokens(url: str, max_tokens: int) -> int:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def test_simulated_server_reports_spec_decode_counters_for_what_its_steps_did():
    # Acceptance 1: a 17-token answer is the prefill's token, then 4 verifications
    # of 3 drafts that each give 4 tokens. Acceptance 0: a 5-token answer
    # verifies 3, 2, then 1 draft (max_tokens leaves room for no more), none kept.
    spec = json.dumps(ALWAYS)
    procs = [simulated_backend(None, "--speculative-config", spec, "--spec-acceptance-rate", str(rate))
             for rate in (1.0, 0.0)]
    try:
        for proc in procs:
            proc.wait_ready()
        accepting, rejecting = (p.url for p in procs)
        assert completion_tokens(accepting, 17) == 17
        s = scrape(accepting)
        assert metric(s, "vllm:spec_decode_num_drafts_total") == 4
        assert metric(s, "vllm:spec_decode_num_draft_tokens_total") == 12
        assert metric(s, "vllm:spec_decode_num_accepted_tokens_total") == 12
        for position in range(3):
            assert metric(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == 4
        assert metric(s, "vllm:generation_tokens_total") == 17

        assert completion_tokens(rejecting, 5) == 5
        s = scrape(rejecting)
        assert metric(s, "vllm:spec_decode_num_drafts_total") == 3
        assert metric(s, "vllm:spec_decode_num_draft_tokens_total") == 3 + 2 + 1
        assert metric(s, "vllm:spec_decode_num_accepted_tokens_total") == 0
        assert metric(s, "vllm:generation_tokens_total") == 5
    finally:
        for proc in procs:
            proc.stop()


def test_a_verifying_step_takes_the_proposers_time_too():
    cost = LinearCostModel(intercept_s=0.05, per_prefill_token_s=0.001, per_decode_seq_s=0.01,
                           per_kv_token_read_s=0.0, per_attention_pair_s=0.0)
    slept = []
    runner = SimulatedRunner(cost, 64, [11, 12], clock=lambda: 0.0, sleep=slept.append,
                             speculation=SimSpeculation(acceptance_rate=1.0, proposer_cost_s=0.002))
    chunks = [SimpleNamespace(request=SimpleNamespace(request_id=rid), start=10, num_new_tokens=1 + len(drafts),
                              samples=True, spec_token_ids=drafts, is_decode=True)
              for rid, drafts in (("a", (11, 11, 11)), ("b", (11,)), ("c", ()))]
    # The speculator proposed 4 drafts for "a" (its longest): the scheduler kept 3.
    out = runner.execute(SimpleNamespace(chunks=chunks), num_draft_passes=4)
    assert out.num_accepted == {"a": 3, "b": 1}  # acceptance 1: every draft; c verified none
    assert abs(slept[0] - (cost.step_time_s(chunk_shape(chunks)) + 4 * 0.002)) < 1e-9  # the proposer's 4 passes
