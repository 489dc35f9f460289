"""Write a random-weight Hugging Face folder with a named architecture's shape
(default: the embedded SmolLM2-135M), for speed measurements where the real
weights cannot go (the default model's GGUF is 94 MB; a GPU machine here
takes at most 64 MiB of files). Throughput depends on the shapes alone: same
layers, heads, vocabulary and context, the same FLOPs and bytes per token.

    python benchmarks/shape_twin.py /tmp/smollm2-twin            # ~540 MB float32
    python benchmarks/decode_throughput.py --model /tmp/smollm2-twin --device cuda

The tokenizer is word-level over "t0".."t{vocab-1}" (one token per word), so
random token ids detokenize as they would with any tokenizer of that size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvserve.model_facts.config import ModelConfig
from kvserve.plan.presets import PRESETS


def hf_config(config: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM" if config.architecture == "llama" else "Qwen2ForCausalLM"],
        "model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None,
    }


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face names and shapes; N(0, 0.02) matrices, unit norms."""
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.02

    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    weights = {"model.embed_tokens.weight": matrix(config.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        weights.update({
            prefix + "input_layernorm.weight": torch.ones(h),
            prefix + "post_attention_layernorm.weight": torch.ones(h),
            prefix + "self_attn.q_proj.weight": matrix(q_out, h),
            prefix + "self_attn.k_proj.weight": matrix(kv_out, h),
            prefix + "self_attn.v_proj.weight": matrix(kv_out, h),
            prefix + "self_attn.o_proj.weight": matrix(h, q_out),
            prefix + "mlp.gate_proj.weight": matrix(config.intermediate_size, h),
            prefix + "mlp.up_proj.weight": matrix(config.intermediate_size, h),
            prefix + "mlp.down_proj.weight": matrix(h, config.intermediate_size),
        })
        if config.attention_bias:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                weights[prefix + f"self_attn.{name}_proj.bias"] = torch.zeros(size)
    return weights


def word_tokenizer(vocab_size: int) -> Tokenizer:
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


def write_twin(out: Path, preset: str, seed: int) -> None:
    config = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": config.max_position_embeddings}))
    word_tokenizer(config.vocab_size).save(str(out / "tokenizer.json"))
    save_file(random_weights(config, seed), str(out / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write")
    parser.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="architecture")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args()
    write_twin(args.out, args.preset, args.seed)
    print(f"wrote {args.out} ({args.preset}, random weights, seed {args.seed})")


if __name__ == "__main__":
    main()
