"""CUDA graphs for decode-only steps.

On a GPU, a decode step of a small model is bound by launching its kernels
(about twenty per layer, each a few microseconds of Python and driver work),
not by running them: SmolLM2-135M's 30 layers are ~600 launches for a few
hundred microseconds of GPU work. A CUDA graph records those launches once
and replays them with one call.

A graph has fixed shapes and fixed addresses, so each one is captured for a
padded batch size and a padded context length (a bucket pair), and reads its
inputs from one persistent device buffer that every step refills with a
single host-to-device copy. Padding rows and the context positions past a
sequence's end all point at one scratch KV slot the runner keeps outside the
block pool: padding writes land there and masked reads stay finite.

Graphs are captured lazily, the first time a bucket pair is needed, into one
shared memory pool (replays never overlap, and each step's logits are
consumed before the next replay). All graphs write their logits into one
shared output buffer, so what a graph keeps beyond the pool is its kernels.
Steps with a prefill chunk run eagerly.

With `use_cuda_graphs=False` the same padded, static-buffer forward runs
eagerly: that is how the padding logic is tested on machines without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaModel

if TYPE_CHECKING:
    from kvserve.scheduler.scheduler import ScheduledChunk

# Finer steps at small sizes, where most decode batches are; padding a batch of
# 33 to 48 costs little once launches, not FLOPs, bound the step.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BUCKET = 64
# Longer contexts run eagerly: their attention outweighs the launches, and the
# input buffer (batch x context slots) would grow with the model's context.
MAX_GRAPH_CONTEXT = 8192


def context_buckets(max_context: int) -> tuple[int, ...]:
    """Powers of two from MIN_CONTEXT_BUCKET, ending exactly at max_context."""
    buckets = []
    length = MIN_CONTEXT_BUCKET
    while length < max_context:
        buckets.append(length)
        length *= 2
    buckets.append(max_context)
    return tuple(buckets)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class _DecodeGraph:
    """One bucket pair: a captured graph and the view of the shared logits
    buffer it writes, or (without CUDA graphs) the eager forward over the same
    static buffers."""

    def __init__(self, forward: Callable[[], Tensor], graph: "torch.cuda.CUDAGraph | None",
                 logits: Tensor | None) -> None:
        self.forward = forward
        self.graph = graph
        self.logits = logits

    def replay(self) -> Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class DecodeGraphs:
    """Runs decode-only steps (one new token per sequence, every sequence
    sampled) through per-bucket CUDA graphs; `run` returns [S, vocab] logits."""

    def __init__(self, model: LlamaModel, kv_caches: list[Tensor], *, block_size: int, scratch_slot: int,
                 max_num_seqs: int, max_model_len: int, use_cuda_graphs: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.device = model.device
        self.use_cuda_graphs = use_cuda_graphs
        self.max_batch = min(max_num_seqs, BATCH_BUCKETS[-1])
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < self.max_batch) + (self.max_batch,)
        self.max_context = min(max_model_len, MAX_GRAPH_CONTEXT)
        self.context_buckets = context_buckets(self.max_context)
        # Inputs of bucket (B, L), packed at the start of one buffer:
        # [token ids B | positions B | slot mapping B | context lengths B | context slots B * L].
        size = self.max_batch * (4 + self.max_context)
        self._inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._staging = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._staging_np = self._staging.numpy()
        self._arange = torch.arange(max(self.max_batch, self.max_context), device=self.device)
        self._logits = torch.empty((self.max_batch, model.config.vocab_size), dtype=torch.float32,
                                   device=self.device)
        # Set once the step's input copy is queued: the staging buffer is not
        # refilled before the GPU has read it.
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = None  # the memory pool all graphs share, from the first capture

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def accepts(self, chunks: Sequence["ScheduledChunk"]) -> bool:
        return (len(chunks) <= self.max_batch
                and all(c.num_new_tokens == 1 and c.samples and c.start < self.max_context for c in chunks))

    def run(self, chunks: Sequence["ScheduledChunk"]) -> Tensor:
        """Logits [len(chunks), vocab] float32 for a decode-only step: a view of
        the shared output buffer, overwritten by the next `run`."""
        num_seqs = len(chunks)
        batch = bucket_for(num_seqs, self.batch_buckets)
        context = bucket_for(max(c.start for c in chunks) + 1, self.context_buckets)
        graph = self._graphs.get((batch, context))
        if graph is None:
            graph = self._graphs[(batch, context)] = self._capture(batch, context)
        size = self._fill(chunks, batch, context)
        self._upload(size)
        return graph.replay()[:num_seqs]

    def _upload(self, size: int) -> None:
        self._inputs[:size].copy_(self._staging[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _fill(self, chunks: Sequence["ScheduledChunk"], batch: int, context: int) -> int:
        """Write the step's inputs into the host staging buffer; returns their size."""
        n, bs, scratch = len(chunks), self.block_size, self.scratch_slot
        size = batch * (4 + context)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the buffer
        host = self._staging_np[:size]
        tokens, positions, slots, lens = (host[i * batch:(i + 1) * batch] for i in range(4))
        context_slots = host[4 * batch:].reshape(batch, context)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        tokens[:n] = [c.request.token_ids_slice(c.start, c.start + 1)[0] for c in chunks]
        block_table = np.zeros((n, max(len(c.block_ids) for c in chunks)), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            block_table[row, :len(chunk.block_ids)] = chunk.block_ids
        rows = np.arange(n)
        positions[:n] = starts
        slots[:n] = block_table[rows, starts // bs] * bs + starts % bs
        lens[:n] = starts + 1
        # Context position p of row i: its cache slot while p < len, else the scratch slot.
        pos = np.minimum(np.arange(context)[None, :], starts[:, None])
        in_context = np.arange(context)[None, :] <= starts[:, None]
        context_slots[:n] = np.where(in_context, block_table[rows[:, None], pos // bs] * bs + pos % bs, scratch)
        self._fill_padding(host, batch, context, first_row=n)
        return size

    def _fill_padding(self, host: np.ndarray, batch: int, context: int, first_row: int) -> None:
        """Rows from first_row on: token 0 at position 0, written to and reading
        only the scratch slot, so they touch no request's KV."""
        tokens, positions, slots, lens = (host[i * batch:(i + 1) * batch] for i in range(4))
        tokens[first_row:] = 0
        positions[first_row:] = 0
        slots[first_row:] = self.scratch_slot
        lens[first_row:] = 1
        host[4 * batch + first_row * context:4 * batch + batch * context] = self.scratch_slot

    def _forward(self, batch: int, context: int) -> Tensor:
        """The model over the static input views of bucket (batch, context)."""
        inputs = self._inputs
        tokens, positions, slots, lens = (inputs[i * batch:(i + 1) * batch] for i in range(4))
        context_slots = inputs[4 * batch:4 * batch + batch * context].view(batch, context)
        mask = (self._arange[:context][None, :] < lens[:, None]).view(batch, 1, 1, context)
        meta = AttentionMetadata(positions=positions, slot_mapping=slots, query_index=self._arange[:batch],
                                 context_slots=context_slots, attn_mask=mask, num_seqs=batch,
                                 max_query_len=1, context_lens=lens)
        hidden = self.model.forward(tokens, self.kv_caches, meta)
        out = self._logits[:batch]
        out.copy_(self.model.compute_logits(hidden))
        return out

    def _capture(self, batch: int, context: int) -> _DecodeGraph:
        def forward() -> Tensor:
            return self._forward(batch, context)

        if not self.use_cuda_graphs:
            return _DecodeGraph(forward, None, None)
        # Capture reads whatever the buffers hold: make it all padding (scratch slot only).
        size = batch * (4 + context)
        if self._copied is not None:
            self._copied.synchronize()
        self._fill_padding(self._staging_np[:size], batch, context, first_row=0)
        self._upload(size)
        # One eager run on a side stream first: lazy initialisation (cuBLAS
        # workspaces, kernel selection) must not happen during capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        if self._pool is None:
            self._pool = graph.pool()
        return _DecodeGraph(forward, graph, logits)
