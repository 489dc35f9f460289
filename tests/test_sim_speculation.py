"""`kvserve simulate` with speculation: the real scheduler verifies drafts
whose acceptance a rate decides, so the simulated TPOT shows what
speculation buys at a load, and what the policy turns off."""

from __future__ import annotations

import json

from kvserve.cli import main
from kvserve.config import SpeculativeConfig
from kvserve.bench.arrivals import arrival_offsets, parse_arrival
from kvserve.bench.report import build_report
from kvserve.bench.workload import generate_requests
from kvserve.sim.cost_model import LinearCostModel
from kvserve.sim.simulator import Simulator
from kvserve.sim.speculation import SimSpeculation
from tests.test_sim_simulator import SLO_2S, fixed_mix, replica_config

ALWAYS = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, min_acceptance_rate=0.0)
# A small batch where every token a step runs costs: 5 ms per step, 1 ms per
# prefill (or draft) token, 1 ms per decoding sequence.
COST = LinearCostModel(intercept_s=0.005, per_prefill_token_s=1e-3, per_decode_seq_s=1e-3, per_kv_token_read_s=0.0)


def run(speculation, rate=2.0, seconds=20):
    specs = generate_requests(fixed_mix(100, 60), int(rate * seconds), seed=1)
    offsets = arrival_offsets(parse_arrival("poisson", rate), len(specs), seed=1)
    result = Simulator(replica_config(None, speculation=speculation), COST).run(specs, offsets)
    summary = build_report(result.records, SLO_2S)["summary"]
    assert summary["outcomes"]["success"] == int(rate * seconds)
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
    _, always = run(SimSpeculation(0.0, 0.0, ALWAYS))
    assert always["tpot"]["p50"] > 1.3 * off["tpot"]["p50"]
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


def simulated_and_served_steps(speculation: SimSpeculation, prompt_tokens: int, max_tokens: int,
                               max_num_batched_tokens: int = 512):
    """One request through the simulator and through the engine under `kvserve
    serve --simulate` (its own speculator, the simulated runner): each run's
    tokens per step and seconds per step."""
    from dataclasses import replace

    from kvserve.contract import SamplingParams
    from kvserve.engine.core import EngineConfig, EngineCore
    from kvserve.sim.simulated_runner import SimulatedRunner
    from tests.tiny_models import model_config_of, random_prompts, tiny_llama, word_tokenizer

    config = replica_config(None, speculation=speculation, record_trace=True)
    config = replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=max_num_batched_tokens))
    result = Simulator(config, COST).run(generate_requests(fixed_mix(prompt_tokens, max_tokens), 1, seed=1), [0.0])
    trace = result.traces[0]
    schedule_at = [i for i, entry in enumerate(trace) if entry[0] == "schedule"]
    sim_tokens = [sum(chunk[2] for chunk in trace[i][3]) for i in schedule_at]
    # Each step's time: from its schedule to its update (the trace's next entry).
    sim_step_s = [round(trace[i + 1][1] - trace[i][1], 9) for i in schedule_at]

    slept: list[float] = []
    runner = SimulatedRunner(COST, config.cache.num_blocks, [11, 12], clock=lambda: 0.0, sleep=slept.append,
                             speculation=speculation)
    engine = EngineCore(model_config_of(tiny_llama()), None, word_tokenizer(),
                        EngineConfig(block_size=config.cache.block_size, max_num_seqs=config.scheduler.max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     speculative_config=speculation.config), runner=runner)
    engine.add_request(engine.new_request(random_prompts([prompt_tokens])[0],
                                          SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    engine_tokens = []
    while engine.has_unfinished():
        engine_tokens.append(sum(c.num_new_tokens for c in engine.step().scheduled.chunks))
    return result, (sim_tokens, sim_step_s), (engine_tokens, [round(s, 9) for s in slept])


def test_the_simulator_and_the_engine_verify_the_same_drafts_probes_included():
    """One policy, one scheduler: a simulated request whose drafts are never
    accepted verifies k drafts until its acceptance EWMA falls under the
    threshold, then one-draft probes whose wait doubles (16, 32, 64 steps),
    and each step is priced with the drafts it carries (a probe: its one
    draft token and one proposer pass). The engine under `kvserve serve
    --simulate` runs the same steps at the same cost."""
    policy = SpeculativeConfig(num_speculative_tokens=4)  # the default policy: probes after 16 steps
    speculation = SimSpeculation(acceptance_rate=0.0, proposer_cost_s=1e-3, config=policy)
    result, simulated, served = simulated_and_served_steps(speculation, prompt_tokens=30, max_tokens=150)
    assert served == simulated
    sim_tokens, sim_step_s = simulated
    verifies = [step for step, n in enumerate(sim_tokens) if n > 1 and step > 0]
    assert verifies == [1, 2, 3, 19, 51, 115]  # 3 verifications of 4, then probes 16, 32 and 64 steps apart
    assert [sim_tokens[s] for s in verifies] == [5, 5, 5, 2, 2, 2]
    # 5 ms a step, 1 ms a decoding sequence, 1 ms a draft token, 1 ms a proposer pass.
    assert [sim_step_s[s] for s in verifies] == [0.014, 0.014, 0.014, 0.008, 0.008, 0.008]
    assert sim_step_s[4] == 0.006  # a plain decode
    stats = result.replicas[0]
    assert (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]) == (3 * 4 + 3, 0)


def test_drafts_the_budget_trims_still_cost_the_proposer_the_passes_it_ran():
    """A token budget of 3 leaves room for 2 of a decode's 4 drafts: the
    proposer had already run 4 passes, and both the simulator and `serve
    --simulate` price the step with them (5 ms + 1 ms a sequence + 2 ms of
    drafts + 4 ms of proposing), not with the 2 verified."""
    speculation = SimSpeculation(acceptance_rate=0.5, proposer_cost_s=1e-3,
                                 config=SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.0))
    _, simulated, served = simulated_and_served_steps(speculation, prompt_tokens=10, max_tokens=20,
                                                      max_num_batched_tokens=3)
    assert served == simulated
    tokens, step_s = simulated
    # 3 steps of prefill (3 tokens each), then the prompt's last token with 2
    # drafts, and so on; near max_tokens the proposer itself is asked for 3,
    # then 2 drafts (11 and 10 ms), and the last token has room for none.
    assert tokens == [3] * 15 + [1]
    assert step_s == [0.008] * 3 + [0.012] * 10 + [0.011, 0.010, 0.006]


def test_simulate_sizes_the_kv_cache_net_of_a_draft_models_weights_and_cache(tmp_path):
    """A draft model in a simulation takes its weights out of the memory and
    its KV out of every block, as `kvserve serve` and `kvserve plan` do: with
    the default model as its own draft, a replica holds under half the blocks."""
    from kvserve.model_facts.default_model import default_model_path

    def num_blocks(*extra):
        out = tmp_path / str(len(extra))
        assert main(["simulate", "--preset", "smollm2-135m", "--hardware", "h100", "--memory", "4GiB",
                     "--workload", "chat", "--rate", "1", "--duration", "2", "--seed", "1", "--out", str(out),
                     "--spec-acceptance-rate", "0.5", *extra]) == 0
        return json.loads((out / "report.json").read_text())["config"]["simulation"]["num_blocks"]

    alone = num_blocks("--speculative-config", '{"method": "ngram"}')
    paired = num_blocks("--speculative-config",
                        json.dumps({"method": "draft_model", "model": str(default_model_path())}))
    assert 0 < paired < alone // 2
