"""Multi-LoRA throughput: one batch spread over 4 LoRA adapters against the
same batch on the base model alone, on the default model
(SmolLM2-135M-Instruct, Q4_1), side by side in one run (interleaved
repeats, medians).

Target (issue 20): the batch over 4 adapters keeps >= 0.8x the base model's
output-token throughput.

Arms (all in the same process, interleaved):
- base: every request on the base model (every step, prefill and decodes,
  in the one-call native step, csrc's kvq_decode_layers);
- 4_adapters: the engine as it runs: every step in the same native step
  with the adapters' update inside it (kvq_lora_step: tokens grouped by
  slot, each target's own rank);
- 4_adapters_per_layer: the update in torch (model/lora.LoraStep: two
  torch.bmm per fused linear, one thread on the CPU), every step layer by
  layer: how adapter batches ran before the native step took them;
- 4_adapters_torch_threads (--arms): that update on torch's threads (what
  the one-thread rule buys on a shared machine);
- 4_adapters_masked (--arms): the update before it was grouped (every token
  through every slot's stacked columns, `((x @ A) * mask) @ B`, on torch's
  threads), reproduced here as `MaskedStep` over the same resident slots.

The adapters are random PEFT-format folders written here (rank --rank on
all seven projections of every layer: the most work an adapter adds), so
nothing is downloaded. Both arms decode the same number of tokens per
request (EOS ignored) from the same prompt, and every request of the
adapter arm runs in the same steps as the others (max_loras 4).

    .venv/bin/python benchmarks/multi_lora.py [--batch 16] [--tokens 48] [--repeats 3] [--rank 16] [--arms ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.llama import input_transform
from kvserve.model.lora import TARGET_MODULES, LoraSlots

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' adapter writer
from tests.tiny_models import random_adapter_folder  # noqa: E402

OUT = Path(__file__).parent / "results" / "multi_lora.json"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
NUM_ADAPTERS = 4
ADAPTER_ARMS = ("4_adapters", "4_adapters_per_layer", "4_adapters_torch_threads", "4_adapters_masked")
DEFAULT_ARMS = ADAPTER_ARMS[:2]


class MaskedStep:
    """The update as it was before grouping (the "before" arm): per fused
    linear, x [T, in] @ A [in, S*kR] over every slot, masked to each
    token's own slot's columns, @ B [S*kR, out], added to every row."""

    # id(stack) -> (A, B, column slot), flattened once: the 4 adapters stay
    # resident in the 4 slots for the whole run, so the copies stay true.
    _flat: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __init__(self, slots: LoraSlots, slot_of_token) -> None:
        self.slots = slots
        self.slot_of_token = torch.from_numpy(np.asarray(slot_of_token, dtype=np.int64))
        self.active = {int(s) for s in self.slot_of_token.unique().tolist() if s >= 0}
        self._masks: dict[int, torch.Tensor] = {}  # per stacked width, as before: built once a step

    def _stack(self, stack):
        flat = self._flat.get(id(stack))
        if flat is None:  # slot-major columns: column c belongs to slot c // (k*R)
            num_slots, in_features, width = stack.a.shape
            a = stack.a.permute(1, 0, 2).reshape(in_features, num_slots * width).contiguous()
            b = stack.b.reshape(num_slots * width, -1)
            flat = self._flat[id(stack)] = (a, b, torch.arange(num_slots * width) // width)
        return flat

    def add(self, out, layer, group, x, norm=None, swiglu=False) -> None:
        stack = self.slots.layers[layer][group]
        if self.active.isdisjoint(stack.used_slots):
            return
        a, b, column_slot = self._stack(stack)
        mask = self._masks.get(len(column_slot))
        if mask is None:
            mask = self._masks[len(column_slot)] = (column_slot[None, :] == self.slot_of_token[:, None]).to(a.dtype)
        shrunk = torch.mm(input_transform(x, norm, swiglu).to(a.dtype), a).mul_(mask)
        out += torch.mm(shrunk, b).to(out.dtype)

    @staticmethod
    def native_step() -> None:
        return None  # layer by layer: this update exists only in torch


def use_update(slots: LoraSlots, arm: str) -> None:
    """Point the runner's slots at the arm's update."""
    slots.one_thread_update = arm in ("4_adapters", "4_adapters_per_layer")
    slots.native_capable = arm == "4_adapters"  # otherwise LoraStep.native_step is None: layer by layer
    if arm == "4_adapters_masked":
        slots.step = lambda slot_of_token: MaskedStep(slots, slot_of_token)  # type: ignore[method-assign]
    else:
        slots.__dict__.pop("step", None)  # the class's own LoraSlots.step


def run_arm(llm: LLM, batch: int, params: SamplingParams, loras: list[str | None]) -> dict:
    start = time.perf_counter()
    outputs = llm.chat([PROMPT] * batch, params, lora=loras)
    wall_s = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return {"token_ids": [list(o.token_ids) for o in outputs], "tokens_per_s": num_tokens / wall_s, "tpot_s": statistics.median(o.latency.tpot_s for o in outputs),
            "tokens": num_tokens, "wall_s": wall_s}


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """This benchmark's options (benchmarks/contract.py takes them with prefix "lora-")."""
    parser.add_argument(f"--{prefix}batch", type=int, default=16, help="requests per batch (sequences)")
    parser.add_argument(f"--{prefix}tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument(f"--{prefix}repeats", type=int, default=3, help="interleaved runs per arm")
    parser.add_argument(f"--{prefix}rank", type=int, default=16, help="adapter rank (also --max-lora-rank)")
    parser.add_argument(f"--{prefix}arms", nargs="+", default=list(DEFAULT_ARMS), choices=ADAPTER_ARMS,
                        help="adapter arms beside the base")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.batch, args.tokens, args.repeats, args.rank, args.arms)
    print_table(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def measure(batch: int, tokens: int, repeats: int, rank: int, adapter_arms: list[str]) -> dict:
    """Run the arms interleaved; the result as a JSON-ready dict (print_table shows it)."""
    args = argparse.Namespace(batch=batch, tokens=tokens, repeats=repeats, rank=rank, arms=adapter_arms)
    llm = LLM(kv_cache_memory="512MiB", max_model_len=1024, enable_lora=True, max_loras=NUM_ADAPTERS,
              max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(NUM_ADAPTERS):
            random_adapter_folder(Path(tmp) / f"a{n}", llm.engine.model_config, args.rank, seed=n, std=0.01)
            llm.load_lora_adapter(f"a{n}", Path(tmp) / f"a{n}")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    spread = [f"a{n % NUM_ADAPTERS}" for n in range(args.batch)]
    arms = {"base": [None] * args.batch, **{name: spread for name in args.arms}}
    slots = llm.engine.runner.lora_slots
    for name, loras in arms.items():  # warm-up: first-step costs, the adapters into their slots
        use_update(slots, name)
        run_arm(llm, min(args.batch, 4), SamplingParams(max_tokens=4, ignore_eos=True), loras[:4])
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    load_averages = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, loras in arms.items():  # interleaved: load drifts hit every arm alike
            use_update(slots, name)
            runs[name].append(run_arm(llm, args.batch, params, loras))
            load_averages.append(os.getloadavg()[0])
    median = {name: {key: statistics.median(r[key] for r in rs) for key in ("tokens_per_s", "tpot_s")}
              for name, rs in runs.items()}
    # The updates compute the same thing, their float32 sums in other orders:
    # the base matmuls quantize activations to int8 per block, so a rounding
    # difference can move an activation by one quantization step, and greedy
    # tokens may part after some steps (each layer alone agrees to ~1e-5).
    agree = {name: runs[name][0].pop("token_ids") == runs[ADAPTER_ARMS[0]][0]["token_ids"]
             for name in args.arms if name != ADAPTER_ARMS[0]} if ADAPTER_ARMS[0] in arms else {}
    for rs in runs.values():
        for r in rs:
            r.pop("token_ids", None)
    ratios = {name: median[name]["tokens_per_s"] / median["base"]["tokens_per_s"] for name in arms}
    native_gain = (median["4_adapters"]["tokens_per_s"] / median["4_adapters_per_layer"]["tokens_per_s"]
                   if {"4_adapters", "4_adapters_per_layer"} <= set(median) else float("nan"))
    result = {"benchmark": "multi_lora.throughput", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "torch_threads": torch.get_num_threads(), "model": "SmolLM2-135M-Instruct Q4_1 (float32 activations)",
              "batch": args.batch, "tokens_per_request": args.tokens, "adapter_rank": args.rank,
              "adapter_targets": list(TARGET_MODULES), "target": "4-adapter throughput >= 0.8x base",
              "throughput_ratio": round(ratios.get("4_adapters", float("nan")), 4),
              "native_over_per_layer": round(native_gain, 4),
              "ratios_to_base": {n: round(r, 4) for n, r in ratios.items()},
              # each repeat's arm over the same repeat's base (adjacent in time)
              "paired_ratios_to_base": {n: [round(r["tokens_per_s"] / b["tokens_per_s"], 4)
                                            for r, b in zip(runs[n], runs["base"])] for n in arms},
              "same_greedy_tokens_as_4_adapters": agree,
              "load_average_1m": {"min": min(load_averages), "max": max(load_averages),
                                  "median": statistics.median(load_averages)},
              "cpus": os.cpu_count(),
              "median": {n: {k: round(v, 6) for k, v in m.items()} for n, m in median.items()},
              "runs": {n: [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rs]
                       for n, rs in runs.items()}}
    return result


def print_table(result: dict) -> None:
    """measure()'s result as this benchmark's table."""
    print(f"{'arm':>25} {'tokens/s':>9} {'TPOT ms':>9} {'x base':>7}")
    for name, m in result["median"].items():
        print(f"{name:>25} {m['tokens_per_s']:>9.1f} {1e3 * m['tpot_s']:>9.2f} {result['ratios_to_base'][name]:>7.3f}")
    load = result["load_average_1m"]
    print(f"same tokens as 4_adapters: {result['same_greedy_tokens_as_4_adapters']}")
    print(f"throughput 4 adapters / base: {result['throughput_ratio']:.3f}x (target >= 0.8x); "
          f"load average (1 min) {load['min']:.1f}-{load['max']:.1f} on {result['cpus']} CPUs")
    print(f"native step with adapters / per-layer torch update: {result['native_over_per_layer']:.3f}x")


if __name__ == "__main__":
    main()
