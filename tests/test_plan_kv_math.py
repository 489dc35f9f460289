"""KV capacity arithmetic against hand-checked values."""

import pytest

from kvserve.model_facts import memory
from kvserve.model_facts.config import ModelConfig
from kvserve.plan import kv_math
from kvserve.plan.presets import preset, resolve_model

GIB = 2**30

# 32 layers, 8 KV heads, head dim 128 (Llama-3.1-8B's shapes).
LLAMA_8B_SHAPES = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                              intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def test_kv_bytes_per_token_hand_checked():
    # 2 (K and V) x 32 x 8 x 128 x 2 bytes = 131,072 bytes = 128 KiB per token.
    assert LLAMA_8B_SHAPES.kv_bytes_per_token(2) == 131072
    assert LLAMA_8B_SHAPES.kv_bytes_per_token(1) == 65536


def test_8192_token_sequence_is_one_gib_and_twenty_are_twenty_gib():
    per_token = LLAMA_8B_SHAPES.kv_bytes_per_token(2)
    rows = kv_math.concurrency_table(capacity_tokens=20 * 8192, bytes_per_token=per_token,
                                     contexts=[kv_math.ContextLength(8192)])
    assert rows[0].kv_bytes_per_sequence == 1 * GIB
    assert rows[0].max_concurrency == 20
    # 20 GiB of KV holds exactly 20 such sequences; one byte less holds 19.
    assert kv_math.kv_capacity_tokens(20 * GIB, per_token) == 20 * 8192
    assert kv_math.max_concurrency(kv_math.kv_capacity_tokens(20 * GIB, per_token), 8192) == 20
    assert kv_math.max_concurrency(kv_math.kv_capacity_tokens(20 * GIB - 1, per_token), 8192) == 19


def test_partial_blocks_round_up_per_sequence():
    # 17 tokens occupy two 16-token blocks, so 64 blocks hold 32 such sequences, not 60.
    assert kv_math.max_concurrency(64 * 16, 17, block_size=16) == 32
    assert kv_math.max_concurrency(64 * 16, 16, block_size=16) == 64


def test_memory_budget_subtracts_weights_and_reserve():
    budget = kv_math.memory_budget(80 * GIB, weight_bytes=16 * GIB, reserve_fraction=0.1)
    assert budget.reserve_bytes == 8 * GIB
    assert budget.kv_bytes == 56 * GIB
    too_small = kv_math.memory_budget(16 * GIB, weight_bytes=16 * GIB)
    assert too_small.kv_bytes == 0 and not too_small.fits


def test_preset_parameters_and_weights_match_published_sizes():
    # Published sizes: Llama-3.1-8B 8.03B parameters, 70B 70.6B, Qwen2.5-7B 7.61B, SmolLM2 134.5M.
    assert preset("llama-3.1-8b").config.num_parameters() == pytest.approx(8.03e9, rel=0.005)
    assert preset("llama-3.1-70b").config.num_parameters() == pytest.approx(70.6e9, rel=0.005)
    assert preset("qwen2.5-7b").config.num_parameters() == pytest.approx(7.61e9, rel=0.005)
    assert preset("smollm2-135m").config.num_parameters() == pytest.approx(134.5e6, rel=0.005)
    assert memory.weight_bytes(preset("llama-3.1-8b").config, 2) == 2 * 8030261248


def test_context_shift_shrinks_concurrency_and_grows_demand():
    per_token = LLAMA_8B_SHAPES.kv_bytes_per_token(2)
    shift = kv_math.context_shift(capacity_tokens=480_000, bytes_per_token=per_token,
                                  before=kv_math.ContextLength(800, 200),
                                  after=kv_math.ContextLength(6000, 200),
                                  rate_per_s=10, service_s_before=2.0, service_s_after=4.0)
    # 1000 tokens = 63 blocks, 6200 tokens = 388 blocks; 30,000 blocks in all.
    assert shift.before.max_concurrency == 30000 // 63
    assert shift.after.max_concurrency == 30000 // 388
    # Little's law: 10/s x 2 s x (800 + 100) held tokens; after: 10 x 4 x 6100.
    assert shift.kv_demand_tokens_before == pytest.approx(18_000)
    assert shift.kv_demand_tokens_after == pytest.approx(244_000)


def test_parse_context_lengths_and_errors():
    rows = kv_math.parse_context_lengths("1024, 800:200")
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(1024, 0), (800, 200)]
    for bad in ("", "a", "1:2:3", "0", "5:-1"):
        with pytest.raises(ValueError):
            kv_math.parse_context_lengths(bad)


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="known presets"):
        preset("gpt-5")
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.dtype_bytes("fp3")
    with pytest.raises(ValueError, match="exactly one"):
        resolve_model(None, None)
