"""`kvserve simulate` with speculation: the real scheduler verifies drafts
whose acceptance a rate decides, so the simulated TPOT shows what
speculation buys at a load, and what the policy turns off."""

from __future__ import annotations

import json

from kvserve.cli import main
from kvserve.config import SpeculativeConfig
from kvserve.sim.speculation import SimSpeculation
from tests.test_sim_simulator import fixed_mix, replica_config, simulate

ALWAYS = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, min_acceptance_rate=0.0)


def run(speculation, rate=2.0):
    result, summary = simulate(replica_config(None, speculation=speculation), fixed_mix(100, 60), rate=rate,
                               seconds=20)
    assert summary["outcomes"]["success"] == int(rate * 20)
    return result, summary


def test_accepted_drafts_cut_the_simulated_tpot():
    _, off = run(None)
    result, high = run(SimSpeculation(0.8, 0.0, ALWAYS))
    _, none = run(SimSpeculation(0.0, 0.0, ALWAYS))
    stats = result.replicas[0]
    accepted = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    assert 0.5 < accepted < 0.8  # a geometric run of 0.8 per position, capped at k = 4
    assert high["tpot"]["p50"] < 0.6 * off["tpot"]["p50"]
    # Nothing accepted: every step verifies 4 useless tokens, and pays for them.
    assert none["tpot"]["p50"] > off["tpot"]["p50"]


def test_the_policy_turns_losing_speculation_off_and_proposer_cost_counts():
    _, off = run(None)
    _, guarded = run(SimSpeculation(0.0, 0.0, SpeculativeConfig(probe_interval_steps=1000)))
    _, costly = run(SimSpeculation(0.8, 0.05, ALWAYS))
    # The acceptance EWMA falls below min_acceptance_rate after a few
    # verifications: the cost is a handful of steps, not the whole run.
    assert guarded["tpot"]["p50"] < 1.1 * off["tpot"]["p50"]
    assert costly["tpot"]["p50"] > off["tpot"]["p50"]  # 4 x 50 ms of proposing per step outweighs it


def test_simulate_command_takes_the_acceptance_rate(tmp_path):
    args = ["simulate", "--preset", "smollm2-135m", "--hardware", "h100", "--workload", "chat", "--rate", "2",
            "--duration", "5", "--seed", "1", "--out", str(tmp_path), "--spec-acceptance-rate", "0.7",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["outcomes"]["success"] > 0
    assert main(args[:-4]) == 0
    assert main([*args[:-4], "--speculative-config", '{"method": "ngram"}']) == 2
