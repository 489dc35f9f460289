"""Tiny random-weight Hugging Face models for reference tests, and the mapping
from their transformers config to kvserve's ModelConfig.

Weights are initialised with a large std so logits are well separated and
greedy argmax comparisons do not flip on float rounding near-ties.
"""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvserve.model_facts.config import ModelConfig

TINY_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 initializer_range=0.15)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def tiny_llama(seed: int = 0, rope_scaling: dict | None = None, tie_word_embeddings: bool = False,
               rope_theta: float = 10000.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_DIMS, rope_scaling=rope_scaling, rope_theta=rope_theta,
                         tie_word_embeddings=tie_word_embeddings, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(**TINY_DIMS, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    # HF initialises biases to zero; make them matter.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


def model_config_of(hf_model) -> ModelConfig:
    c = hf_model.config
    rope = dict(c.rope_parameters)
    rope_type = rope.get("rope_type", "default")
    return ModelConfig(
        architecture=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=rope["rope_theta"],
        rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        eos_token_ids=())


def weights_of(hf_model) -> dict[str, torch.Tensor]:
    return {name: t.detach().float() for name, t in hf_model.state_dict().items()}


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation (EOS disabled: tiny models have none)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding.
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def word_tokenizer(vocab_size: int = TINY_DIMS["vocab_size"]):
    """A whitespace word-level tokenizer over "t0".."t{n-1}": text "t5 t9" <-> [5, 9]."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers

    from kvserve.model_facts.tokenizer import Tokenizer

    backend = BackendTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[], chat_template=None)


# Reference tests run on the CPU; KVSERVE_TEST_DEVICE=cuda runs them on a GPU
# (the Hugging Face reference stays on the CPU).
TEST_DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")


def tiny_engine(hf_model, clock=None, **config_fields):
    """An EngineCore over the HF model's weights. Default: 256 blocks of 4 tokens
    in float32, twice the blocks in the same bytes where the cache is 16-bit
    (a bfloat16 model, or --kv-cache-dtype auto on quantized weights);
    num_blocks=None: the engine's automatic KV size."""
    from kvserve.engine.core import EngineConfig, EngineCore

    model_config = model_config_of(hf_model)
    fields = dict(block_size=4, device=TEST_DEVICE)
    fields.update(config_fields)
    num_blocks = fields.pop("num_blocks", 256)
    bytes_per_block = fields["block_size"] * model_config.kv_bytes_per_token(4)
    config = EngineConfig(kv_cache_memory_bytes=None if num_blocks is None else num_blocks * bytes_per_block,
                          **fields)
    extra = {} if clock is None else {"clock": clock}
    return EngineCore(model_config, weights_of(hf_model), word_tokenizer(model_config.vocab_size), config,
                      **extra)


def run_to_completion(engine, prompts, params) -> dict:
    """Add every prompt, step until all finish; request_id -> final RequestOutput, in order."""
    requests = [engine.new_request(p, params) for p in prompts]
    for request in requests:
        engine.add_request(request)
    final = {}
    for _ in range(10_000):
        for output in engine.step().outputs:
            if output.finished:
                final[output.request_id] = output
        if not engine.has_unfinished():
            break
    return {r.request_id: final[r.request_id] for r in requests}


def random_prompts(lengths, vocab_size: int = TINY_DIMS["vocab_size"], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_peft_adapter(base_model, folder, seed: int, r: int = 8, lora_alpha: float = 16,
                      target_modules=LORA_TARGETS, std: float = 0.1, **lora_options):
    """A PEFT LoRA adapter with random low-rank weights on (a copy of)
    `base_model`, saved to `folder` (adapter_config.json + safetensors);
    returns PEFT's merged model, the reference for kvserve's adapter."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        init_lora_weights=False, **lora_options)
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero or small; make the update matter
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()


def random_adapter_folder(folder, config: ModelConfig, rank: int, seed: int, std: float,
                          zero_b: bool = False) -> None:
    """A PEFT LoRA folder for a kvserve ModelConfig without loading its
    weights (a real model's shapes, e.g. the default model's): random A
    (and B, or zero B: the base model's output exactly) of `std` on every
    projection of every layer, lora_alpha = 2 * rank."""
    import json

    from safetensors.torch import save_file

    from kvserve.model.lora import TARGET_MODULES

    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in TARGET_MODULES:
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            in_features, out_features = dims[target]
            tensors[f"{key}.lora_A.weight"] = torch.randn((rank, in_features), generator=generator) * std
            b = torch.randn((out_features, rank), generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = torch.zeros_like(b) if zero_b else b
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
        "bias": "none", "lora_dropout": 0.0}))
