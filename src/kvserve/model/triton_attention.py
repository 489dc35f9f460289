"""Paged decode attention as a Triton kernel, for CUDA.

The torch path (`llama.paged_attention`) gathers every sequence's context
into a [batch, longest context] tensor before SDPA: its memory traffic is
batch x the longest context (x the graph's context bucket), not the sum of
the contexts. On a GPU serving mixed lengths that copy is the step: 64
sequences padded to 4,096 positions move ~0.4 GB per layer. This kernel
reads each sequence's keys and values in place, through its cache slots,
up to its own length only, with an online softmax (one pass over the
context, one program per sequence and KV head, the query heads of a GQA
group together).

Only imported where a CUDA tensor meets a decode step and Triton is
installed (it ships with CUDA builds of torch); CPU runs never load it.
KVSERVE_TORCH_ATTENTION=1 keeps the torch path on CUDA too (for A/B runs).
TRITON_INTERPRET=1 runs the same kernel on CPU tensors, which is how the
tests check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64  # context positions per loop iteration


@triton.jit
def _decode_attention_kernel(
    q_ptr, kv_ptr, slots_ptr, lens_ptr, out_ptr, scale,
    stride_qt, stride_qh, stride_ks, stride_kkv, stride_kh, stride_sb, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)  # the query heads sharing this KV head
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)  # [G, D]
    length = tl.load(lens_ptr + seq).to(tl.int32)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)  # running max
    l = tl.zeros((GROUP_PAD,), tl.float32)  # running sum of exp
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for start in range(0, length, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        in_ctx = pos < length
        slots = tl.load(slots_ptr + seq * stride_sb + pos, mask=in_ctx, other=0).to(tl.int64)
        base = kv_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(base, mask=in_ctx[:, None], other=0.0).to(tl.float32)  # [N, D]
        v = tl.load(base + stride_kkv, mask=in_ctx[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        scores = tl.where(in_ctx[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


MAX_HEAD_DIM = 256


def supports(q: Tensor, kv_cache: Tensor, context_slots: Tensor) -> bool:
    """Whether the kernel takes these shapes: the cache in q's dtype (else the
    torch path casts what it gathers), a power-of-two head_dim up to
    MAX_HEAD_DIM (tl.arange needs a power of two), unit stride along it and
    along the context."""
    head_dim = q.shape[-1]
    return (kv_cache.dtype == q.dtype and head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and q.stride(2) == 1 and kv_cache.stride(3) == 1 and context_slots.stride(1) == 1)


def decode_attention(q: Tensor, kv_cache: Tensor, context_slots: Tensor, context_lens: Tensor,
                     scale: float) -> Tensor:
    """q: [B, H, D] (one query per sequence); kv_cache: [slots, 2, Hkv, D];
    context_slots: [B, >= max length] cache slot of each context position;
    context_lens: [B] >= 1. Returns [B, H, D] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if not supports(q, kv_cache, context_slots):
        raise ValueError(f"decode_attention does not take head_dim {head_dim} or these strides "
                         f"(see supports())")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(num_seqs, num_kv_heads)](
        q, kv_cache, context_slots, context_lens, out, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        context_slots.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK=BLOCK_N,
    )
    return out
