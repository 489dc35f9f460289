"""Attention over the paged KV cache for one flat batch of tokens.

The torch path gathers each sequence's context through its block table and
runs SDPA; on CUDA, decode-only steps use the Triton kernel in
model/triton_attention.py where it is installed, which reads K/V in place.
Per-step indexing arrives explicitly in `AttentionMetadata`, built once per
step by the runner (runner/step_batch.py).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.model.quantized import activation_type, cache_type, kernel_threads, require_kernels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionMetadata:
    """Indexing for one forward pass over T flat tokens of B sequences.

    positions:     [T] int64, position of each token in its sequence
    slot_mapping:  [T] int64, cache slot each token's K/V is written to
    query_index:   [T] int64, each token's row in the padded [B * max_query_len] query grid
    context_slots: [B, max_context_len] int64, cache slot of each context position
                   (positions past a sequence's length point at any valid slot; masked);
                   None where the step was built for a model whose attention runs in
                   the native kernels (`attends_natively`), which never read it
    attn_mask:     [B, 1, max_query_len, max_context_len] bool (True = attend), or None
                   when every sequence sees its whole context (one-token steps of equal
                   length), or when context_slots is None
    context_lens:  [B] int64, each sequence's context length including this step's
                   tokens (read by the CUDA decode kernel; None where not built)
    block_table:   [B, max_blocks] int64, each sequence's cache blocks (read in
                   place by the native CPU decode kernel; None where not built)
    query_block_table, query_context_lens: [T, max_blocks] and [T] int64, each
                   query token as a sequence of its own: its sequence's blocks and
                   the context it sees (its position + 1, which is the causal
                   mask). Built for steps with several tokens per sequence
                   (prefill chunks, verifications: 1 + k tokens), so the native
                   kernels run them too; None on decode-only steps (their rows
                   are block_table's)
    bf16_rows_from: the first of the rows that are prompt positions, all of
                   them put last (build_step_batch's prompt_rows_last), for a
                   model whose quantized matmuls hold bfloat16 prompt tiles:
                   those rows take the tiles, and attend on AMX-BF16 in the
                   native kernel; None: rows in chunk order, every row
                   computed alike
    """

    positions: Tensor
    slot_mapping: Tensor
    query_index: Tensor
    context_slots: Tensor | None
    attn_mask: Tensor | None
    num_seqs: int
    max_query_len: int
    context_lens: Tensor | None = None
    block_table: Tensor | None = None
    block_size: int = 0
    query_block_table: Tensor | None = None
    query_context_lens: Tensor | None = None
    bf16_rows_from: int | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def decode_rows(self) -> tuple[Tensor, Tensor] | None:
        """(block table, context lengths) with one row per query token, for the
        native kernels, which attend one query per row over its row's
        context; None where the metadata was built without block tables."""
        if self.query_block_table is not None and self.query_context_lens is not None:
            return self.query_block_table, self.query_context_lens
        if self.is_decode_only and self.block_table is not None and self.context_lens is not None:
            return self.block_table, self.context_lens
        return None


def paged_attention(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """q: [T, H, D] -> [T, H, D], each query attending causally over its sequence's
    cached context. GQA without copying K/V: the G query heads that share a KV head
    are folded into the query-length axis, so SDPA sees Hkv heads throughout."""
    num_tokens, h, d = q.shape
    b, qmax = meta.num_seqs, meta.max_query_len
    if meta.is_decode_only and q.is_cuda and meta.context_lens is not None:
        out = _cuda_decode_attention(q, kv_cache, meta, scale)
        if out is not None:
            return out
    if meta.context_slots is None:
        raise ValueError("this step's metadata was built for the native attention kernels, without "
                         "SDPA's gathered context (build_step_batch's sdpa_context)")
    hkv = kv_cache.shape[2]
    group = h // hkv
    # context: [B, Lmax, 2, Hkv, D] gathered through the block tables
    # index_select, not advanced indexing: many times faster on CPU for this shape.
    context = kv_cache.index_select(0, meta.context_slots.view(-1)).view(
        b, -1, *kv_cache.shape[1:]).to(q.dtype)  # a cache of another dtype (--kv-cache-dtype): cast the gather
    k = context[:, :, 0].transpose(1, 2)  # [B, Hkv, Lmax, D]
    v = context[:, :, 1].transpose(1, 2)
    if meta.is_decode_only:
        # T == B: one query per sequence, no padding grid needed.
        q_grid = q.view(b, hkv, group, d)
        out = F.scaled_dot_product_attention(q_grid, k, v, attn_mask=meta.attn_mask, scale=scale)
        return out.reshape(num_tokens, h, d)
    q_pad = q.new_zeros(b * qmax, h, d)
    q_pad.index_copy_(0, meta.query_index, q)
    # [B, Qmax, Hkv, G, D] -> [B, Hkv, G * Qmax, D]
    q_grid = q_pad.view(b, qmax, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * qmax, d)
    mask = meta.attn_mask.repeat(1, 1, group, 1) if meta.attn_mask is not None else None
    out = F.scaled_dot_product_attention(q_grid, k, v, attn_mask=mask, scale=scale)
    out = out.view(b, hkv, group, qmax, d).permute(0, 3, 1, 2, 4).reshape(b * qmax, h, d)
    return out.index_select(0, meta.query_index)


# The native attention kernel's buffers (csrc's KVQ_MAX_GROUP, KVQ_MAX_D).
NATIVE_MAX_GROUP, NATIVE_MAX_HEAD_DIM = 16, 256


def native_attention_takes(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether kvq_decode_attention runs this head shape (else native_attention
    falls back to SDPA)."""
    return num_heads // num_kv_heads <= NATIVE_MAX_GROUP and head_dim <= NATIVE_MAX_HEAD_DIM


# A run of at least this many rows of one sequence in a step (a prompt's
# chunk) attends across vector lanes where the CPU has AVX-512 (csrc's
# lane_attention: 16 queries of one KV head per vector, no horizontal sums),
# shorter runs (a verification's few tokens) row by row. Measured on the
# default model's heads, 2 threads (benchmarks/lane_attention.py): after 256
# or 1,024 cached positions the lanes take 0.94-1.0x the row kernel's time at
# 8 rows and 0.8x at 16 (they copy the run's whole context to float32 first);
# a 256-token prompt 0.57x, 2,048 tokens 0.55x.
LANE_MIN_ROWS = 16


def lane_run_min_rows(batch_invariant: bool) -> int:
    """kvq_decode_attention's run_min_rows. Which kernel a row attends with
    then depends on how many rows of its sequence share the step, and the two
    sum in different orders: `batch_invariant` turns the runs off (0), so a
    request's rows take the same kernel alone or in a crowd (the prompt rows
    that the runner puts last, with the AMX prompt tiles, still take AMX-BF16
    by position)."""
    return 0 if batch_invariant else LANE_MIN_ROWS


def native_attention(qkv: Tensor, kv_cache: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                     batch_invariant: bool = False) -> Tensor:
    """RoPE, the K/V write and attention with the native CPU kernels.

    qkv: [T, (H + 2 * Hkv) * D], q and k rotated in place; cos/sin: the whole
    [max_positions, D] tables; kv_cache: this layer's [slots, 2, Hkv, D].
    Returns [T, H * D]. Each query row reads its K/V in place through its
    sequence's block table (memory bounded by the batch, not the context): one
    row per sequence on a decode-only step, one per token on a step with
    prefill chunks or drafts (`decode_rows`). That replaced SDPA over a
    gathered, padded, masked context for prefill, which cost as much as the
    step's matmuls on a 256-token prompt; SDPA remains for head shapes past
    the kernel's buffers. Rows from meta.bf16_rows_from on (a prompt's
    positions, with prompt tiles) attend on AMX-BF16 tiles in the kernel;
    runs of one sequence's rows across vector lanes (lane_run_min_rows)."""
    lib = require_kernels()
    dtype, cache_dtype = activation_type(qkv.dtype), cache_type(kv_cache.dtype)
    num_tokens = qkv.shape[0]
    h, hkv, d = num_heads, num_kv_heads, head_dim
    lib.kvq_rope_write_kv(qkv.data_ptr(), dtype, num_tokens, qkv.stride(0), meta.positions.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), kv_cache.data_ptr(),
                          cache_dtype, h, hkv, d, kernel_threads())
    rows = meta.decode_rows()
    if rows is not None:
        block_table, context_lens = rows
        out = torch.empty((num_tokens, h * d), dtype=qkv.dtype)
        status = lib.kvq_decode_attention(qkv.data_ptr(), dtype, qkv.stride(0), kv_cache.data_ptr(), cache_dtype,
                                          block_table.data_ptr(), block_table.shape[1],
                                          context_lens.data_ptr(), meta.block_size, num_tokens,
                                          h, hkv, d, scale, out.data_ptr(), kernel_threads(),
                                          num_tokens if meta.bf16_rows_from is None else meta.bf16_rows_from,
                                          lane_run_min_rows(batch_invariant))
        if status == 0:
            return out  # else: a head shape past the kernel's buffers: SDPA below
    if kv_cache.dtype == torch.int8:  # the runner refuses an int8 cache where the kernels cannot attend
        raise RuntimeError("an int8 KV cache is read by the native attention kernels only")
    q = qkv[:, :h * d].view(num_tokens, h, d)
    return paged_attention(q, kv_cache, meta, scale).reshape(num_tokens, h * d)


def _cuda_decode_attention(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                           scale: float) -> Tensor | None:
    """The Triton kernel's output, or None for the torch path: without Triton,
    with KVSERVE_TORCH_ATTENTION=1 (A/B runs), for shapes it does not take, or
    for good once it has failed (e.g. Triton cannot build its launcher here)."""
    global _triton_failed
    kernel = None if _triton_failed or os.environ.get("KVSERVE_TORCH_ATTENTION") == "1" else _triton_kernel()
    if kernel is None or not kernel.supports(q, kv_cache, meta.context_slots):
        return None
    try:
        return kernel.decode_attention(q, kv_cache, meta.context_slots, meta.context_lens, scale)
    except Exception:
        _triton_failed = True
        log.exception("Triton decode attention failed; using the torch attention path from now on")
        return None


_triton_failed = False  # set by the first failure, so one broken install costs one log line


@functools.cache
def _triton_kernel() -> ModuleType | None:
    try:
        from kvserve.model import triton_attention
    except ImportError:
        return None
    return triton_attention
