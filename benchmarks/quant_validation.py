"""Quantization validation report for the default model (SmolLM2-135M-Instruct):
float32 (the reference, `--quantization none`), bfloat16 (`--dtype bfloat16
--quantization none`), Q8_0 requantized from the shipped weights with the gguf
package (`--quantization q8_0`) and the shipped Q4_1 file as it is
(`--quantization auto`), through the same offline engine.

Rows: greedy agreement with the reference over a fixed prompt set (first
divergence), next-token KL divergence and top-1 agreement, perplexity and
logprob drift on a held text shipped in the repo (benchmarks/data/held_text.txt,
CC0), seeded sampling, stop strings, latency and throughput at batch 1/8/32
and prompt 128/1,024 tokens, resident memory and KV capacity, and the exact
artifact (sha256, quant type per tensor).

    .venv/bin/python benchmarks/quant_validation.py [--quick] [--out benchmarks/results/quant_validation.json]

Prints the markdown report (docs/quantization.md is this output plus the
kernel comparison) and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.contract import Request
from kvserve.model_facts.default_model import default_model_path, file_sha256
from kvserve.scheduler.scheduler import ScheduledChunk

ROOT = Path(__file__).resolve().parents[1]
HELD_TEXT = ROOT / "benchmarks" / "data" / "held_text.txt"
VARIANTS = {  # name -> LLM(...) arguments
    "float32 (reference)": {"quantization": "none"},
    "bfloat16": {"quantization": "none", "dtype": "bfloat16"},
    "Q8_0 (requantized)": {"quantization": "q8_0"},
    "Q4_1 (shipped)": {"quantization": "auto"},
    "Q4_1, int8 KV cache": {"quantization": "auto", "kv_cache_dtype": "int8"},
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "Water boils at", "The quick brown fox", "In machine learning, a transformer is",
           "Hello", "The three primary colors are", "To make a cup of tea,",
           "The largest planet in the solar system is", "import numpy as np\n",
           "Q: What is 12 times 12?\nA:", "Roses are red,", "The year 1969 is known for", "My favourite book is"]
GREEDY_TOKENS = 32
WINDOW_TOKENS = 512  # held text scored in windows of this many tokens (each from an empty cache)


def token_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's next-token logits at every position of `tokens`
    ([len - 1, vocab] float32, for predicting tokens[1:]), window by window."""
    runner = llm.engine.runner
    rows = []
    for start in range(0, len(tokens) - 1, WINDOW_TOKENS):
        window = tokens[start:start + WINDOW_TOKENS + 1]
        request = Request("score", window, SamplingParams(max_tokens=1), 0.0)
        num_blocks = -(-len(window) // runner.block_size)
        chunk = ScheduledChunk(request, 0, len(window), list(range(num_blocks)), samples=True)
        # As the runner builds a step: every row here is a prompt position, so a
        # model with prompt tiles scores the text on them, as it serves prompts.
        batch = runner.step_batch([chunk])
        with torch.inference_mode():
            hidden = runner.model.forward(batch.token_ids, runner.kv_caches, batch.meta)
            logits = runner.model.compute_logits(hidden[:-1])
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def seeded(llm: LLM) -> dict:
    """Same seed alone and inside a batch of other prompts: identical tokens?"""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params)[0].token_ids
    crowded = llm.generate(PROMPTS[:8], params)[2].token_ids
    again = llm.generate([PROMPTS[2]], params)[0].token_ids
    return {"reproducible_alone": alone == again, "reproducible_in_batch_of_8": alone == crowded,
            "tokens": alone}


def stops(llm: LLM) -> dict:
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=["\n", "."])
    outputs = llm.generate(PROMPTS, params)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    return {"stopped": len(stopped), "of": len(outputs),
            "stop_string_in_text": sum(("\n" in o.text or "." in o.text) for o in stopped),
            "texts": [o.text for o in outputs]}


def latency(llm: LLM, batch: int, prompt_tokens: int, output_tokens: int) -> dict:
    """One offline generate of `batch` prompts of `prompt_tokens` random tokens:
    median TTFT and TPOT over the requests, and output tokens/s of the whole run."""
    gen = torch.Generator().manual_seed(batch * 10_000 + prompt_tokens)
    prompts = [torch.randint(100, 40_000, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - t0
    ttft = sorted(o.latency.ttft_s for o in outputs)
    tpot = sorted(o.latency.tpot_s for o in outputs if o.latency.tpot_s is not None)
    return {"batch": batch, "prompt_tokens": prompt_tokens, "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
            "tpot_p50_ms": tpot[len(tpot) // 2] * 1e3 if tpot else None,
            "output_tok_per_s": batch * output_tokens / wall_s, "wall_s": wall_s}


def memory(llm: LLM) -> dict:
    runner = llm.engine.runner
    tokens_per_seq = 2048
    blocks_per_seq = -(-tokens_per_seq // runner.block_size)
    from kvserve.runner.model_runner import auto_kv_cache_bytes

    per_block = runner.kv_cache_memory_bytes // max(runner.num_blocks, 1)
    auto_blocks = auto_kv_cache_bytes(runner.weight_bytes) // per_block
    return {"weight_bytes": runner.weight_bytes, "weight_formats": runner.model.weight_formats(),
            "kv_blocks_at_1GiB": runner.num_blocks, "kv_blocks_auto": auto_blocks,
            "sequences_of_2048_tokens_auto": auto_blocks // blocks_per_seq}


def artifact() -> dict:
    from kvserve.model.gguf_file import GGUFModel

    path = default_model_path()
    types = GGUFModel(path).tensor_types()
    by_role = collections.Counter((name.split(".")[2] if name.startswith("blk.") else name, t)
                                  for name, t in types.items())
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "tensor_types": {f"{role} ({t})": n for (role, t), n in sorted(by_role.items())}}


def run(quick: bool) -> dict:
    tokens_text = HELD_TEXT.read_text()
    report: dict = {"artifact": artifact(), "variants": {}}
    reference_greedy, reference_logprobs = None, None
    shapes = [(1, 128), (8, 128), (1, 1024)] if quick else [(b, p) for p in (128, 1024) for b in (1, 8, 32)]
    for name, kwargs in VARIANTS.items():
        print(f"-- {name}", file=sys.stderr, flush=True)
        llm = LLM(device="cpu", kv_cache_memory="1GiB", **kwargs)
        tokens = llm.tokenizer.encode(tokens_text)
        logprobs = token_logprobs(llm, tokens)
        targets = torch.tensor(tokens[1:])
        nll = -logprobs.gather(1, targets[:, None]).squeeze(1)
        row: dict = {"held_text_tokens": len(tokens), "perplexity": math.exp(float(nll.mean()))}
        outputs = greedy(llm)
        if reference_logprobs is None:
            reference_greedy, reference_logprobs, reference_nll = outputs, logprobs, nll
        divergence = [first_divergence(a, b) for a, b in zip(reference_greedy, outputs)]
        row["greedy_first_divergence"] = divergence
        row["greedy_mean_agreement"] = sum(divergence) / len(divergence) / GREEDY_TOKENS
        row["greedy_identical_prompts"] = sum(d == GREEDY_TOKENS for d in divergence)
        p_ref = reference_logprobs.exp()
        kl = (p_ref * (reference_logprobs - logprobs)).sum(-1)
        row["next_token_kl_mean"] = float(kl.mean())
        row["next_token_kl_p99"] = float(kl.quantile(0.99))
        row["top1_agreement"] = float((logprobs.argmax(-1) == reference_logprobs.argmax(-1)).float().mean())
        row["logprob_drift_mean_abs"] = float((nll - reference_nll).abs().mean())
        row["seeded_sampling"] = seeded(llm)
        row["stop_strings"] = stops(llm)
        # --quick: no latency rows for bfloat16, which this CPU (no AVX-512 BF16) emulates ~7x slower
        skip = quick and kwargs.get("dtype") == "bfloat16"
        row["latency"] = [None if skip else latency(llm, b, p, 16) for b, p in shapes]
        row["memory"] = memory(llm)
        report["variants"][name] = row
        del llm
    reference_texts = report["variants"]["float32 (reference)"]["stop_strings"]["texts"]
    for row in report["variants"].values():
        texts = row["stop_strings"]["texts"]
        row["stop_strings"]["same_text_as_reference"] = sum(a == b for a, b in zip(texts, reference_texts))
    return report


def render(report: dict) -> str:
    a = report["artifact"]
    names = list(report["variants"])
    rows = report["variants"]
    lines = ["## The artifact", "", f"`{a['file']}`, {a['bytes']:,} bytes, sha256 `{a['sha256']}`.", "",
             "| tensor (role) | type | count |", "|---|---|---|"]
    for key, count in a["tensor_types"].items():
        role, _, t = key.rpartition(" (")
        lines.append(f"| {role} | {t.rstrip(')')} | {count} |")
    lines += ["", "## Accuracy against the float32 reference", "",
              "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def add(label: str, fmt) -> None:
        lines.append(f"| {label} | " + " | ".join(fmt(rows[n]) for n in names) + " |")

    add(f"greedy: mean share of {GREEDY_TOKENS} tokens before the first divergence ({len(PROMPTS)} prompts)",
        lambda r: f"{r['greedy_mean_agreement']:.2f}")
    add("greedy: prompts identical for all tokens", lambda r: f"{r['greedy_identical_prompts']} / {len(PROMPTS)}")
    add("greedy: first divergence per prompt", lambda r: " ".join(map(str, r["greedy_first_divergence"])))
    add("next-token KL(ref || variant), mean (nats)", lambda r: f"{r['next_token_kl_mean']:.4f}")
    add("next-token KL, p99 (nats)", lambda r: f"{r['next_token_kl_p99']:.4f}")
    add("next-token top-1 agreement", lambda r: f"{r['top1_agreement']:.3f}")
    add("held-text perplexity", lambda r: f"{r['perplexity']:.2f}")
    add("logprob drift: mean abs difference of the text's token logprobs", lambda r: f"{r['logprob_drift_mean_abs']:.4f}")
    add("seeded sampling reproducible (alone / in a batch of 8)", lambda r: "{} / {}".format(
        *("yes" if r["seeded_sampling"][k] else "no" for k in ("reproducible_alone", "reproducible_in_batch_of_8"))))
    add("stop strings: requests stopped / stop string left in text",
        lambda r: f"{r['stop_strings']['stopped']} / {r['stop_strings']['stop_string_in_text']}")
    add("stop strings: same text as the reference", lambda r: f"{r['stop_strings']['same_text_as_reference']} / "
        f"{r['stop_strings']['of']}")
    lines.append("| structured outputs | not compared (the script has no structured-output row yet) |"
                 + " |" * (len(names) - 1))
    lines += ["", "## Latency and throughput (offline engine, 16 output tokens, this machine)", "",
              "| batch x prompt | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i, shape in enumerate(rows[names[0]]["latency"]):
        cells = []
        for n in names:
            lat = rows[n]["latency"][i]
            if lat is None:
                cells.append("not run (--quick)")
                continue
            cells.append(f"TTFT {lat['ttft_p50_ms']:.0f} ms, TPOT {lat['tpot_p50_ms']:.1f} ms, "
                         f"{lat['output_tok_per_s']:.0f} tok/s")
        lines.append(f"| {shape['batch']} x {shape['prompt_tokens']} | " + " | ".join(cells) + " |")
    lines += ["", "## Memory and KV capacity", "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    add("resident weights (MiB)", lambda r: f"{r['memory']['weight_bytes'] / 2**20:.1f}")
    add("KV blocks (16 tokens) at --kv-cache-memory 1GiB", lambda r: f"{r['memory']['kv_blocks_at_1GiB']:,}")
    add("KV blocks at --kv-cache-memory auto (1.5 GiB less the weights)", lambda r: f"{r['memory']['kv_blocks_auto']:,}")
    add("2,048-token sequences that fit (auto)", lambda r: f"{r['memory']['sequences_of_2048_tokens_auto']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="latency at 1x128, 8x128 and 1x1,024 only, and none for bfloat16 (emulated ~7x "
                             "slower without AVX-512 BF16)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_validation.json"))
    args = parser.parse_args()
    report = run(args.quick)
    report["date"] = time.strftime("%Y-%m-%d %H:%M")
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
