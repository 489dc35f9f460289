"""ModelRunner: owns the model and the paged KV cache tensor, and turns one
step's SchedulerOutput into tensors -> forward pass -> sampled tokens.

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

from kvserve.decode_graphs import DecodeGraphs
from kvserve.model.config import ModelConfig
from kvserve.model.device import resolve_device, resolve_dtype
from kvserve.model.llama import AttentionMetadata, LlamaModel
from kvserve.model.sampler import Sampler, SamplerOutput

if TYPE_CHECKING:
    from kvserve.scheduler.scheduler import ScheduledChunk, SchedulerOutput


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)


@dataclass(frozen=True)
class StepBatch:
    """One step as tensors: the flat tokens, attention indexing, and which
    rows of the hidden states are sampled (and for which requests)."""

    token_ids: Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: Tensor  # [S] row of the last token of each sampling chunk
    sample_requests: list  # [S] contract.Request


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], *, kv_cache_memory_bytes: int,
                 block_size: int = 16, dtype: str | torch.dtype = "float32",
                 device: torch.device | str | None = None, max_model_len: int | None = None,
                 seed: int = 0, max_num_seqs: int = 64, enforce_eager: bool = False) -> None:
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.model = LlamaModel.from_weights(config, weights, self.dtype, self.device, self.max_model_len)
        self.num_blocks = kv_cache_memory_bytes // kv_bytes_per_block(config, block_size, self.dtype)
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {kv_cache_memory_bytes} bytes holds no block: one block of "
                f"{block_size} tokens needs {kv_bytes_per_block(config, block_size, self.dtype)} bytes")
        # [layers, slots, 2 (K, V), kv_heads, head_dim]: the pool's blocks, then one
        # scratch slot outside them that graph padding writes to and reads from.
        # Block slots are left uninitialised: the eager path reads a slot only after
        # writing it; the scratch slot starts zeroed, so a masked read of it is finite.
        self.scratch_slot = self.num_blocks * block_size
        self.kv_cache = torch.empty(
            (config.num_hidden_layers, self.scratch_slot + 1, 2,
             config.num_key_value_heads, config.head_dim), dtype=self.dtype, device=self.device)
        self.kv_cache[:, self.scratch_slot].zero_()
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed=seed, device=self.device)
        # Decode steps replay CUDA graphs on a GPU; a CPU gains nothing from them.
        self.decode_graphs = None if enforce_eager or self.device.type != "cuda" else DecodeGraphs(
            self.model, self.kv_caches, block_size=block_size, scratch_slot=self.scratch_slot,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)

    @torch.inference_mode()
    def execute(self, scheduler_output: "SchedulerOutput") -> SamplerOutput:
        """Run one forward pass over the scheduled chunks; write their K/V into the
        cache and sample one token for every chunk that reaches its request's end."""
        chunks = scheduler_output.chunks
        if not chunks:
            return SamplerOutput({}, {})
        if self.device.type == "cuda":
            # Kernel launches, graph capture and replay go to the current
            # device's stream: make that this runner's device (e.g. cuda:1).
            with torch.cuda.device(self.device):
                return self._execute(chunks)
        return self._execute(chunks)

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured so far: a step that raised it paid a one-off capture."""
        return 0 if self.decode_graphs is None else self.decode_graphs.num_captured

    def _execute(self, chunks: Sequence["ScheduledChunk"]) -> SamplerOutput:
        if self.decode_graphs is not None and self.decode_graphs.accepts(chunks):
            return self.sampler.sample(self.decode_graphs.run(chunks), [c.request for c in chunks])
        batch = build_step_batch(chunks, self.block_size, self.device)
        hidden = self.model.forward(batch.token_ids, self.kv_caches, batch.meta)
        if not batch.sample_requests:
            return SamplerOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return self.sampler.sample(logits, batch.sample_requests)


def build_step_batch(chunks: Sequence["ScheduledChunk"], block_size: int,
                     device: torch.device) -> StepBatch:
    """Index tensors for one step: flat positions and slots, padded query grid,
    context slots per sequence, causal mask."""
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
    # Context positions past a sequence's end are clamped to its last position: a
    # written slot, masked out below, so uninitialised cache memory is never read.
    context_pos = np.minimum(np.arange(max_context_len)[None, :], context_lens[:, None] - 1)
    rows = np.arange(num_seqs)[:, None]
    context_slots = block_table[rows, context_pos // block_size] * block_size + context_pos % block_size
    query_index = seq_of_token * max_query_len + offset_in_chunk
    attn_mask = _causal_mask(positions, query_index, num_seqs, max_query_len, max_context_len,
                             context_lens)

    sampling = [i for i, c in enumerate(chunks) if c.samples]
    def to(array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(device)

    token_ids = list(chain.from_iterable(
        c.request.token_ids_slice(c.start, c.start + c.num_new_tokens) for c in chunks))
    meta = AttentionMetadata(
        positions=to(positions), slot_mapping=to(slot_mapping), query_index=to(query_index),
        context_slots=to(context_slots), attn_mask=None if attn_mask is None else to(attn_mask),
        num_seqs=num_seqs, max_query_len=max_query_len, context_lens=to(context_lens))
    return StepBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device), meta=meta,
        sample_rows=to(cu_tokens[1:][sampling] - 1),
        sample_requests=[chunks[i].request for i in sampling])


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
