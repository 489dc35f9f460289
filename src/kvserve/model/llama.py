"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2) over a paged KV cache.

The model runs a FLAT batch of tokens: every scheduled token of every request
in one step, prefill chunks and decodes mixed, with no padding of the token
dimension. Each layer first writes the K/V of all the step's tokens into the
paged cache (by slot), then attends over each request's context read back from
the cache through its block table. Per-step indexing lives in `AttentionMetadata`,
built once per step by the runner and passed down explicitly.

Weights arrive in Hugging Face names and layout; q/k/v and gate/up are fused
into one matmul each so a decode step is a few kernels per layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model_facts.config import ModelConfig
from kvserve.model.device import resolve_device


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; kvserve supports: llama3")
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin tables [max_positions, head_dim] in rotate-half layout."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer:
    """One pre-norm transformer block; plain tensors, no nn.Module overhead."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], prefix: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        def take(name: str) -> Tensor:
            return weights[prefix + name].to(device=device, dtype=dtype)

        def take_t(*names: str) -> Tensor:
            # Stored [in_features, out_features]: x @ w with w row-major is up to 2x
            # faster than F.linear's x @ w.T on CPU for the small batches of decode.
            return torch.cat([take(n) for n in names]).t().contiguous()

        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.input_norm = take("input_layernorm.weight")
        self.post_attn_norm = take("post_attention_layernorm.weight")
        attn = "self_attn."
        # qkv: [hidden, (H + 2 * Hkv) * D]
        self.qkv_weight = take_t(*[attn + f"{p}_proj.weight" for p in "qkv"])
        self.qkv_bias = (torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
                         if config.attention_bias else None)
        self.o_weight = take_t(attn + "o_proj.weight")
        # gate_up: [hidden, 2 * intermediate]
        self.gate_up_weight = take_t("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down_weight = take_t("mlp.down_proj.weight")

    def __call__(self, hidden: Tensor, residual: Tensor | None, kv_cache: Tensor,
                 cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden, residual: [T, hidden]; kv_cache: [num_slots, 2, Hkv, D] (this layer).
        Returns (mlp output, residual stream) so the next norm fuses the add."""
        residual = hidden if residual is None else hidden + residual
        x = rms_norm(residual, self.input_norm, self.eps)
        x = self.attention(x, kv_cache, cos, sin, meta)
        residual = x + residual
        x = rms_norm(residual, self.post_attn_norm, self.eps)
        gate, up = torch.mm(x, self.gate_up_weight).chunk(2, dim=-1)
        return torch.mm(F.silu(gate) * up, self.down_weight), residual

    def attention(self, x: Tensor, kv_cache: Tensor, cos: Tensor, sin: Tensor,
                  meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_bias is None:
            qkv = torch.mm(x, self.qkv_weight)
        else:
            qkv = torch.addmm(self.qkv_bias, x, self.qkv_weight)
        # q and k share one rotary application: [T, H + Hkv, D]
        qk = apply_rope(qkv[:, : (h + hkv) * d].view(num_tokens, h + hkv, d), cos, sin)
        q = qk[:, :h]
        kv = torch.stack((qk[:, h:], qkv[:, (h + hkv) * d:].view(num_tokens, hkv, d)), dim=1)
        # Write every token's K/V first, so each query below reads its own key too.
        kv_cache.index_copy_(0, meta.slot_mapping, kv)
        out = paged_attention(q, kv_cache, meta, self.scale)
        return torch.mm(out.reshape(num_tokens, h * d), self.o_weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Reduced precision: normalise in float32 as the reference does, then cast.
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """The decoder with its LM head. `forward` computes hidden states for all
    tokens; `compute_logits` runs the final norm and head on the few rows sampled."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        _check_weights(config, weights)
        self.embed_tokens = weights["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        head = weights.get("lm_head.weight") if not config.tie_word_embeddings else None
        self.lm_head = self.embed_tokens if head is None else head.to(device=device, dtype=dtype)
        self.norm = weights["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [DecoderLayer(config, weights, f"model.layers.{i}.", dtype, device)
                       for i in range(config.num_hidden_layers)]
        self.cos, self.sin = rope_tables(config, max_positions, dtype, device)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                     max_positions: int | None = None) -> "LlamaModel":
        """Build from Hugging Face-named tensors (any float dtype; cast here)."""
        return cls(config, weights, dtype, resolve_device(device),
                   max_positions or config.max_position_embeddings)

    def weight_bytes(self) -> int:
        tensors = [self.embed_tokens, self.norm]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_attn_norm, layer.qkv_weight, layer.o_weight,
                        layer.gate_up_weight, layer.down_weight]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, token_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """token_ids: [T] -> hidden states [T, hidden] (before the final norm).
        kv_caches: one [num_slots, 2, Hkv, D] tensor per layer, written in place."""
        hidden = F.embedding(token_ids, self.embed_tokens)
        cos = self.cos.index_select(0, meta.positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, meta.positions).unsqueeze(1)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, kv_cache, cos, sin, meta)
        return hidden + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab]."""
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head).float()


def _check_weights(config: ModelConfig, weights: dict[str, Tensor]) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    missing = [name for name in required if name not in weights]
    if missing:
        raise ValueError(f"model weights are missing {', '.join(missing)}")
    embed = weights["model.embed_tokens.weight"]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"model.embed_tokens.weight has shape {tuple(embed.shape)}, "
                         f"config says ({config.vocab_size}, {config.hidden_size})")
