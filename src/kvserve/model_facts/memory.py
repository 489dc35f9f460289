"""How many bytes a model occupies: bytes per element of a dtype, weight
bytes, KV bytes per block, and the one rule that turns KV cache bytes into
blocks.

`kvserve serve` (the runner's cache tensor) and `kvserve simulate` size the
KV cache through `num_kv_blocks`, `kvserve plan` counts its capacity through
`blocks_in`, so the same memory and dtype give the same number of blocks
everywhere. KV bytes per token are `ModelConfig.kv_bytes_per_token`.
"""

from __future__ import annotations

import math

from kvserve.model_facts.config import ModelConfig

# Bytes per element of a weight or KV dtype name. Quantized weight formats
# count their average bits per weight including block scales (GGUF Q4_1
# stores 20 bytes per 32 weights = 5 bits; Q8_0 34 bytes per 32 = 8.5 bits).
DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0, "fp32": 4.0,
    "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0,
    "fp8": 1.0, "int8": 1.0,
    "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "int4": 0.5,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name`; ValueError listing known names otherwise."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


# An int8 KV cache row (one head's K or V of one token) holds a float32
# scale before its head_dim values (csrc/kvq_kernels.c's KVQ_I8 rows).
KV_ROW_SCALE_BYTES = 4


def kv_element_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes per cached K/V element of `kv_dtype` (a name, or a torch dtype's
    str), an int8 row's scale included: the one rule the runner's cache,
    `kvserve plan` and `kvserve simulate` size an int8 cache by."""
    if kv_dtype.strip().lower().removeprefix("torch.") == "int8":
        return 1.0 + KV_ROW_SCALE_BYTES / head_dim
    return dtype_bytes(kv_dtype)


def weight_bytes(config: ModelConfig, bytes_per_param: float) -> int:
    """Weights resident on the device: parameters x bytes per parameter."""
    return int(math.ceil(config.num_parameters() * bytes_per_param))


def prompt_tile_bytes(config: ModelConfig) -> int:
    """The bfloat16 prompt tiles of a quantized model's layer matrices
    (model/quantized.pack_prompt_tiles: 2 bytes a weight, output rows padded
    to 16), resident beside the quantized blocks where they are built."""
    h, d = config.hidden_size, config.head_dim
    outputs_by_input = ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h), \
        (h, config.num_attention_heads * d), (2 * config.intermediate_size, h), (h, config.intermediate_size)
    per_layer = sum(-(-n // 16) * 16 * k for n, k in outputs_by_input)
    return 2 * per_layer * config.num_hidden_layers


def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype_bytes: float) -> int:
    """K and V of one block of `block_size` token slots in every layer."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 tokens, got {block_size}")
    return block_size * config.kv_bytes_per_token(kv_dtype_bytes)


def blocks_in(kv_cache_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that `kv_cache_bytes` hold, 0 when not one fits (a
    partial block is unusable: the paged cache allocates whole blocks)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes per block must be >= 1, got {bytes_per_block}")
    return max(0, kv_cache_bytes) // bytes_per_block


def num_kv_blocks(kv_cache_bytes: int, config: ModelConfig, block_size: int, kv_dtype_bytes: float,
                  extra_bytes_per_block: int = 0) -> int:
    """Blocks of a KV cache of `kv_cache_bytes` for `config` with elements
    of `kv_dtype_bytes`: what the runner allocates and what the simulator
    and planner count. extra_bytes_per_block: what each block also costs in
    the same budget elsewhere (a draft model's cache holds as many blocks).
    ValueError when not even one block fits."""
    per_block = kv_bytes_per_block(config, block_size, kv_dtype_bytes) + extra_bytes_per_block
    num_blocks = blocks_in(kv_cache_bytes, per_block)
    if num_blocks < 1:
        raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds no block: one block of "
                         f"{block_size} tokens needs {per_block} bytes")
    return num_blocks
