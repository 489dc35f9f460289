"""`kvserve generate "prompt"`: one completion through the offline engine, for a quick look."""

from __future__ import annotations

import argparse
import sys

from kvserve.contract import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text (with --chat: the user message)")
    parser.add_argument(
        "--model", default=None,
        help="a *.gguf file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="most output tokens to generate (tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus probability mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed (integer)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weight and activation dtype")
    parser.add_argument("--kv-cache-memory", default="256MiB",
                        help="KV cache size in bytes, with a unit (e.g. 256MiB, 2GiB)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--stats", action="store_true",
                        help="print tokens, finish reason and latency (seconds) to stderr")


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM  # torch is imported only when the command runs

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                  device=args.device)
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
