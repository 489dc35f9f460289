"""Architecture description of a decoder model, whatever file it came from.

Field names follow Hugging Face's config.json so a folder's config maps 1:1
(model_facts/hf_config.py); GGUF metadata fills the same fields
(model_facts/gguf_metadata.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class ModelLoadError(ValueError):
    """A model file or folder cannot be used; the message says what is wrong
    and what is supported. Raised by the config readers, the tokenizer and
    the weight loader (lives here so all can import it without importing
    each other). A ValueError, so a CLI reports it as bad input."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"kvserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        """K and V of one token in every layer: 2 x layers x KV heads x head
        dim x bytes per element, rounded up to whole bytes. The one rule for
        KV bytes: the runner's cache, `kvserve plan` and `kvserve simulate`
        all size through it (model_facts/memory.py turns bytes into blocks)."""
        elements = 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
        return int(math.ceil(elements * dtype_bytes))

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h
