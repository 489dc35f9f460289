"""Where a prefill step's milliseconds go, part by part, on the default model
(the shipped Q4_1 computed quantized): each native kernel call of the step
(the matmul per linear kind and the LM head, attention, RoPE + K/V write),
the norm / SwiGLU transform and quantization of the activation rows, and the
Python around them (step batch, sampling, the engine's own bookkeeping).

A step normally runs its layers in one native call (`NativeStep`); to see
inside it, the per-part rounds run the same kernels layer by layer (the
per-op path: the same kernels in the same order, so the same bits), each
call timed from Python. Rounds alternate that path with the one-call path,
so the table's sum can be checked against the step as it really runs.
"Rows" is the transform + quantization alone: the same call with an 8-row
weight (one tile group), so its matmul is ~nothing.

    .venv/bin/python benchmarks/prefill_parts.py [--prompt 256] [--rounds 8] [--threads 2 | --threads 1 --cpu-time]

Prints a table (min and median ms per step, GOP/s of the matmuls) and
writes benchmarks/results/prefill_parts.json (--out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvserve.contract import SamplingParams
from kvserve.model import quantized
from kvserve.runner import model_runner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_ab import default_model_core  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
XOP_NAMES = {0: "plain", 1: "rms_norm", 2: "swiglu"}


class PartTimer:
    """Time (s) per named part, for the step in flight: wall time, or the
    calling thread's CPU time (`cpu`: with one thread the kernels' whole cost,
    and on a busy machine not inflated by waiting for a core)."""

    def __init__(self, cpu: bool = False) -> None:
        self.clock = time.thread_time if cpu else time.perf_counter
        self.step: dict[str, float] = collections.defaultdict(float)
        self.ops: dict[str, float] = collections.defaultdict(float)  # matmul multiply-adds x 2

    def wrap(self, owner, name: str, part_of) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = self.clock()
            result = fn(*args, **kwargs)
            part, ops = part_of(args)
            self.step[part] += self.clock() - t0
            self.ops[part] += ops
            return result
        setattr(owner, name, timed)


def linear_shapes(config, lm_head: str = "LM head") -> dict[tuple[int, int], str]:
    """(N, K) of the default model's linears -> the part each is timed as."""
    hidden, inter = config.hidden_size, config.intermediate_size
    nqkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return {(nqkv, hidden): "matmul qkv (+rms_norm)",
            (hidden, config.num_attention_heads * config.head_dim): "matmul o (+residual)",
            (2 * inter, hidden): "matmul gate_up (+rms_norm)", (hidden, inter): "matmul down (+swiglu, residual)",
            (config.vocab_size, hidden): lm_head}


def wrap_step_parts(timer: PartTimer, core, shapes: dict[tuple[int, int], str]) -> None:
    """Time each kernel a step of `core` calls, and its Python around them,
    as parts of the timer's step."""
    lib = quantized.require_kernels()
    timer.wrap(lib, "kvq_matmul", matmul_part(shapes))
    timer.wrap(lib, "kvq_matmul_bf16", matmul_part(shapes, prompt_tiles=True))
    timer.wrap(lib, "kvq_prompt_mlp", lambda a: ("prompt MLP (tiles)", 0.0))
    timer.wrap(lib, "kvq_decode_attention", lambda a: ("attention", 0.0))
    timer.wrap(lib, "kvq_rope_write_kv", lambda a: ("rope + K/V write", 0.0))
    timer.wrap(lib, "kvq_dequantize_rows", lambda a: ("embedding rows", 0.0))
    timer.wrap(lib, "kvq_decode_layers", lambda a: ("layers (one native call)", 0.0))
    timer.wrap(model_runner, "build_step_batch", lambda a: ("step batch (Python)", 0.0))
    timer.wrap(core.runner.sampler, "sample", lambda a: ("sampling", 0.0))


def matmul_part(shapes: dict[tuple[int, int], str], prompt_tiles: bool = False):
    """kvq_matmul's arguments (N, K, xop, M at 2, 3, 7, 10) or, prompt_tiles,
    kvq_matmul_bf16's (one fewer before each: no weight type)."""
    first = 1 if prompt_tiles else 2

    def part_of(args):
        n, k, xop, m = args[first], args[first + 1], args[first + 5], args[first + 8]
        name = shapes.get((n, k), f"matmul {n}x{k} ({XOP_NAMES[xop]})")
        return (f"{name}, prompt tiles" if prompt_tiles else name), 2.0 * m * n * k
    return part_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (one prefill step)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each part by the calling thread's CPU time (use with --threads 1)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_parts.json"))
    args = parser.parse_args()
    core = default_model_core(args.threads)
    model = core.runner.model
    config = model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    one_call = model.native_decode
    timer = PartTimer(args.cpu_time)
    clock = timer.clock
    wrap_step_parts(timer, core, linear_shapes(config, "LM head (1 row)"))
    timer.wrap(model, "compute_logits", lambda a: ("final norm + LM head", 0.0))
    rows_weights = {xop: quantized.QuantizedWeight.from_float("q4_1", torch.randn(8, k))
                    for xop, k in ((1, hidden), (2, inter))}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps = {"per_op": [], "one_call": []}
    for serial in range(2 * (args.rounds + 1)):  # the first of each path is a warm-up, dropped
        path = "per_op" if serial % 2 == 0 else "one_call"
        model.native_decode = None if path == "per_op" else one_call
        prompt = [1000 + serial] + [(100 + 37 * serial + 11 * j) % 40_000 + 100 for j in range(args.prompt - 1)]
        request = core.new_request(prompt, params)
        timer.step.clear()
        timer.ops.clear()
        t0 = clock()
        core.add_request(request)
        while request.num_output_tokens == 0:
            core.step()
        step_s = clock() - t0
        parts, ops = dict(timer.step), dict(timer.ops)
        while core.has_unfinished():
            core.step()
        if path == "per_op":  # the transform + quantization of the step's rows alone
            x = torch.randn(args.prompt, 2 * inter)
            norm_w = torch.ones(hidden)
            t1 = clock()
            for _ in range(2 * config.num_hidden_layers):
                rows_weights[1].matmul(x[:, :hidden], norm=(norm_w, 1e-5))
            parts["rows: rms_norm + quantize (2 per layer)"] = clock() - t1
            t1 = clock()
            for _ in range(config.num_hidden_layers):
                rows_weights[2].matmul(x, swiglu=True)
            parts["rows: swiglu + quantize"] = clock() - t1
            t1 = clock()
            for _ in range(config.num_hidden_layers):
                rows_weights[1].matmul(x[:, :hidden].contiguous())
            parts["rows: quantize only (o's input)"] = clock() - t1
        steps[path].append({"step_s": step_s, "parts": parts, "ops": ops})
    kept = {path: runs[1:] for path, runs in steps.items()}
    names = sorted({name for runs in kept.values() for run in runs for name in run["parts"]},
                   key=lambda n: -statistics.median(r["parts"].get(n, 0.0) for r in kept["per_op"] + kept["one_call"]))
    table = []
    print("| part | per-op min ms | per-op p50 ms | one-call p50 ms | GOP/s (per-op p50) |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        per_op = [r["parts"].get(name, 0.0) * 1e3 for r in kept["per_op"]]
        one = [r["parts"].get(name, 0.0) * 1e3 for r in kept["one_call"]]
        ops = statistics.median(r["ops"].get(name, 0.0) for r in kept["per_op"])
        gops = ops / (statistics.median(per_op) * 1e-3) / 1e9 if ops and statistics.median(per_op) else None
        table.append({"part": name, "per_op_min_ms": min(per_op), "per_op_p50_ms": statistics.median(per_op),
                      "one_call_p50_ms": statistics.median(one), "gops": gops})
        print(f"| {name} | {min(per_op):.2f} | {statistics.median(per_op):.2f} | {statistics.median(one):.2f} | "
              f"{'' if gops is None else f'{gops:.0f}'} |")
    totals = {path: [r["step_s"] * 1e3 for r in runs] for path, runs in kept.items()}
    for path, values in totals.items():
        print(f"| TTFT, {path} (add + steps to the first token) | {min(values):.2f} | {statistics.median(values):.2f} | | |")
    load_avg = os.getloadavg()
    print(f"\n{args.prompt}-token prompt, {args.threads} threads, {'thread CPU' if args.cpu_time else 'wall'} time, "
          f"isa {quantized.set_isa('best')}; "
          f"load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "prompt_tokens": args.prompt,
                                          "threads": args.threads, "cpu_time": args.cpu_time, "load_average": load_avg, "parts": table,
                                          "ttft_ms": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
