"""`kvserve generate "prompt"`: one completion through the offline engine, for a quick look.

Also the engine side of the shared flags (kvserve/flags.py): `engine_config`
turns the model, KV cache, batching and runtime flags into the
`EngineConfig` that `kvserve serve`, `kvserve profile` and this command run.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvserve import flags
from kvserve.contract import SamplingParams

if TYPE_CHECKING:  # torch is imported only when a command runs
    from kvserve.engine.core import EngineConfig


def add_engine_arguments(group: flags.ArgumentTarget) -> None:
    """Every flag `engine_config` reads: model, KV cache, batching, runtime."""
    flags.add_model_arguments(group)
    flags.add_kv_cache_arguments(group)
    flags.add_batching_arguments(group)
    flags.add_runtime_arguments(group)
    flags.add_speculative_arguments(group)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine flags as the keyword arguments `EngineConfig.from_sizes`
    and `LLM` both take."""
    return {"kv_cache_memory": args.kv_cache_memory, "dtype": args.dtype, "device": args.device,
            "block_size": args.block_size, "enable_prefix_caching": not args.no_prefix_caching,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "enforce_eager": args.enforce_eager,
            "quantization": args.quantization, "prefill_weights": args.prefill_weights,
            "batch_invariant": args.batch_invariant,
            "kv_cache_dtype": args.kv_cache_dtype,
            "speculative_config": args.speculative_config}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from kvserve.engine.core import EngineConfig

    return EngineConfig.from_sizes(**engine_options(args))


def set_torch_threads(num_threads: int | None) -> None:
    """--torch-threads: torch's intra-op CPU threads (None leaves torch's choice)."""
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text (with --chat: the user message)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="most output tokens to generate (tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus probability mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed (integer)")
    parser.add_argument("--stats", action="store_true",
                        help="print tokens, finish reason and latency (seconds) to stderr")
    add_engine_arguments(parser.add_argument_group("model and engine"))


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM  # torch is imported only when the command runs

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        set_torch_threads(args.torch_threads)
        llm = LLM(model=args.model, **engine_options(args))
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            output = llm.generate(args.prompt, params)[0]
    except ValueError as e:  # bad flag values, model files or prompts: a message, not a traceback
        print(f"kvserve generate: error: {e}", file=sys.stderr)
        return 2
    print(output.text)
    if args.stats:
        latency = output.latency
        print(f"tokens={len(output.token_ids)} finish_reason={output.finish_reason} "
              f"ttft_s={latency.ttft_s:.3f} tpot_s={latency.tpot_s or 0:.4f} e2e_s={latency.e2e_s:.3f}",
              file=sys.stderr)
    return 0
