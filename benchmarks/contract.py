"""The request contract's cost (issue 20's benchmark), on the default model
(SmolLM2-135M-Instruct): TPOT with a json_schema mask vs without, at batch 1
and batch 16, measured side by side in one run (interleaved repeats,
medians); then multi-LoRA throughput, a batch over 4 adapters against the
base alone (benchmarks/multi_lora.py's `measure`, run here on its own
engine; `--sections structured` skips it). One table of both parts' arms,
each against its part's reference (plain at the same batch; the base
model), and one JSON (--out) holding both.

Targets (issue 20): the mask costs <= 10% TPOT at batch 16; the 4-adapter
batch keeps >= 0.8x the base model's throughput.

Both arms decode the same number of tokens per request: the schema (an array
of at least `--tokens` integers) cannot complete before max_tokens, and the
unconstrained arm ignores EOS. The masked arm's TPOT holds the grammar's
mask fill, the bitmask unpack and the masked logits; the compile happens
before the timed run (cached by the schema's hash).

On a shared machine wall-clock TPOT swings with other processes' load (the
2-core dev box runs several engineers' tests), so the masked arm also times
its constraint work directly inside the same steps: the mask (fill, unpack,
apply) and the grammar's advance per token, as a share of its step time.
That share is the overhead's low-noise estimate; the TPOT ratio is the
end-to-end figure.

    .venv/bin/python benchmarks/contract.py [--tokens 48] [--repeats 3] [--sections structured multi_lora]
        [--lora-batch 16 --lora-tokens 48 --lora-repeats 3 --lora-rank 16] [--out benchmarks/results/contract.json]
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

import multi_lora  # benchmarks/ is the script's folder: on sys.path
from kvserve import LLM, SamplingParams
from kvserve.contract import StructuredOutput

OUT = Path(__file__).parent / "results" / "contract.json"
PROMPT = [{"role": "user", "content": "List some numbers as a JSON array."}]


def arms(num_tokens: int) -> dict[str, SamplingParams]:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": num_tokens}
    return {"plain": SamplingParams(max_tokens=num_tokens, ignore_eos=True),
            "json_schema": SamplingParams(max_tokens=num_tokens,
                                          structured_output=StructuredOutput("json", schema))}


class ConstraintTimer:
    """Wall time inside the engine's constraint work: the sampler's grammar
    masks and the core's grammar advance (wrapped on the instances)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        sampler, core = llm.engine.runner.sampler, llm.engine
        sampler._apply_grammar_masks = self._timed(sampler._apply_grammar_masks)
        core._advance_grammar = self._timed(core._advance_grammar)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run_arm(llm: LLM, timer: ConstraintTimer, params: SamplingParams, batch: int) -> dict:
    """One batch of requests: median TPOT, tokens per request (min), and the
    constraint work per step against the step time (the batch's TPOT)."""
    before = timer.seconds
    start = time.perf_counter()
    outputs = llm.chat([PROMPT] * batch, params)
    wall_s = time.perf_counter() - start
    num_steps = max(len(o.token_ids) for o in outputs)  # one decode step per token (the prefill is one step)
    return {"tpot_s": statistics.median(o.latency.tpot_s for o in outputs),
            "tokens": min(len(o.token_ids) for o in outputs),
            "constraint_s_per_step": (timer.seconds - before) / num_steps, "step_s": wall_s / num_steps}


def summarise(batch: int, runs: dict[str, list[dict]]) -> dict:
    median = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
    plain, masked = median("plain", "tpot_s"), median("json_schema", "tpot_s")
    constraint = median("json_schema", "constraint_s_per_step")
    return {"batch": batch, "tokens_per_request": {n: min(r["tokens"] for r in rs) for n, rs in runs.items()},
            "tpot_ms_plain": round(1e3 * plain, 3), "tpot_ms_json_schema": round(1e3 * masked, 3),
            "tpot_overhead": round(masked / plain - 1, 4),
            "constraint_ms_per_step": round(1e3 * constraint, 4),
            "constraint_share_of_step": round(constraint / median("json_schema", "step_s"), 5),
            "runs": {n: [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rs]
                     for n, rs in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per arm and batch size")
    parser.add_argument("--batches", default="1,16", help="batch sizes (sequences), comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sections", nargs="+", default=["structured", "multi_lora"],
                        choices=["structured", "multi_lora"], help="which figures to measure")
    multi_lora.add_arguments(parser, prefix="lora-")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"benchmark": "contract", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if "structured" in args.sections:
        result["structured_output"] = structured_output(args)
    if "multi_lora" in args.sections:
        result["multi_lora"] = multi_lora.measure(args.lora_batch, args.lora_tokens, args.lora_repeats,
                                                  args.lora_rank, args.lora_arms)
    print_table(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


STRUCTURED_TARGET_BATCH, STRUCTURED_TARGET = 16, 0.10  # issue 20: <= 10% TPOT at batch 16
LORA_TARGET = 0.8  # issue 20: the 4-adapter batch >= 0.8x the base's throughput


def print_table(result: dict) -> None:
    """Both parts' arms in one table: each arm against its part's reference
    arm (plain at the same batch; the base model), with the issue's target
    on the row it judges."""
    rows = []  # (part, arm, batch, TPOT ms, tokens/s, against the reference, in-step work, target)
    for row in result.get("structured_output", {}).get("rows", []):
        batch = row["batch"]
        rows.append(("structured", "plain", batch, row["tpot_ms_plain"], None, "ref", "", ""))
        target = ""
        if batch == STRUCTURED_TARGET_BATCH:
            verdict = {name: "met" if share <= STRUCTURED_TARGET else "missed" for name, share in
                       (("TPOT", row["tpot_overhead"]), ("in-step", row["constraint_share_of_step"]))}
            target = f"<= +{100 * STRUCTURED_TARGET:.0f}%: TPOT {verdict['TPOT']}, in-step {verdict['in-step']}"
        work = f"{row['constraint_ms_per_step']:.3f} ms ({100 * row['constraint_share_of_step']:.2f}%)"
        rows.append(("structured", "json_schema", batch, row["tpot_ms_json_schema"], None,
                     f"{100 * row['tpot_overhead']:+.1f}%", work, target))
    lora = result.get("multi_lora")
    if lora is not None:
        for arm, median in lora["median"].items():
            ratio = lora["ratios_to_base"][arm]
            target = f">= {LORA_TARGET}x: {'met' if ratio >= LORA_TARGET else 'missed'}" if arm == "4_adapters" else ""
            rows.append(("multi_lora", arm, lora["batch"], 1e3 * median["tpot_s"], median["tokens_per_s"],
                         "ref" if arm == "base" else f"{ratio:.3f}x", "", target))
    print(f"{'part':<11} {'arm':<25} {'batch':>5} {'TPOT ms':>9} {'tokens/s':>9} {'vs ref':>8} "
          f"{'in-step mask work':>19}  target")
    for part, arm, batch, tpot_ms, tokens_per_s, against, work, target in rows:
        rate = "" if tokens_per_s is None else f"{tokens_per_s:.1f}"
        print(f"{part:<11} {arm:<25} {batch:>5} {tpot_ms:>9.2f} {rate:>9} {against:>8} {work:>19}  {target}")
    loads = [result["structured_output"]["load_average_1m"]] if "structured_output" in result else []
    if lora is not None:
        loads += [lora["load_average_1m"]["min"], lora["load_average_1m"]["max"]]
        print(f"multi_lora: same greedy tokens as 4_adapters: {lora['same_greedy_tokens_as_4_adapters']}")
    print(f"reference: plain at the same batch (structured), base (multi_lora); load average (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f} on {result['cpus']} CPUs")


def structured_output(args: argparse.Namespace) -> dict:
    """The mask's overhead at each batch size."""
    llm = LLM(kv_cache_memory="512MiB", max_model_len=1024)
    timer = ConstraintTimer(llm)
    params = arms(args.tokens)
    llm.engine.structured.compile(params["json_schema"].structured_output)
    for p in params.values():  # warm-up: first-step costs and the grammar's lexer states
        llm.chat([PROMPT] * 2, p)
    load_averages = [os.getloadavg()[0]]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        runs: dict[str, list[dict]] = {name: [] for name in params}
        for _ in range(args.repeats):
            for name, p in params.items():  # interleaved: load drifts hit both arms alike
                runs[name].append(run_arm(llm, timer, p, batch))
                load_averages.append(os.getloadavg()[0])
        rows.append(summarise(batch, runs))
    return {"benchmark": "contract.structured_output_overhead", "model": "SmolLM2-135M-Instruct Q4_1 (float32)",
            "target": "overhead <= 10% at batch 16", "load_average_1m": max(load_averages), "rows": rows}


if __name__ == "__main__":
    main()
