"""ModelRunner: owns the model and the paged KV cache tensor, and turns one
step's SchedulerOutput into tensors (runner/step_batch.py) -> forward pass
-> sampled tokens.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kvserve import cpu_threads
from kvserve.model_facts import memory
from kvserve.model_facts.config import ModelConfig
from kvserve.model.attention import NATIVE_MAX_GROUP, NATIVE_MAX_HEAD_DIM
from kvserve.model.device import resolve_device, resolve_dtype
from kvserve.model.llama import LlamaModel
from kvserve.model.lora import LoraAdapter, LoraSlots, LoraStep
from kvserve.model.quantized import TILES_MIN_ROWS, prepare_weights, wants_prompt_tiles
from kvserve.model.sampler import Sampler, SamplerOutput, SamplingState
from kvserve.runner.decode_graphs import DecodeGraphs
from kvserve.runner.rejection_sampler import RejectionSampler
from kvserve.runner.step_batch import StepBatch, build_step_batch

if TYPE_CHECKING:
    from kvserve.scheduler.scheduler import ScheduledChunk, SchedulerOutput


log = logging.getLogger(__name__)
# kv_cache_memory_bytes=None: weights and KV cache share this much memory, so
# the bytes quantized weights free go to the cache (float32 SmolLM2-135M:
# ~1.0 GiB of KV; its Q4_1 file: ~1.4 GiB).
AUTO_ENGINE_MEMORY_BYTES = 3 * 2**29  # 1.5 GiB
MIN_AUTO_KV_BYTES = 2**28


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return memory.kv_bytes_per_block(config, block_size, memory.kv_element_bytes(str(dtype), config.head_dim))


def auto_kv_cache_bytes(weight_bytes: int) -> int:
    """The KV cache size when none is configured: what the weights leave of
    AUTO_ENGINE_MEMORY_BYTES, at least MIN_AUTO_KV_BYTES."""
    return max(MIN_AUTO_KV_BYTES, AUTO_ENGINE_MEMORY_BYTES - weight_bytes)


def _resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def auto_kv_cache_dtype(model: LlamaModel, dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype auto`: bfloat16 where the model computes on quantized
    weights in the native CPU kernels (their 4- and 8-bit rounding dwarfs
    bfloat16's; llama.cpp's cache is 16-bit by default too): twice the
    tokens in the same memory, and decode attention reads half the bytes
    (the default model's decode step 1.18-1.19x faster at 1 and 20
    sequences of ~300 tokens). Else the activations' dtype, as vLLM's auto."""
    return torch.bfloat16 if model.native_ops else dtype


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict, *, kv_cache_memory_bytes: int | None,
                 block_size: int = 16, dtype: str | torch.dtype = "float32",
                 device: torch.device | str | None = None, max_model_len: int | None = None,
                 seed: int = 0, max_num_seqs: int = 64, enforce_eager: bool = False,
                 quantization: str = "auto", prefill_weights: str = "none", batch_invariant: bool = False,
                 kv_cache_dtype: str = "auto",
                 max_loras: int | None = None, max_lora_rank: int = 16,
                 extra_kv_bytes_per_block: int = 0, extra_weight_bytes: int = 0) -> None:
        """weights: HF-named float tensors or QuantizedWeights (model/loader.py);
        quantization: what they are computed in (model/quantized.prepare_weights);
        prefill_weights: whether prompt positions take bfloat16 tiles
        (model/quantized.wants_prompt_tiles; "none" for a draft model);
        batch_invariant: which rows take them (model/quantized.tiles_from).
        kv_cache_dtype: the KV cache's element type (auto_kv_cache_dtype).
        kv_cache_memory_bytes None: auto_kv_cache_bytes of the resident weights,
        these and `extra_weight_bytes` (a draft model's, resident beside them).
        extra_kv_bytes_per_block: a draft model's KV bytes per block, which the
        same budget pays for (it holds as many blocks): fewer blocks here.
        max_loras: LoRA adapter slots (None: no adapters), each of rank up to max_lora_rank."""
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        prepared = prepare_weights(weights, quantization, self.device)
        self.model = LlamaModel.from_weights(
            config, prepared, self.dtype, self.device, self.max_model_len,
            prompt_tiles=wants_prompt_tiles(prefill_weights, prepared, self.device, max_loras is not None,
                                            memory.prompt_tile_bytes(config)),
            batch_invariant=batch_invariant)
        self.kv_dtype = (auto_kv_cache_dtype(self.model, self.dtype) if kv_cache_dtype == "auto"
                         else torch.int8 if kv_cache_dtype == "int8" else resolve_dtype(kv_cache_dtype))
        if self.kv_dtype == torch.int8 and not self.model.attends_natively:
            raise ValueError("--kv-cache-dtype int8 needs the native CPU attention kernels: a model computed on "
                             "quantized weights on CPU (--quantization auto with a GGUF file, or q8_0/q4_0/q4_1), "
                             f"with at most {NATIVE_MAX_GROUP} query heads per KV head and head_dim "
                             f"<= {NATIVE_MAX_HEAD_DIM}; use auto, bfloat16 or float32")
        self.weight_bytes = self.model.weight_bytes()
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = auto_kv_cache_bytes(self.weight_bytes + extra_weight_bytes)
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.num_blocks = memory.num_kv_blocks(kv_cache_memory_bytes, config, block_size,
                                               memory.kv_element_bytes(str(self.kv_dtype), config.head_dim),
                                               extra_kv_bytes_per_block)
        # [layers, slots, 2 (K, V), kv_heads, head_dim]: the pool's blocks, then one
        # scratch slot outside them that graph padding writes to and reads from.
        # The eager path reads a block slot only after writing it; the scratch slot
        # must start zeroed, so a masked read of it is finite. Zeroing it all also
        # makes the whole cache resident now: left to the first write of each page,
        # a CPU server's RSS climbed by the cache's size over its first ~10 minutes
        # of traffic (the soak's +20%) and steps took the page faults.
        self.scratch_slot = self.num_blocks * block_size
        self.sampler = Sampler(seed=seed, device=self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.lora_slots = None if max_loras is None else LoraSlots(
            config, max_loras, max_lora_rank, self.dtype, self.device,
            native_step=getattr(self.model, "native_decode", None) is not None)
        formats = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in self.model.weight_formats().items())
        log.info("resident weights %.1f MiB (%s); KV cache %.1f MiB in %s = %d blocks of %d tokens",
                 self.weight_bytes / 2**20, formats, self.num_blocks * kv_bytes_per_block(
                     config, block_size, self.kv_dtype) / 2**20, str(self.kv_dtype).removeprefix("torch."),
                 self.num_blocks, block_size)
        if self.model.prompt_rows_last:
            log.info("bfloat16 tiles take %s", "a request's prompt positions only (--batch-invariant)"
                     if batch_invariant else f"every row of a step of {TILES_MIN_ROWS} rows or more "
                     "(a row's last bits then depend on its step; --batch-invariant: by position)")
        if self.device.type == "cpu":
            log.info("CPU threads: %d (torch and the quantized kernels); %s", torch.get_num_threads(),
                     cpu_threads.wait_policy_note())
        # Decode steps replay CUDA graphs on a GPU; a CPU gains nothing from them.
        self._use_graphs = not enforce_eager and self.device.type == "cuda"
        self._max_num_seqs = max_num_seqs
        self._host_weights: list[tuple[object, str, Tensor]] = []  # (owner, attribute, pinned copy) while asleep
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        """(Re)allocate the KV cache tensor (zeroed, so resident at once) and, on CUDA, the decode graphs
        over it (captured again as steps need them)."""
        # An int8 cache's rows carry their float32 scale first (memory.KV_ROW_SCALE_BYTES).
        row = self.config.head_dim + (memory.KV_ROW_SCALE_BYTES if self.kv_dtype == torch.int8 else 0)
        self.kv_cache = torch.zeros(
            (self.config.num_hidden_layers, self.scratch_slot + 1, 2,
             self.config.num_key_value_heads, row), dtype=self.kv_dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.decode_graphs = None if not self._use_graphs else DecodeGraphs(
            self.model, self.kv_caches, block_size=self.block_size, scratch_slot=self.scratch_slot,
            max_num_seqs=self._max_num_seqs, max_model_len=self.max_model_len)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold `num_blocks` blocks from now on, in a new zeroed cache (what
        the old one held is lost): a draft model's cache, whose size is the
        target's block count, known only once the draft's weights are resident."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.release_kv_cache()
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * self.block_size
        self.kv_cache_memory_bytes = num_blocks * kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)
        self.allocate_kv_cache()
        log.info("KV cache resized to %.1f MiB = %d blocks of %d tokens", self.kv_cache_memory_bytes / 2**20,
                 num_blocks, self.block_size)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)

    def release_kv_cache(self) -> int:
        """Drop the KV cache tensor (and the graphs that read it) so its
        memory goes back to the allocator; bytes released. Everything it
        held is lost: the caller empties the prefix cache."""
        num_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.kv_cache = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        self.kv_caches, self.decode_graphs = [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _return_free_heap_to_the_system()
        return num_bytes

    def offload_weights(self) -> int:
        """CUDA: move the model's tensors to pinned host memory (a level-1
        sleep frees the GPU but keeps the weights a copy away); bytes moved.
        Elsewhere the weights already are in host memory: 0."""
        if self.device.type != "cuda" or self._host_weights:
            return 0
        copies: dict[int, Tensor] = {}  # tied weights stay one tensor
        for owner, name, value in list(_tensor_attributes(self.model)):
            if value.device.type == "cuda":
                host = copies.setdefault(id(value), value.to("cpu").pin_memory())
                self._host_weights.append((owner, name, host))
                object.__setattr__(owner, name, host)  # a weight may be a frozen dataclass
        torch.cuda.empty_cache()
        return sum(t.numel() * t.element_size() for t in copies.values())

    def restore_weights(self) -> None:
        """Undo offload_weights: the pinned copies back to the device."""
        restored: dict[int, Tensor] = {}
        for owner, name, host in self._host_weights:
            object.__setattr__(owner, name, restored.setdefault(id(host), host.to(self.device, non_blocking=True)))
        self._host_weights = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: "SchedulerOutput",
                sampling_states: Mapping[str, SamplingState] | None = None,
                draft_probs: Mapping[str, Tensor] | None = None,
                adapters: Mapping[str, LoraAdapter] | None = None) -> SamplerOutput:
        """Run one forward pass over the scheduled chunks; write their K/V into the
        cache and sample one token for every chunk that reaches its request's end.
        `sampling_states`: request_id -> the sampler's per-request state (masks,
        penalties, bias) for the requests that have one. A chunk with drafts
        is verified (runner/rejection_sampler.py); `draft_probs`: request_id
        -> [k, V] the distributions a draft model drew its drafts from.
        `adapters`: adapter_id -> LoRA adapter, for the requests that run under
        one (a verifying chunk's draft rows run under its adapter too)."""
        chunks = scheduler_output.chunks
        if not chunks:
            return SamplerOutput({}, {})
        if self.device.type == "cuda":
            # Kernel launches, graph capture and replay go to the current
            # device's stream: make that this runner's device (e.g. cuda:1).
            with torch.cuda.device(self.device):
                return self._execute(chunks, sampling_states, draft_probs, adapters)
        return self._execute(chunks, sampling_states, draft_probs, adapters)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes by kind: `weights` (resident, quantized at their block size),
        `kv_cache` (the preallocated tensor) and `workspace`: on CUDA, peak
        allocated memory beyond those two (activations, graph pools); on CPU,
        the process's resident memory beyond them (activations, the
        interpreter, tokenizer; untouched KV pages are not resident, so it
        reads low until the cache has been written)."""
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.device.type == "cuda":
            total = torch.cuda.max_memory_allocated(self.device)
        else:
            total = _resident_bytes()
        return {"weights": self.weight_bytes, "kv_cache": kv_bytes,
                "workspace": max(0, total - self.weight_bytes - kv_bytes)}

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured so far: a step that raised it paid a one-off capture."""
        return 0 if self.decode_graphs is None else self.decode_graphs.num_captured

    def step_batch(self, chunks: Sequence["ScheduledChunk"]) -> StepBatch:
        """The step's index tensors as this model computes them: no SDPA
        context where it attends natively, its prompt rows last where it has
        prompt tiles."""
        return build_step_batch(chunks, self.block_size, self.device,
                                sdpa_context=not self.model.attends_natively,
                                prompt_rows_last=self.model.prompt_rows_last and self.model.attends_natively)

    def _execute(self, chunks: Sequence["ScheduledChunk"], sampling_states: Mapping[str, SamplingState] | None,
                 draft_probs: Mapping[str, Tensor] | None,
                 adapters: Mapping[str, LoraAdapter] | None) -> SamplerOutput:
        lora = self._lora_step(chunks, adapters)
        if lora is None and self.decode_graphs is not None and self.decode_graphs.accepts(chunks):
            return self.sampler.sample(self.decode_graphs.run(chunks), [c.request for c in chunks],
                                       sampling_states)
        batch = self.step_batch(chunks)
        hidden = self.model.forward(batch.token_ids, self.kv_caches, batch.meta, lora)
        if not batch.sample_requests:
            return SamplerOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        if batch.num_draft_chunks:
            return self._sample_and_verify(logits, [c for c in chunks if c.samples], sampling_states, draft_probs)
        return self.sampler.sample(logits, batch.sample_requests, sampling_states)

    def _sample_and_verify(self, logits: Tensor, sampling: Sequence["ScheduledChunk"],
                           sampling_states: Mapping[str, SamplingState] | None,
                           draft_probs: Mapping[str, Tensor] | None) -> SamplerOutput:
        """logits: [S, V] rows of `sampling` chunks in order (1 + k for a chunk
        with k drafts): plain rows sampled, verifying chunks' rows verified."""
        plain_rows, draft_rows, row = [], [], 0
        for chunk in sampling:
            n = 1 + len(chunk.spec_token_ids)
            if chunk.spec_token_ids:
                draft_rows.extend(range(row, row + n))
            else:
                plain_rows.append(row)
            row += n
        drafting = [c for c in sampling if c.spec_token_ids]
        out = self.rejection_sampler.verify(logits[draft_rows], [c.request for c in drafting],
                                            [c.spec_token_ids for c in drafting], draft_probs)
        if plain_rows:
            plain = self.sampler.sample(logits[plain_rows], [c.request for c in sampling if not c.spec_token_ids],
                                        sampling_states)
            out.token_ids.update(plain.token_ids)
            out.logprobs.update(plain.logprobs)
        return out

    def _lora_step(self, chunks: Sequence["ScheduledChunk"],
                   adapters: Mapping[str, LoraAdapter] | None) -> LoraStep | None:
        """The step's per-token adapter slots (its adapters made resident), or
        None when every chunk runs the base model."""
        ids = [c.request.adapter_id for c in chunks]
        if all(adapter_id is None for adapter_id in ids):
            return None
        if self.lora_slots is None or adapters is None:
            raise ValueError("a request under a LoRA adapter, but this runner serves no adapters")
        slot_of = self.lora_slots.slots_for(adapters[i] for i in set(ids) if i is not None)
        slot_per_chunk = np.fromiter((-1 if i is None else slot_of[i] for i in ids), dtype=np.int64,
                                     count=len(ids))
        num_new = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(ids))
        return self.lora_slots.step(np.repeat(slot_per_chunk, num_new))


def _return_free_heap_to_the_system() -> None:
    """glibc keeps freed memory that came from its heap arenas (not every
    large block is its own mapping: a process that freed big blocks before
    raises the mmap threshold), so a freed KV cache can stay resident; ask it
    to give its free pages back. Elsewhere (another libc) this does nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tensor_attributes(model: object) -> Iterator[tuple[object, str, Tensor]]:
    """(owner, attribute, tensor) for every tensor the model holds, through
    its layers and weight objects (dense, quantized, split), each once."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        owner = stack.pop()
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        for name, value in list(vars(owner).items()):
            if isinstance(value, Tensor):
                yield owner, name, value
            else:
                stack.extend(v for v in (value if isinstance(value, list) else [value]) if _holds_weights(v))


def _holds_weights(value: object) -> bool:
    """kvserve's own model objects (layers, weights), not tensors or configs' plain values."""
    return type(value).__module__.startswith("kvserve.model.") and hasattr(value, "__dict__")
