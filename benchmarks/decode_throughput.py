"""Decode throughput of kvserve's engine beside Hugging Face transformers, on
the default model (SmolLM2-135M-Instruct), same weights and dtype.

Reports:
- decode tokens/s at batch 1, 8, 32, 64 (fixed-length prompts, fixed output
  length, EOS ignored), counting only steps where every sequence decodes:
  the mean over those steps and the rate at the median step (the machine is
  shared: a neighbour's burst inflates the mean, rarely the median);
- the decode roofline: weight bytes / measured memory bandwidth (a numpy copy
  of a large array; on a GPU, a device-to-device copy) is the least time one
  batch-1 token can take; beside it the read bandwidth the engine's own torch
  threads reach (a sum over a large tensor), since one core cannot draw the
  socket's copy bandwidth;
- a batch of 8 prompts of mixed lengths end to end (prefill + decode), where
  transformers pads and kvserve batches continuously.

    python benchmarks/decode_throughput.py            # 128-token prompts, 128 new tokens
    python benchmarks/decode_throughput.py --quick    # 32-token prompts, 16 new tokens
    python benchmarks/decode_throughput.py --model DIR --device cuda   # e.g. a shape_twin.py folder

Both engines run on --device (transformers' model and inputs are moved there);
on CUDA kvserve replays decode steps as CUDA graphs unless --enforce-eager.

Writes benchmarks/results/decode_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.contract import SamplingParams
from kvserve.engine.core import EngineConfig, EngineCore
from kvserve.model.device import resolve_dtype
from kvserve.model.loader import load_model
from kvserve.model_facts.default_model import default_model_path

RESULTS = Path(__file__).parent / "results" / "decode_throughput.json"
MIXED_PROMPT_LENGTHS = (16, 32, 48, 64, 80, 96, 112, 128)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth_bytes_per_s(device: torch.device, num_bytes: int = 512 * 2**20,
                                  repeats: int = 5) -> float:
    """Best-of-N copy bandwidth: a copy reads and writes every byte once
    (numpy on a CPU, a device-to-device copy elsewhere)."""
    if device.type == "cpu":
        src = np.ones(num_bytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        return 2 * num_bytes / _best_time_s(lambda: np.copyto(dst, src), device, repeats)
    src_t = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst_t = torch.empty_like(src_t)
    return 2 * num_bytes / _best_time_s(lambda: dst_t.copy_(src_t), device, repeats)


def measure_read_bandwidth_bytes_per_s(device: torch.device, num_bytes: int = 512 * 2**20,
                                       repeats: int = 5) -> float:
    """Best-of-N read bandwidth with torch's current thread count: what a
    weight-streaming matmul can draw at most."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / _best_time_s(data.sum, device, repeats)


def _best_time_s(work, device: torch.device, repeats: int) -> float:
    work()  # first touch / lazy initialisation
    best_s = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
    return best_s


def random_prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Avoid the first ids: special tokens (BOS/EOS/pad) live there.
    return torch.randint(100, vocab_size, (batch, length), generator=generator).tolist()


def kvserve_decode(engine: EngineCore, prompts: list[list[int]], new_tokens: int) -> dict:
    """Run to completion; decode tok/s over the steps where every sequence decodes."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(engine.new_request(prompt, params))
    scheduler = engine.scheduler
    step_s, step_tokens, start = [], [], time.perf_counter()
    while engine.has_unfinished():
        pure_decode = scheduler.stats().num_waiting == 0 and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running.values())
        step_start = time.perf_counter()
        outputs = engine.step().outputs
        if pure_decode:
            step_s.append(time.perf_counter() - step_start)
            step_tokens.append(len(outputs))
    median_s = float(np.median(step_s))
    # The slowest step shows one-off costs (a CUDA graph capture, a kernel's
    # first compile) that the mean spreads over the run and the median hides.
    return {"decode_tok_s": sum(step_tokens) / sum(step_s), "decode_tokens": sum(step_tokens),
            "median_step_s": median_s, "median_step_tok_s": len(prompts) / median_s,
            "max_step_s": max(step_s),
            "wall_s": time.perf_counter() - start}


def kvserve_mixed(engine: EngineCore, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s end to end for a batch of mixed-length prompts."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(engine.new_request(prompt, params))
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += len(engine.step().outputs)
    return num_tokens / (time.perf_counter() - start)


def hf_generate_s(hf, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int) -> float:
    input_ids, attention_mask = input_ids.to(hf.device), attention_mask.to(hf.device)
    synchronize(hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    synchronize(hf.device)
    return time.perf_counter() - start


def hf_decode(hf, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode tok/s: (tokens after the first) / (full generate - a 1-token generate)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    prefill_s = hf_generate_s(hf, ids, mask, 1)
    total_s = hf_generate_s(hf, ids, mask, new_tokens)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"decode_tok_s": len(prompts) * (new_tokens - 1) / decode_s, "wall_s": total_s}


def hf_mixed(hf, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s end to end; prompts left-padded into one batch as usual with generate()."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return len(prompts) * new_tokens / hf_generate_s(hf, ids, mask, new_tokens)


def build_engine(args: argparse.Namespace, loaded) -> EngineCore:
    config = EngineConfig.from_sizes(args.kv_cache_memory, dtype=args.dtype, device=args.device,
                                     max_num_seqs=max(args.batches), max_num_batched_tokens=512,
                                     enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    return EngineCore(loaded.config, loaded.weights, loaded.tokenizer, config, versions=loaded.versions)


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    """The same weights in transformers: a GGUF file or a Hugging Face folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    model_path = Path(args.model) if args.model else default_model_path()
    loaded = load_model(model_path)
    engine = build_engine(args, loaded)
    device = engine.runner.device
    weight_bytes = engine.runner.model.weight_bytes()
    bandwidth = measure_bandwidth_bytes_per_s(device)
    read_bandwidth = measure_read_bandwidth_bytes_per_s(device)
    roofline_tok_s = bandwidth / weight_bytes
    hf = None if args.skip_hf else load_hf(model_path, dtype, device)
    vocab = loaded.config.vocab_size
    kvserve_decode(engine, random_prompts(1, 16, vocab, seed=99), 4)  # warm up
    rows = []
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_tokens, vocab, seed=batch)
        ours = kvserve_decode(engine, prompts, args.new_tokens)
        theirs = hf_decode(hf, prompts, args.new_tokens) if hf is not None else None
        rows.append({"batch": batch, "kvserve_tok_s": ours["decode_tok_s"],
                     "kvserve_median_step_tok_s": ours["median_step_tok_s"],
                     "kvserve_median_step_ms": 1000 * ours["median_step_s"],
                     "kvserve_max_step_ms": 1000 * ours["max_step_s"],
                     "hf_tok_s": theirs["decode_tok_s"] if theirs else None})
        print(f"batch {batch}: kvserve {ours['decode_tok_s']:.1f} tok/s "
              f"(median step {ours['median_step_tok_s']:.1f} tok/s, slowest step "
              f"{1000 * ours['max_step_s']:.1f} ms)"
              + (f", transformers {theirs['decode_tok_s']:.1f} tok/s" if theirs else ""), flush=True)
    mixed_prompts = [random_prompts(1, n, vocab, seed=n)[0] for n in MIXED_PROMPT_LENGTHS]
    mixed = {"prompt_tokens": list(MIXED_PROMPT_LENGTHS), "new_tokens": args.mixed_new_tokens,
             "kvserve_tok_s": kvserve_mixed(engine, mixed_prompts, args.mixed_new_tokens),
             "hf_tok_s": hf_mixed(hf, mixed_prompts, args.mixed_new_tokens) if hf is not None else None}
    return {
        "model": model_path.name, "dtype": args.dtype, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth,
        "torch_read_bandwidth_bytes_per_s": read_bandwidth,
        "roofline_batch1_tok_s": roofline_tok_s, "decode": rows, "mixed_batch_of_8": mixed,
    }


def print_table(result: dict) -> None:
    roofline = result["roofline_batch1_tok_s"]
    print(f"\n{result['model']} on {result['device']} ({result['device_name']}), "
          f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}")
    print(f"weights {result['weight_bytes'] / 2**20:.0f} MiB ({result['dtype']}), copy bandwidth "
          f"{result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> batch-1 roofline {roofline:.1f} tok/s "
          f"({1000 / roofline:.1f} ms/token); torch threads {result['torch_threads']}, their read "
          f"bandwidth {result['torch_read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print("| batch | kvserve decode tok/s (mean) | at the median step | median ms/step | x batch 1 "
          "| transformers tok/s | kvserve / transformers |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = result["decode"][0]["kvserve_tok_s"]
    for row in result["decode"]:
        ours, theirs = row["kvserve_tok_s"], row["hf_tok_s"]
        hf_cells = f"{theirs:.1f} | {ours / theirs:.2f}x" if theirs else "- | -"
        print(f"| {row['batch']} | {ours:.1f} | {row['kvserve_median_step_tok_s']:.1f} | "
              f"{row['kvserve_median_step_ms']:.1f} | {ours / base:.1f}x | {hf_cells} |")
    batch1 = result["decode"][0]
    if batch1["batch"] == 1:
        print(f"batch 1 = {100 * batch1['kvserve_tok_s'] / roofline:.0f}% of the decode roofline (mean), "
              f"{100 * batch1['kvserve_median_step_tok_s'] / roofline:.0f}% at the median step")
    mixed = result["mixed_batch_of_8"]
    line = f"mixed batch of 8 (prompts {mixed['prompt_tokens']}, {mixed['new_tokens']} new): " \
           f"kvserve {mixed['kvserve_tok_s']:.1f} tok/s"
    if mixed["hf_tok_s"]:
        speedup = mixed["kvserve_tok_s"] / mixed["hf_tok_s"]
        line += f", transformers {mixed['hf_tok_s']:.1f} tok/s ({speedup:.1f}x)"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32-token prompts and 16 new tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="batch sizes (sequences decoding together)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (tokens)")
    parser.add_argument("--new-tokens", type=int, default=128, help="output length (tokens)")
    parser.add_argument("--mixed-new-tokens", type=int, default=64,
                        help="output length of the mixed-length batch (tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weight dtype")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--model", default=None,
                        help="a *.gguf file or Hugging Face folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--enforce-eager", action="store_true", help="kvserve without CUDA graphs")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size (bytes, with unit)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--skip-hf", action="store_true", help="measure kvserve only")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results path")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.mixed_new_tokens = 32, 16, 16
    result = run(args)
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
