"""Speculative decoding on the default model (SmolLM2-135M-Instruct), with
and without it, side by side in one run.

Workloads (greedy, chat template, natural stops up to --max-tokens):
- repeat: "repeat / lightly edit this passage" prompts whose answer copies
  the prompt (what prompt lookup is for: RAG quoting, code edits, summaries);
- chat: open questions whose answer does not repeat the prompt.
Configurations, one engine each (same weights, same KV size):
- off: no speculation;
- ngram: prompt lookup, k = 4, n in 2..4, with the default when-not-to-
  speculate policy (scheduler/speculation.py: a request drafts while its
  acceptance EWMA beats the break-even of the step's batch, a bar rising
  from min_acceptance_rate at batch 1; under it, a one-draft probe);
- ngram-cutoff-1: the same with disable_by_batch_size 1, the rule before the
  bar rose with the batch (batch 1's bar is min_acceptance_rate either way;
  no drafts in a step decoding more than one sequence);
- ngram-always: the same drafts with the policy off, to show where it loses.
At batch sizes 1, 2, 4 and 8 (that many requests added at once, run to the
end). Rounds interleave the configurations, each round in another order
(rotated), so neither a drifting shared machine nor going first favours one;
the load average is recorded.

Reports per (workload, batch, config): TPOT p50 / p99 over requests (the one
definition, kvserve.latency), single-stream decode speed (output tokens per
decode second, per request; its ratio to off pooled and per round), output
tokens per CPU second of the process over off's (on a shared machine a
step's wall time includes waiting for a core; with --threads 1 its CPU time
is the step's own work), accepted tokens per verifying step (1 +
accepted / drafts), acceptance rate, draft overhead (proposer wall time as
a share of the run), and whether greedy outputs were token-identical to
`off`'s. A last check runs the default model as its own draft model: an
identical draft must accept every draft token.

    python benchmarks/speculative.py                 # 2 rounds, 128 tokens
    python benchmarks/speculative.py --quick         # 1 round, 48 tokens, batch 1 and 4
    python benchmarks/speculative.py --workloads chat --configs off,ngram --batches 4,16 --rounds 8

Writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kvserve.contract import SamplingParams
from kvserve.engine.core import EngineConfig, EngineCore
from kvserve.latency import derive_latency
from kvserve.model.loader import load_model
from kvserve.model_facts.default_model import default_model_path

RESULTS = Path(__file__).parent / "results" / "speculative.json"

PASSAGES = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "members agreed to fund the reading room, the children's corner and the late opening hours, but "
    "asked the architect to reduce the cost of the roof garden by one third before the next meeting.",
    "To install the package, download the archive, unpack it into your home directory and run the setup "
    "script. The script checks the version of Python, creates a virtual environment, installs the "
    "dependencies and finally prints the path of the configuration file that you should edit.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\n\ndef variance(values):\n    mean = average(values)\n    return average([(v - mean) ** 2 "
    "for v in values])\n",
    "Our order number 48213 arrived on the third of May with two items missing: the blue desk lamp and the "
    "set of four glass jars. The invoice lists both items as delivered. Please send the missing items or "
    "refund their price to the card used for the purchase.",
]
REPEAT_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text without changing anything:\n\n{}",
    "Rewrite the following text exactly as it is:\n\n{}",
    "Repeat the text below verbatim:\n\n{}",
]
CHAT_QUESTIONS = [
    "Why is the sky blue?", "Give me three tips for a job interview.", "What is a black hole?",
    "Write a short poem about autumn.", "How do vaccines work?", "Explain what a database index is.",
    "What should I cook for dinner tonight?", "Describe the water cycle.",
]
CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "ngram-cutoff-1": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2, "disable_by_batch_size": 1},
    "ngram-always": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2, "disable_by_batch_size": None, "min_acceptance_rate": 0.0},
}


def prompts_for(workload: str, count: int, offset: int) -> list[list[dict]]:
    if workload == "repeat":
        return [[{"role": "user", "content": REPEAT_INSTRUCTIONS[(offset + i) % 4].format(
            PASSAGES[(offset + i) % len(PASSAGES)])}] for i in range(count)]
    return [[{"role": "user", "content": CHAT_QUESTIONS[(offset + i) % len(CHAT_QUESTIONS)]}]
            for i in range(count)]


def build_engine(loaded, spec: dict | None) -> EngineCore:
    config = EngineConfig.from_sizes("512MiB", max_num_seqs=64, max_num_batched_tokens=512,
                                     speculative_config=spec)
    return EngineCore(loaded.config, loaded.weights, loaded.tokenizer, config, versions=loaded.versions)


def encode_chat(engine: EngineCore, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run_batch(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict:
    """Add every prompt at once, step to the end: per-request latencies, outputs,
    and the speculation counters of this batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = [engine.new_request(p, params) for p in prompts]
    for request in requests:
        engine.add_request(request)
    spec = engine.speculator
    before = (0, 0, 0, 0.0) if spec is None else (spec.totals.num_drafts, spec.totals.num_draft_tokens,
                                                  spec.totals.num_accepted_tokens, spec.propose_s)
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    wall_s = time.perf_counter() - started_s
    cpu_s = time.process_time() - started_cpu_s
    tpots, speeds = [], []
    for r in requests:
        ts = r.timestamps
        latency = derive_latency(ts.arrival, [(t, 1) for t in ts.token_times], ts.finished, ts.scheduled)
        if latency.tpot_s:
            tpots.append(latency.tpot_s)
            speeds.append(1.0 / latency.tpot_s)
    after = before if spec is None else (spec.totals.num_drafts, spec.totals.num_draft_tokens,
                                         spec.totals.num_accepted_tokens, spec.propose_s)
    drafts, draft_tokens, accepted, propose_s = (a - b for a, b in zip(after, before))
    return {"tpot_s": tpots, "decode_tok_per_s": speeds, "outputs": [list(r.output_token_ids) for r in requests],
            "wall_s": wall_s, "cpu_s": cpu_s, "num_steps": num_steps, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted, "propose_s": propose_s,
            "num_output_tokens": sum(len(r.output_token_ids) for r in requests)}


def _tokens_per_cpu_s(runs: list[dict]) -> float:
    return sum(r["num_output_tokens"] for r in runs) / max(1e-9, sum(r["cpu_s"] for r in runs))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(runs: list[dict], reference: list[dict] | None) -> dict:
    tpots = [t for r in runs for t in r["tpot_s"]]
    speeds = [s for r in runs for s in r["decode_tok_per_s"]]
    drafts = sum(r["num_drafts"] for r in runs)
    draft_tokens = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    wall_s = sum(r["wall_s"] for r in runs)
    out = {"tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
           "decode_tok_per_s_p50": percentile(speeds, 50), "num_requests": len(tpots),
           "num_drafts": drafts, "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
           "accepted_tokens_per_verifying_step": 1 + accepted / drafts if drafts else None,
           "output_tokens_per_step": sum(r["num_output_tokens"] for r in runs) / max(1, sum(r["num_steps"] for r in runs)),
           "draft_overhead_share": sum(r["propose_s"] for r in runs) / wall_s if wall_s else None,
           "wall_s": wall_s}
    if reference is not None:
        pairs = [(a, b) for r, ref in zip(runs, reference) for a, b in zip(r["outputs"], ref["outputs"])]
        out["identical_outputs"] = sum(a == b for a, b in pairs)
        out["compared_outputs"] = len(pairs)
    return out


def self_draft_check(loaded, max_tokens: int) -> dict:
    """The default model as its own draft: every draft token is accepted."""
    path = str(default_model_path())
    engine = build_engine(loaded, {"method": "draft_model", "model": path, "num_speculative_tokens": 4})
    prompt = encode_chat(engine, prompts_for("chat", 1, 0)[0])
    run = run_batch(engine, [prompt], max_tokens)
    return {"num_draft_tokens": run["num_draft_tokens"], "num_accepted_tokens": run["num_accepted_tokens"],
            "all_accepted": run["num_draft_tokens"] > 0 and run["num_accepted_tokens"] == run["num_draft_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, 48 tokens, batch 1 and 4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--workloads", default="repeat,chat", help="comma separated: repeat, chat")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma separated, off always included: {', '.join(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.batches = 1, 48, "1,4"
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")
    names = ["off", *(n for n in args.configs.split(",") if n != "off")]
    unknown = [w for w in workloads if w not in ("repeat", "chat")] + [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown workloads or configs: {', '.join(unknown)}")
    loaded = load_model(None, quantization="auto")  # as `kvserve serve` runs it: the Q4_1 weights, one-call decode
    engines = {name: build_engine(loaded, CONFIGS[name]) for name in names}
    load_before = os.getloadavg()
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for workload in workloads:
            for batch in batches:
                messages = prompts_for(workload, batch, round_index)
                for name in order:
                    engine = engines[name]
                    prompts = [encode_chat(engine, m) for m in messages]
                    runs.setdefault((workload, batch, name), []).append(run_batch(engine, prompts, args.max_tokens))
    load_after = os.getloadavg()
    rows = []
    for (workload, batch, name), config_runs in runs.items():
        reference = runs[(workload, batch, "off")] if name != "off" else None
        row = {"workload": workload, "batch": batch, "config": name, **summarize(config_runs, reference)}
        off = summarize(runs[(workload, batch, "off")], None)
        row["decode_speedup_vs_off"] = (row["decode_tok_per_s_p50"] / off["decode_tok_per_s_p50"]
                                        if off["decode_tok_per_s_p50"] else None)
        # The same ratio within each round (its configs ran minutes apart at
        # most): the spread says how much of a row's ratio is the machine.
        # Output tokens per CPU second of the process over off's: on a shared
        # machine a step's wall time includes waiting for a core, its CPU time
        # does not (one torch thread: the step's work is the process's CPU).
        row["cpu_speedup_vs_off"] = _tokens_per_cpu_s(config_runs) / _tokens_per_cpu_s(runs[(workload, batch, "off")])
        row["cpu_speedup_vs_off_per_round"] = [_tokens_per_cpu_s([run]) / _tokens_per_cpu_s([base]) for run, base
                                               in zip(config_runs, runs[(workload, batch, "off")])]
        row["decode_speedup_vs_off_per_round"] = [
            statistics.median(run["decode_tok_per_s"]) / statistics.median(base["decode_tok_per_s"])
            for run, base in zip(config_runs, runs[(workload, batch, "off")])
            if run["decode_tok_per_s"] and base["decode_tok_per_s"]]
        rows.append(row)
    check = self_draft_check(loaded, min(args.max_tokens, 32))
    print_table(rows)
    print(f"default model as its own draft: {check['num_accepted_tokens']} of {check['num_draft_tokens']} "
          f"draft tokens accepted (all: {check['all_accepted']})")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    result = {"benchmark": "speculative", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "load_avg_before": load_before,
                          "load_avg_after": load_after},
              "args": {"rounds": args.rounds, "max_tokens": args.max_tokens, "batches": batches,
                       "workloads": workloads},
              "configs": {name: CONFIGS[name] for name in names}, "rows": rows, "self_draft_check": check}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def print_table(rows: list[dict]) -> None:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"

    def num(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    print(f"{'workload':<8}{'batch':>6} {'config':<16}{'TPOT p50':>9}{'p99':>8}{'tok/s':>7}{'speedup':>8}"
          f"{'rounds min-max':>15}{'cpu x':>7}{'rounds min-max':>15}"
          f"{'accept':>8}{'tok/vstep':>10}{'tok/step':>9}{'draft%':>7}{'same':>7}")
    for r in rows:
        same = f"{r['identical_outputs']}/{r['compared_outputs']}" if "identical_outputs" in r else ""
        per_round = r["decode_speedup_vs_off_per_round"]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "-"
        cpu_rounds = r["cpu_speedup_vs_off_per_round"]
        cpu_spread = f"{min(cpu_rounds):.2f}-{max(cpu_rounds):.2f}" if cpu_rounds else "-"
        print(f"{r['workload']:<8}{r['batch']:>6} {r['config']:<16}{ms(r['tpot_p50_s']):>9}{ms(r['tpot_p99_s']):>8}"
              f"{num(r['decode_tok_per_s_p50'], '.1f'):>7}{num(r['decode_speedup_vs_off']):>8}{spread:>15}"
              f"{num(r['cpu_speedup_vs_off']):>7}{cpu_spread:>15}"
              f"{num(r['acceptance_rate']):>8}{num(r['accepted_tokens_per_verifying_step']):>10}"
              f"{num(r['output_tokens_per_step']):>9}"
              f"{num(None if r['draft_overhead_share'] is None else 100 * r['draft_overhead_share'], '.1f'):>7}"
              f"{same:>7}")


if __name__ == "__main__":
    main()
