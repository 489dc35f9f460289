"""One step's SchedulerOutput as index tensors.

The scheduler speaks in requests, positions and block ids; this is the one
place that translates them into index tensors, built with numpy per step
(per-sequence work only, never per token in Python).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kvserve.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from kvserve.scheduler.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepBatch:
    """One step as tensors: the flat tokens, attention indexing, and which
    rows of the hidden states are sampled (and for which requests)."""

    token_ids: Tensor  # [T]
    meta: AttentionMetadata
    # [S] rows sampled: the last token of each sampling chunk, or every
    # token of a chunk verifying drafts (its 1 + k rows, in order)
    sample_rows: Tensor
    sample_requests: list  # contract.Request of each sampling chunk, in chunk order
    num_draft_chunks: int = 0  # sampling chunks that verify drafts



def build_step_batch(chunks: Sequence["ScheduledChunk"], block_size: int,
                     device: torch.device, *, sdpa_context: bool = True,
                     prompt_rows_last: bool = False) -> StepBatch:
    """Index tensors for one step: flat positions and slots, padded query grid,
    block tables, and for SDPA (sdpa_context) the context slots per sequence
    and the causal mask. A model whose attention runs in the native kernels
    (LlamaModel.attends_natively) reads neither: the runner passes False and
    the step skips building them (B x Lmax slots and a B x Qmax x Lmax mask).

    prompt_rows_last (LlamaModel.prompt_rows_last, native attention only):
    the rows of prompt positions (position < the request's prompt length:
    what a prefill or a prefix miss computes, not generated tokens, even
    when a preempted request computes them again) go after all others, each
    kind in chunk order, and meta.bf16_rows_from says where they start. Row
    order is free there: every token is a row of its own for the native
    kernels, and sample_rows follow the rows."""
    num_seqs = len(chunks)
    num_new = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num_seqs)
    context_lens = starts + num_new
    cu_tokens = np.concatenate(([0], np.cumsum(num_new)))
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)  # [T]
    offset_in_chunk = np.arange(cu_tokens[-1]) - cu_tokens[seq_of_token]
    positions = starts[seq_of_token] + offset_in_chunk

    block_table = np.zeros((num_seqs, max(len(c.block_ids) for c in chunks)), dtype=np.int64)
    for row, chunk in enumerate(chunks):
        block_table[row, :len(chunk.block_ids)] = chunk.block_ids
    slot_mapping = block_table[seq_of_token, positions // block_size] * block_size + positions % block_size

    max_query_len = int(num_new.max())
    max_context_len = int(context_lens.max())
    query_index = seq_of_token * max_query_len + offset_in_chunk
    context_slots = attn_mask = None
    if sdpa_context:
        # Context positions past a sequence's end are clamped to its last position: a
        # written slot, masked out below, so uninitialised cache memory is never read.
        context_pos = np.minimum(np.arange(max_context_len)[None, :], context_lens[:, None] - 1)
        rows = np.arange(num_seqs)[:, None]
        context_slots = block_table[rows, context_pos // block_size] * block_size + context_pos % block_size
        attn_mask = _causal_mask(positions, query_index, num_seqs, max_query_len, max_context_len,
                                 context_lens)

    num_tokens = int(cu_tokens[-1])
    order, bf16_rows_from = None, None
    if prompt_rows_last:
        prompt_lens = np.fromiter((c.request.num_prompt_tokens for c in chunks), dtype=np.int64, count=num_seqs)
        is_prompt = positions < prompt_lens[seq_of_token]
        bf16_rows_from = num_tokens - int(is_prompt.sum())
        if 0 < bf16_rows_from < num_tokens:
            order = np.argsort(is_prompt, kind="stable")
            positions, slot_mapping = positions[order], slot_mapping[order]
            query_index, seq_of_token = query_index[order], seq_of_token[order]

    sampling = [i for i, c in enumerate(chunks) if c.samples]
    def to(array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(device)

    token_ids = list(chain.from_iterable(_chunk_tokens(c) for c in chunks))
    if order is not None:
        token_ids = np.asarray(token_ids, dtype=np.int64)[order]
    drafting = [i for i in sampling if chunks[i].spec_token_ids]
    sample_rows = cu_tokens[1:][sampling] - 1
    if drafting:  # a verifying chunk samples all its rows
        sample_rows = np.concatenate([np.arange(cu_tokens[i], cu_tokens[i + 1]) if chunks[i].spec_token_ids
                                      else cu_tokens[i + 1:i + 2] - 1 for i in sampling])
    if order is not None:  # a sampled row where its token went
        sample_rows = np.argsort(order)[sample_rows]
    # A step with several tokens per sequence (prefill chunks, verifications):
    # each token a row of its own for the native CPU kernels (its sequence's
    # blocks, context up to its own position: the causal mask).
    query_rows = max_query_len > 1
    meta = AttentionMetadata(
        positions=to(positions), slot_mapping=to(slot_mapping), query_index=to(query_index),
        context_slots=None if context_slots is None else to(context_slots),
        attn_mask=None if attn_mask is None else to(attn_mask),
        num_seqs=num_seqs, max_query_len=max_query_len, context_lens=to(context_lens),
        block_table=to(block_table), block_size=block_size,
        query_block_table=to(block_table[seq_of_token]) if query_rows else None,
        query_context_lens=to(positions + 1) if query_rows else None, bf16_rows_from=bf16_rows_from)
    return StepBatch(
        token_ids=torch.as_tensor(token_ids, dtype=torch.int64, device=device), meta=meta,
        sample_rows=to(sample_rows), sample_requests=[chunks[i].request for i in sampling],
        num_draft_chunks=len(drafting))


def _chunk_tokens(chunk: "ScheduledChunk") -> list[int]:
    """The chunk's input tokens: the request's, then any drafts after them."""
    if not chunk.spec_token_ids:
        return chunk.request.token_ids_slice(chunk.start, chunk.start + chunk.num_new_tokens)
    return chunk.request.token_ids_slice(chunk.start, chunk.start + 1) + list(chunk.spec_token_ids)


def _causal_mask(positions: np.ndarray, query_index: np.ndarray, num_seqs: int, max_query_len: int,
                 max_context_len: int, context_lens: np.ndarray) -> np.ndarray | None:
    """[B, 1, Qmax, Lmax] bool: query at position p sees context positions 0..p.
    None when no query needs masking (one token per sequence, equal lengths)."""
    if max_query_len == 1 and bool((context_lens == max_context_len).all()):
        return None
    # Padding query rows get position 0: they see one key, so softmax stays finite.
    query_pos = np.zeros(num_seqs * max_query_len, dtype=np.int64)
    query_pos[query_index] = positions
    query_pos = query_pos.reshape(num_seqs, 1, max_query_len, 1)
    return np.arange(max_context_len).reshape(1, 1, 1, -1) <= query_pos
