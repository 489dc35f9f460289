"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2) over a paged KV cache.

The model runs a FLAT batch of tokens: every scheduled token of every request
in one step, prefill chunks and decodes mixed, with no padding of the token
dimension. Each layer first writes the K/V of all the step's tokens into the
paged cache (by slot), then attends over each request's context read back from
the cache through its block table. Per-step indexing lives in `AttentionMetadata`,
built once per step by the runner and passed down explicitly.

Weights arrive in Hugging Face names and layout, each matrix either a float
tensor or a `QuantizedWeight` (model/quantized.py: GGUF blocks computed on
in place); q/k/v and gate/up are fused into one matmul each so a decode step
is a few kernels per layer, whichever kind of weight it multiplies by.
"""

from __future__ import annotations

import ctypes
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.model.attention import (AttentionMetadata, lane_run_min_rows, native_attention, native_attention_takes,
                                     paged_attention)
from kvserve.model_facts.config import ModelConfig
from kvserve.model.device import resolve_device
from kvserve.model.quantized import (KernelUnavailable, NativeLayer, QuantizedWeight, activation_type, cache_type,
                                     kernel_threads, require_kernels, tiles_from)


class LinearUpdates(Protocol):
    """A step's additions to the fused linears' outputs (model/lora.LoraStep):
    `add` adds the update of layer `layer`'s `group` (qkv, o, gate_up, down)
    for input x, before that linear's input transform (`norm` / `swiglu`, as
    `input_transform`), to its output `out` in place. A protocol, so the model
    does not import its implementation (which uses `input_transform`)."""

    def add(self, out: Tensor, layer: int, group: str, x: Tensor, norm: tuple[Tensor, float] | None = None,
            swiglu: bool = False) -> None: ...

    def native_step(self) -> ctypes.Structure | None:
        """The same updates as csrc's kvq_lora_step, for the one-call decode
        step (`NativeStep`), or None where they cannot run there."""
        ...


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


class DenseWeight:
    """A float [out, in] weight kept as [in, out]: x @ w with w row-major is up
    to 2x faster than F.linear's x @ w.T on CPU for the small batches of decode."""

    def __init__(self, weight_t: Tensor) -> None:
        self.weight_t = weight_t  # [in_features, out_features]

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() * self.weight_t.element_size()

    def matmul(self, x: Tensor, add: Tensor | None = None, *, norm: tuple[Tensor, float] | None = None,
               swiglu: bool = False, bf16_from: int | None = None) -> Tensor:
        """f(x) @ W.T (+ add), f as in QuantizedWeight.matmul, in torch ops
        (every row alike: a float weight has no prompt tiles)."""
        out = torch.mm(input_transform(x, norm, swiglu), self.weight_t)
        return out if add is None else out.add_(add)


class SplitWeight:
    """Parts of one fused matmul that cannot be stacked (different quantization
    types): each computes its own columns of one output."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: Tensor, add: Tensor | None = None, *, norm: tuple[Tensor, float] | None = None,
               swiglu: bool = False, bf16_from: int | None = None) -> Tensor:
        x = input_transform(x, norm, swiglu)  # its parts get no prompt tiles: every row alike
        out = torch.cat([p.matmul(x) for p in self.parts], dim=-1)
        return out if add is None else out.add_(add)


def input_transform(x: Tensor, norm: tuple[Tensor, float] | None, swiglu: bool) -> Tensor:
    """What a matmul applies to its input first: rms_norm(x, *norm), or
    silu(gate) * up of x = [gate, up]."""
    if norm is not None:
        return rms_norm(x, norm[0], norm[1])
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


Linear = DenseWeight | QuantizedWeight | SplitWeight


def make_linear(parts: list, dtype: torch.dtype, device: torch.device) -> Linear:
    """One matmul over the row-stacked HF [out, in] weights `parts` (float
    tensors or QuantizedWeights)."""
    if all(isinstance(p, Tensor) for p in parts):
        return DenseWeight(torch.cat([p.to(device=device, dtype=dtype) for p in parts]).t().contiguous())
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.qtype for p in parts}) == 1:
        return parts[0] if len(parts) == 1 else QuantizedWeight.concat(parts)
    return SplitWeight([make_linear([p], dtype, device) for p in parts])


class DecoderLayer:
    """One pre-norm transformer block; plain tensors, no nn.Module overhead."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], index: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        prefix = f"model.layers.{index}."

        def take(name: str) -> Tensor:
            return weights[prefix + name].to(device=device, dtype=dtype)

        def linear(*names: str) -> Linear:
            return make_linear([weights[prefix + n] for n in names], dtype, device)

        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.input_norm = take("input_layernorm.weight")
        self.post_attn_norm = take("post_attention_layernorm.weight")
        attn = "self_attn."
        # qkv: hidden -> (H + 2 * Hkv) * D
        self.qkv = linear(*[attn + f"{p}_proj.weight" for p in "qkv"])
        self.qkv_bias = (torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
                         if config.attention_bias else None)
        self.o_proj = linear(attn + "o_proj.weight")
        # gate_up: hidden -> 2 * intermediate
        self.gate_up = linear("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down = linear("mlp.down_proj.weight")
        # RoPE, the K/V write and decode attention as native CPU kernels
        # (set by LlamaModel for quantized models; the float path stays torch).
        self.native_ops = False
        # Which rows take the bfloat16 tiles: by position, not by step (set by LlamaModel).
        self.batch_invariant = False

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o_proj, self.gate_up, self.down]

    def __call__(self, residual: Tensor, kv_cache: Tensor, cos: Tensor, sin: Tensor,
                 meta: AttentionMetadata, lora: LinearUpdates | None = None) -> Tensor:
        """residual: [T, hidden], the residual stream; kv_cache: [num_slots, 2, Hkv, D]
        (this layer). Returns the residual stream after this layer. Each norm and
        the SwiGLU are the input transform of the matmul after them, and each
        residual add is fused into the matmul before it (the quantized kernels do
        both inside one call; the float path runs the same ops in torch).
        `lora`: this step's adapters (model/lora.py), added to each fused
        matmul's output; their input transform runs again in torch on their rows."""
        # Rows from here on take the bfloat16 tiles (model/quantized.tiles_from).
        prompt = tiles_from(residual.shape[0], meta.bf16_rows_from, self.batch_invariant)
        qkv = self.qkv.matmul(residual, norm=(self.input_norm, self.eps), bf16_from=prompt)
        if lora is not None:
            lora.add(qkv, self.index, "qkv", residual, norm=(self.input_norm, self.eps))
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        attn = self.attention(qkv, kv_cache, cos, sin, meta)
        residual = self.o_proj.matmul(attn, add=residual, bf16_from=prompt)
        if lora is not None:
            lora.add(residual, self.index, "o", attn)
        gate_up = self.gate_up.matmul(residual, norm=(self.post_attn_norm, self.eps), bf16_from=prompt)
        if lora is not None:
            lora.add(gate_up, self.index, "gate_up", residual, norm=(self.post_attn_norm, self.eps))
        out = self.down.matmul(gate_up, add=residual, swiglu=True, bf16_from=prompt)
        if lora is not None:
            lora.add(out, self.index, "down", gate_up, swiglu=True)
        return out

    def attention(self, qkv: Tensor, kv_cache: Tensor, cos: Tensor, sin: Tensor,
                  meta: AttentionMetadata) -> Tensor:
        """qkv: [T, (H + 2 * Hkv) * D] -> attention output [T, H * D]; writes K/V.
        cos/sin: [T, 1, D] rows of this step's positions, or (native ops) the
        whole [max_positions, D] tables."""
        num_tokens = qkv.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.native_ops:
            return native_attention(qkv, kv_cache, cos, sin, meta, h, hkv, d, self.scale, self.batch_invariant)
        # q and k share one rotary application: [T, H + Hkv, D]
        qk = apply_rope(qkv[:, : (h + hkv) * d].view(num_tokens, h + hkv, d), cos, sin)
        q = qk[:, :h]
        kv = torch.stack((qk[:, h:], qkv[:, (h + hkv) * d:].view(num_tokens, hkv, d)), dim=1)
        # Write every token's K/V first, so each query below reads its own key too.
        kv_cache.index_copy_(0, meta.slot_mapping, kv.to(kv_cache.dtype))
        return paged_attention(q, kv_cache, meta, self.scale).reshape(num_tokens, h * d)


class NativeStep:
    """A step's layers in one native call (csrc's kvq_decode_layers): the
    per-op path's kernels in its order, so the same bits, without the Python
    between ~5 kernel calls per layer (about a quarter of a batch-1 decode
    step's CPU). Written for decode steps (one row per sequence); steps with
    several tokens per sequence (prefill chunks, a verification's 1 + k tokens)
    run here too: each token is a row of its own whose context ends at its
    position (meta.decode_rows), and every row's K/V is written before any row
    attends, so a token sees the ones before it in its chunk. For CPU models
    whose every layer is four QuantizedWeights and no bias."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self._table: ctypes.Array | None = None
        self._table_caches: tuple[int, ...] = ()  # the KV cache pointers the table holds

    @staticmethod
    def supports(layers: list[DecoderLayer]) -> bool:
        first = layers[0] if layers else None
        return first is not None and first.native_ops and all(
            layer.qkv_bias is None and all(isinstance(lin, QuantizedWeight) for lin in layer.linears())
            for layer in layers) and first.num_heads // first.num_kv_heads <= 16 and first.head_dim <= 256

    def __call__(self, residual: Tensor, kv_caches: list[Tensor], cos: Tensor, sin: Tensor,
                 meta: AttentionMetadata, lora: ctypes.Structure | None = None) -> Tensor:
        """residual: [T, hidden] (one row per meta.decode_rows()), updated in place and returned.
        lora: the step's adapter updates (`LinearUpdates.native_step`; None: base model only)."""
        rows = meta.decode_rows()
        if rows is None:
            raise ValueError("metadata without block tables has no one-call step")
        block_table, context_lens = rows
        first = self.layers[0]
        h, hkv, d = first.num_heads, first.num_kv_heads, first.head_dim
        num_tokens, hidden = residual.shape
        inter = first.down.in_features
        qkv = torch.empty((num_tokens, (h + 2 * hkv) * d), dtype=residual.dtype)
        attn = torch.empty((num_tokens, h * d), dtype=residual.dtype)
        gate_up = torch.empty((num_tokens, 2 * inter), dtype=residual.dtype)
        status = require_kernels().kvq_decode_layers(
            self._layer_table(kv_caches), len(self.layers), residual.data_ptr(), activation_type(residual.dtype),
            num_tokens, hidden, inter, h, hkv, d, first.eps, first.scale, meta.positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], context_lens.data_ptr(), meta.block_size, qkv.data_ptr(),
            attn.data_ptr(), gate_up.data_ptr(), kernel_threads(num_tokens),
            None if lora is None else ctypes.addressof(lora),
            num_tokens if meta.bf16_rows_from is None else meta.bf16_rows_from,
            num_tokens if (tiles := tiles_from(num_tokens, meta.bf16_rows_from, first.batch_invariant)) is None
            else tiles,
            cache_type(kv_caches[0].dtype), lane_run_min_rows(first.batch_invariant))
        if status == -2:
            raise KernelUnavailable("this CPU has no AMX-BF16 for the bfloat16 prompt tiles")
        if status != 0:
            raise MemoryError(f"the native decode step could not allocate scratch for {num_tokens} tokens")
        return residual

    def _layer_table(self, kv_caches: list[Tensor]) -> ctypes.Array:
        caches = tuple(c.data_ptr() for c in kv_caches)
        if self._table is None or caches != self._table_caches:  # built once per KV cache allocation
            entries = [NativeLayer.of(layer.qkv, layer.o_proj, layer.gate_up, layer.down, layer.input_norm,
                                      layer.post_attn_norm, cache) for layer, cache in zip(self.layers, kv_caches)]
            self._table, self._table_caches = (NativeLayer * len(entries))(*entries), caches
        return self._table


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
                 device: torch.device, max_positions: int, prompt_tiles: bool = False,
                 batch_invariant: bool = False) -> None:
        """prompt_tiles: give every quantized layer matmul a bfloat16 copy for
        the rows of large steps (QuantizedWeight.prompt_tiles; AMX-BF16 only):
        the runner then puts a step's prompt rows last (prompt_rows_last).
        batch_invariant: the tiles take a request's prompt positions, never
        its generated ones, however many rows a step has
        (model/quantized.tiles_from), so its tokens do not depend on the batch."""
        self.config = config
        self.dtype = dtype
        self.device = device
        _check_weights(config, weights)
        self.embed_tokens = _table(weights["model.embed_tokens.weight"], dtype, device)
        head = weights.get("lm_head.weight") if not config.tie_word_embeddings else None
        self.lm_head = self.embed_tokens if head is None else _table(head, dtype, device)
        self.norm = weights["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [DecoderLayer(config, weights, i, dtype, device)
                       for i in range(config.num_hidden_layers)]
        self.prompt_rows_last = False
        if prompt_tiles:
            for layer in self.layers:
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    linear = getattr(layer, name)
                    if isinstance(linear, QuantizedWeight):
                        setattr(layer, name, linear.with_prompt_tiles())
                        self.prompt_rows_last = True
        self.cos, self.sin = rope_tables(config, max_positions, dtype, device)
        # A model computing on quantized weights runs the rest of its step in
        # native kernels too: the step is then weight streaming plus attention.
        self.native_ops = device.type == "cpu" and any(
            isinstance(lin, QuantizedWeight) for layer in self.layers for lin in layer.linears())
        for layer in self.layers:
            layer.native_ops = self.native_ops
            layer.batch_invariant = batch_invariant
        # Every step's attention then runs in the native kernels, which read the
        # paged cache through block tables: the runner builds no gathered
        # context or causal mask for SDPA (build_step_batch's sdpa_context).
        self.attends_natively = self.native_ops and native_attention_takes(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        # Steps run every layer in one native call where the layers allow it;
        # None: layer by layer (tests set it to compare the two).
        self.native_decode = NativeStep(self.layers) if NativeStep.supports(self.layers) else None

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                     max_positions: int | None = None, prompt_tiles: bool = False,
                     batch_invariant: bool = False) -> "LlamaModel":
        """Build from Hugging Face-named tensors (any float dtype; cast here)."""
        return cls(config, weights, dtype, resolve_device(device),
                   max_positions or config.max_position_embeddings, prompt_tiles, batch_invariant)

    def weight_bytes(self) -> int:
        """Bytes of every weight as it is resident (quantized ones at their block size)."""
        return sum(self.weight_formats().values())

    def weight_formats(self) -> dict[str, int]:
        """Resident weight bytes by storage format ("float32", "q4_1", ...)."""
        formats: dict[str, int] = {}
        for weight in self._weights():
            for part in (weight.parts if isinstance(weight, SplitWeight) else [weight]):
                key, size = _format_of(part)
                formats[key] = formats.get(key, 0) + size
                if isinstance(part, QuantizedWeight) and part.prompt_tiles is not None:
                    tiles = part.prompt_tiles
                    formats["bfloat16 prompt tiles"] = (formats.get("bfloat16 prompt tiles", 0)
                                                        + tiles.numel() * tiles.element_size())
        return formats

    def _weights(self) -> list:
        """Every weight once (a tied LM head is the embedding table)."""
        weights = [self.embed_tokens, self.norm]
        if self.lm_head is not self.embed_tokens:
            weights.append(self.lm_head)
        for layer in self.layers:
            weights += [layer.input_norm, layer.post_attn_norm, *layer.linears()]
            if layer.qkv_bias is not None:
                weights.append(layer.qkv_bias)
        return weights

    def forward(self, token_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata,
                lora: LinearUpdates | None = None) -> Tensor:
        """token_ids: [T] -> hidden states [T, hidden] (before the final norm).
        kv_caches: one [num_slots, 2, Hkv, D] tensor per layer, written in place.
        lora: the step's per-token adapter updates (None: the base model only)."""
        if isinstance(self.embed_tokens, QuantizedWeight):
            residual = self.embed_tokens.rows(token_ids, self.dtype)
        else:
            residual = F.embedding(token_ids, self.embed_tokens)
        if self.native_ops:
            cos, sin = self.cos, self.sin  # the kernels index them by position
        else:
            cos = self.cos.index_select(0, meta.positions).unsqueeze(1)  # [T, 1, D]
            sin = self.sin.index_select(0, meta.positions).unsqueeze(1)
        if self.native_decode is not None and meta.decode_rows() is not None:
            # Adapters run inside the one-call step where their update can (float32 slots).
            native_lora = None if lora is None else lora.native_step()
            if lora is None or native_lora is not None:
                return self.native_decode(residual, kv_caches, cos, sin, meta, native_lora)
        for layer, kv_cache in zip(self.layers, kv_caches):
            residual = layer(residual, kv_cache, cos, sin, meta, lora)
        return residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab]."""
        normed = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        if isinstance(self.lm_head, QuantizedWeight):
            return self.lm_head.matmul(normed, out_dtype=torch.float32)
        return F.linear(normed, self.lm_head).float()


def _table(weight: "Tensor | QuantizedWeight", dtype: torch.dtype, device: torch.device):
    """The embedding table / LM head: a float tensor on device, or kept quantized."""
    return weight if isinstance(weight, QuantizedWeight) else weight.to(device=device, dtype=dtype)


def _format_of(weight) -> tuple[str, int]:
    if isinstance(weight, QuantizedWeight):
        return weight.qtype, weight.nbytes
    tensor = weight.weight_t if isinstance(weight, DenseWeight) else weight
    return str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()


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
