"""LoRA adapters: a PEFT folder read and checked against the base model
(`read_lora_adapter` -> `LoraAdapter`), the resident slots that hold up to
`max_loras` adapters stacked per layer (`LoraSlots`, LRU eviction), and one
step's per-token low-rank update (`LoraStep`).

Several adapters and the base model run in ONE forward pass: each fused
matmul of a layer (qkv, o, gate_up, down) keeps its k targets' adapters
stacked per slot, A [S, in, k*R] and B [S, k*R, out] (padded rank R,
block-diagonal over the targets, scaling folded into B). A step groups its
adapter tokens by slot once (`LoraStep`: index tensors built in numpy, no
per-adapter Python loop): each fused linear then gathers those rows into a
[slots, max tokens per slot, in] grid, runs two batched matmuls (torch.bmm)
over the slots the step uses, and adds each row back into its token's output
(index_add_). A base-model token is never touched; an adapter token gets
x @ A_i @ B_i * scaling_i, as PEFT's merged weights would give.

A step of a quantized model (decodes and prefill chunks) runs in one native
call (csrc's kvq_decode_layers) with the same update inside it:
`LoraStep.native_step` hands it the tokens sorted by slot in segments of up
to 8, and per fused linear the kernel multiplies each segment's rows by its
slot's A and then by B over only each target's own rank rows and output
columns (`_GroupStack.ranks`), reading the slot's bfloat16 panels
(`_GroupStack` packs them at load) front to back and summing in float32
(AVX-512: one segment's rows x 16 columns held in registers), one pool job
per linear. Those slots hold every adapter's weights rounded to bfloat16,
in the float32 stacks too, so both paths compute with the same weights.

The update's matmuls are small (rank 16): on the CPU they run on one thread.
Torch's OpenMP team makes every member join every region, and with the
cores shared one member waits for a descheduled other: measured here, a
[8, 576] x [576, 192] mm took 1.6 ms on 2 threads and 0.08-0.13 ms on one
with the machine loaded (see cpu_threads.py). The base model's matmuls keep
their threads (the quantized kernels' own pool, or torch's for floats).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvserve.model_facts.config import ModelConfig
from kvserve.model_facts.default_model import file_sha256
from kvserve.model.llama import input_transform
from kvserve.model.quantized import LORA_MAX_TARGETS, LORA_SEGMENT_ROWS, NativeLoraLinear, NativeLoraStep

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The fused matmuls of a decoder layer (model/llama.DecoderLayer) and the
# PEFT target modules each one computes, in the fused output's column order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGET_MODULES = tuple(t for targets in GROUPS.values() for t in targets)
_WEIGHT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ValueError):
    """An adapter folder that cannot be served here; the message says why
    (the server answers 400 with it)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read into memory. `adapter_id` is the sha256 over its
    config and weight files: the prefix-cache namespace and the versions
    carry it, so KV computed under other weights is never reused.
    `weights[(layer, target)]` = (A [r, in], B [out, r] * scaling), float32."""

    name: str
    path: str
    adapter_id: str
    rank: int  # the largest rank of any target
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_lora_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)
    for a base model of `config`. Raises LoraError naming the problem: a
    missing or unreadable file, a PEFT type or option kvserve does not
    compute (DoRA, biases, modules_to_save, targets other than the attention
    and MLP projections), a rank above `max_rank`, shapes that do not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder")
    adapter_config = _read_config(folder)
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {folder} has no {ADAPTER_WEIGHTS} "
                        "(PyTorch .bin adapters are not read)")
    tensors = _read_tensors(name, weights_file)
    alpha = float(adapter_config.get("lora_alpha") or adapter_config.get("r") or 8)
    rslora = bool(adapter_config.get("use_rslora"))
    weights = _pair_weights(name, tensors, config, max_rank, alpha, rslora)
    adapter_id = file_sha256(folder / ADAPTER_CONFIG)[:32] + file_sha256(weights_file)[:32]
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(name, str(folder), adapter_id, rank, weights)


def read_lora_identity(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """An adapter without its weights, for a simulated replica (server/simulated.py):
    the folder's adapter_config.json checked as `read_lora_adapter` does,
    its rank `r` (and rank_pattern's) at most `max_rank`, its id the hash of
    the config and, where there is one, the weights file. `weights` is empty."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder")
    adapter_config = _read_config(folder)
    ranks = [adapter_config.get("r", 8), *(adapter_config.get("rank_pattern") or {}).values()]
    if any(not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank for r in ranks):
        raise LoraError(f"LoRA adapter {name!r}: ranks {ranks} must be integers in 1..--max-lora-rank {max_rank}")
    weights_file = folder / ADAPTER_WEIGHTS
    weights_hash = file_sha256(weights_file)[:32] if weights_file.is_file() else "0" * 32
    return LoraAdapter(name, str(folder), file_sha256(folder / ADAPTER_CONFIG)[:32] + weights_hash, max(ranks), {})


def _read_config(folder: Path) -> dict:
    file = folder / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraError(f"{folder} has no {ADAPTER_CONFIG}: not a PEFT adapter folder") from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file}: must hold a JSON object")
    problems = _unsupported_options(config)
    if problems:
        raise LoraError(f"{file}: {'; '.join(problems)}")
    return config


def _unsupported_options(config: dict) -> list[str]:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        return [f"peft_type {peft_type} is not served (only LORA)"]
    problems = []
    if config.get("use_dora"):
        problems.append("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") not in ("none", None):
        problems.append(f"bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("alpha_pattern"):
        problems.append("alpha_pattern is not supported")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out is not supported (Llama layers are not Conv1D)")
    alpha = config.get("lora_alpha")
    if alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0):
        problems.append(f"lora_alpha must be a positive number, got {alpha!r}")
    return problems


def _read_tensors(name: str, file: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoraError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file ({e})") from None


def _pair_weights(name: str, tensors: dict[str, Tensor], config: ModelConfig, max_rank: int,
                  alpha: float, rslora: bool) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.match(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise LoraError(f"LoRA adapter {name!r}: weight {key} is not a LoRA A/B matrix of "
                            f"a decoder layer's {', '.join(TARGET_MODULES)}")
        layer = int(match.group(1))
        if layer >= config.num_hidden_layers:
            raise LoraError(f"LoRA adapter {name!r}: {key} names layer {layer}; the base model has "
                            f"{config.num_hidden_layers}")
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not halves:
        raise LoraError(f"LoRA adapter {name!r}: its safetensors file holds no LoRA weights")
    dims = _target_dims(config)
    return {key: _checked_pair(name, key, pair, dims[key[1]], max_rank, alpha, rslora)
            for key, pair in sorted(halves.items())}


def _checked_pair(name: str, key: tuple[int, str], pair: dict[str, Tensor], dims: tuple[int, int],
                  max_rank: int, alpha: float, rslora: bool) -> tuple[Tensor, Tensor]:
    where = f"LoRA adapter {name!r}, layer {key[0]} {key[1]}"
    if set(pair) != {"A", "B"}:
        raise LoraError(f"{where}: needs both lora_A and lora_B")
    a, b = pair["A"], pair["B"]
    in_features, out_features = dims
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (out_features, rank):
        raise LoraError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                        f"model (expected [r, {in_features}] / [{out_features}, r])")
    if not 1 <= rank <= max_rank:
        raise LoraError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    # PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.
    scaling = alpha / (math.sqrt(rank) if rslora else rank)
    return a.float().contiguous(), (b.float() * scaling).contiguous()


def _target_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


class _GroupStack:
    """One fused linear's adapters, per slot: A [S, in, k*R], B [S, k*R, out].
    Columns j*R .. j*R + rank of a slot's A (and those rows of its B) are
    target j's; B's rows for target j fill only target j's output columns.

    With `native` (the one-call step takes the update), each target's A and B
    are also held as csrc's kvq_lora_linear panels: bfloat16, tiles of 16
    columns, A's [in][16] per tile of rank columns and B's [rank][16] per tile
    of output columns, so the kernel reads each panel front to back at half
    the bytes of float32. The weights are then rounded to bfloat16 once, here,
    in A and B too, so the per-layer torch update (`LoraStep.add`) computes
    with the same weights as the native one (an adapter saved in bfloat16
    loses nothing; a float32 one moves by at most 2^-9 of each weight)."""

    def __init__(self, targets: Sequence[str], dims: dict[str, tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
        self.targets = tuple(targets)
        self.max_rank = max_rank
        width = len(targets) * max_rank
        in_features = dims[targets[0]][0]
        out_sizes = [dims[t][1] for t in targets]
        self.out_offsets = [sum(out_sizes[:j]) for j in range(len(targets))]
        self.a = torch.zeros((num_slots, in_features, width), dtype=dtype, device=device)
        self.b = torch.zeros((num_slots, width, sum(out_sizes)), dtype=dtype, device=device)
        # each slot's rank per target (0: not targeted): the native update skips the padding
        self.ranks = torch.zeros((num_slots, len(targets)), dtype=torch.int64)
        self.used_slots: set[int] = set()  # slots whose adapter targets this group
        self.native = native
        if native:  # csrc's panels: per slot and target, A [tiles(R)][in][16]; per slot, B [sum_j tiles(out_j)][R][16]
            self._a_panel = _tiles(max_rank) * 16 * in_features
            self._b_panel_offsets = [max_rank * 16 * sum(_tiles(n) for n in out_sizes[:j])
                                     for j in range(len(targets) + 1)]
            self.packed_a = torch.zeros((num_slots, len(targets), self._a_panel), dtype=torch.bfloat16)
            self.packed_b = torch.zeros((num_slots, self._b_panel_offsets[-1]), dtype=torch.bfloat16)

    def native_view(self) -> NativeLoraLinear:
        """csrc's view of the packed panels (CPU tensors that never move)."""
        offsets = (ctypes.c_int64 * (LORA_MAX_TARGETS + 1))(*self.out_offsets, self.b.shape[2])
        return NativeLoraLinear(self.packed_a.data_ptr(), self.packed_b.data_ptr(), self.ranks.data_ptr(),
                                self.a.shape[1], self.b.shape[2], self.a.shape[2], self.max_rank, len(self.targets),
                                offsets)

    def write(self, slot: int, layer: int, adapter: LoraAdapter) -> None:
        self.clear(slot)
        for j, target in enumerate(self.targets):
            pair = adapter.weights.get((layer, target))
            if pair is None:
                continue
            a, b = pair  # [rank, in], [out, rank]
            if self.native:
                a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
                self._pack(slot, j, a.t(), b.t())
            rank, out = a.shape[0], b.shape[0]
            col = j * self.max_rank
            self.a[slot, :, col:col + rank] = a.t().to(self.a.dtype)
            self.b[slot, col:col + rank, self.out_offsets[j]:self.out_offsets[j] + out] = b.t().to(self.b.dtype)
            self.ranks[slot, j] = rank
            self.used_slots.add(slot)

    def _pack(self, slot: int, j: int, a_t: Tensor, b_t: Tensor) -> None:
        """Target j's A^T [in, rank] and B^T [rank, out] (bf16) into the slot's panels."""
        in_features, rank = a_t.shape
        out = b_t.shape[1]
        a_tiles = torch.nn.functional.pad(a_t, (0, _tiles(rank) * 16 - rank)).view(in_features, -1, 16)
        a_flat = a_tiles.permute(1, 0, 2).reshape(-1)  # [tiles][in][16]
        self.packed_a[slot, j, :a_flat.numel()] = a_flat
        b_tiles = torch.nn.functional.pad(b_t, (0, _tiles(out) * 16 - out)).view(rank, -1, 16)
        b_flat = b_tiles.permute(1, 0, 2).reshape(-1)  # [tiles][rank][16]: tile q at q * rank * 16
        start = self._b_panel_offsets[j]
        self.packed_b[slot, start:start + b_flat.numel()] = b_flat

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()
        if self.native:
            self.packed_a[slot].zero_()
            self.packed_b[slot].zero_()
        self.used_slots.discard(slot)


def _tiles(n: int) -> int:
    """csrc's lora_tiles: 16-column tiles holding n columns."""
    return -(-n // 16)


class LoraSlots:
    """The adapters resident at once: `num_slots` slots (--max-loras) of
    rank up to `max_rank` (--max-lora-rank), filled on demand and evicted
    least recently used. Only the engine thread touches it.

    `native_step`: the model runs its steps in csrc's one call
    (model/llama.NativeStep); float32 slots on the CPU then also hold the
    kernel's bf16 panels (`_GroupStack`), and every adapter's weights are
    rounded to bfloat16 for both paths."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, native_step: bool = False) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {num_slots} and {max_rank}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        # The one-call step's view of every stack (csrc's kvq_lora_linear per
        # layer and group), for float32 slots on the CPU; built on first use.
        self.native_capable = native_step and dtype == torch.float32 and device.type == "cpu"
        if native_step and not self.native_capable:  # a slower path than the model's own: say so once
            log.warning("LoRA on a %s model on %s: steps with adapter tokens run layer by layer (the one-call "
                        "native step takes adapters in float32 on the CPU only); base-only steps keep the one call",
                        str(dtype).removeprefix("torch."), device.type)
        self._native_linears: ctypes.Array | None = None
        dims = _target_dims(config)
        self.layers = [{group: _GroupStack(targets, dims, num_slots, max_rank, dtype, device, self.native_capable)
                        for group, targets in GROUPS.items()} for _ in range(config.num_hidden_layers)]
        # The update's small matmuls on one thread (CPU; see the module's docstring).
        self.one_thread_update = device.type == "cpu"
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter_id -> slot, least recent first
        self.num_loads = 0  # adapters written into a slot (each eviction makes one more later)

    def native_linears(self) -> ctypes.Array:
        """[layers * 4] kvq_lora_linear, qkv, o, gate_up, down per layer (GROUPS' order)."""
        if self._native_linears is None:
            entries = [groups[group].native_view() for groups in self.layers for group in GROUPS]
            self._native_linears = (NativeLoraLinear * len(entries))(*entries)
        return self._native_linears

    @property
    def resident_ids(self) -> list[str]:
        """Adapter ids in slots, least recently used first."""
        return list(self._resident)

    def slots_for(self, adapters: Iterable[LoraAdapter]) -> dict[str, int]:
        """Make every adapter of a step resident (loading into a free slot, or
        the least recently used one no adapter of this step holds) and mark
        them most recent; adapter_id -> slot. Raises ValueError when a step
        has more distinct adapters than slots (the scheduler never builds one)."""
        wanted = {adapter.adapter_id: adapter for adapter in adapters}
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step with {len(wanted)} adapters; max_loras is {self.num_slots}")
        for adapter_id in wanted:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
        for adapter_id, adapter in wanted.items():
            if adapter_id not in self._resident:
                self._load(adapter, self._free_slot(wanted))
        return {adapter_id: self._resident[adapter_id] for adapter_id in wanted}

    def evict(self, adapter_id: str) -> None:
        """Free an adapter's slot (an unloaded adapter no request uses)."""
        slot = self._resident.pop(adapter_id, None)
        if slot is not None:
            for groups in self.layers:
                for stack in groups.values():
                    stack.clear(slot)

    def _free_slot(self, keep: dict[str, LoraAdapter]) -> int:
        taken = set(self._resident.values())
        for slot in range(self.num_slots):
            if slot not in taken:
                return slot
        victim = next(adapter_id for adapter_id in self._resident if adapter_id not in keep)
        return self._resident.pop(victim)

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}")
        for layer, groups in enumerate(self.layers):
            for stack in groups.values():
                stack.write(slot, layer, adapter)
        self._resident[adapter.adapter_id] = slot
        self.num_loads += 1

    def step(self, slot_of_token: Sequence[int] | np.ndarray) -> LoraStep:
        """slot_of_token: [T] each token's slot, or -1 (the base model)."""
        return LoraStep(self, np.asarray(slot_of_token, dtype=np.int64))


class LoraStep:
    """One step's low-rank updates, its tokens grouped by slot once.

    `add(out, layer, group, x)` adds that fused linear's update for input x
    [T, in] (before the linear's input transform: `norm` / `swiglu`, as
    `input_transform`) to its output `out` [T, out], in place. The update
    is computed over the slot range [lo, hi) that holds the step's adapters,
    on a grid of `max tokens per slot` rows per slot: row (s, j) is slot
    lo + s's j-th token, or padding (token 0's input, masked to zero after
    the first matmul, so adding it back changes nothing)."""

    def __init__(self, slots: LoraSlots, slot_of_token: np.ndarray) -> None:
        self.slots = slots
        rows = np.flatnonzero(slot_of_token >= 0)
        self.active = set(np.unique(slot_of_token[rows]).tolist())
        self._one_thread = slots.one_thread_update
        self._slot_of_token = slot_of_token
        self._native: NativeLoraStep | None = None
        if not self.active:
            return
        token_slots = slot_of_token[rows]
        lo, hi = int(token_slots.min()), int(token_slots.max()) + 1
        counts = np.bincount(token_slots - lo, minlength=hi - lo)
        self.lo, self.hi, self.tokens_per_slot = lo, hi, int(counts.max())
        order = np.argsort(token_slots, kind="stable")
        sorted_slots = token_slots[order] - lo
        # each token's place in its slot's group: its rank among the slot's tokens
        starts = np.cumsum(counts) - counts
        grid = sorted_slots * self.tokens_per_slot + (np.arange(len(rows)) - starts[sorted_slots])
        index = np.zeros((hi - lo) * self.tokens_per_slot, dtype=np.int64)
        index[grid] = rows[order]
        device = slots.device
        self._index = torch.from_numpy(index).to(device)  # grid row -> token (padding: token 0)
        self._pad_mask: Tensor | None = None
        if len(grid) < len(index):
            mask = np.zeros((hi - lo, self.tokens_per_slot, 1), dtype=np.float32)
            mask.reshape(-1)[grid] = 1
            self._pad_mask = torch.from_numpy(mask).to(device=device, dtype=slots.dtype)

    def native_step(self) -> NativeLoraStep | None:
        """This step for csrc's kvq_decode_layers: the adapter tokens sorted
        by slot (stable) and cut into segments of at most LORA_SEGMENT_ROWS
        tokens of one slot; None where the slots are not float32 on the CPU."""
        if not self.slots.native_capable:
            return None
        if self._native is None and not self.active:
            self._native = NativeLoraStep(ctypes.addressof(self.slots.native_linears()), None, None, 0, 0)
        if self._native is None:
            rows = np.flatnonzero(self._slot_of_token >= 0)
            rows = rows[np.argsort(self._slot_of_token[rows], kind="stable")]
            token_slots = self._slot_of_token[rows]
            # a segment starts where the slot changes or a slot's run reaches LORA_SEGMENT_ROWS
            run_start = np.flatnonzero(np.r_[True, token_slots[1:] != token_slots[:-1]])
            run_of = np.repeat(run_start, np.diff(np.r_[run_start, len(rows)]))
            starts = np.flatnonzero((np.arange(len(rows)) - run_of) % LORA_SEGMENT_ROWS == 0)
            ends = np.r_[starts[1:], len(rows)]
            self._rows = np.ascontiguousarray(rows, dtype=np.int64)
            self._segments = np.ascontiguousarray(np.stack([token_slots[starts], starts, ends], axis=1),
                                                  dtype=np.int64)
            self._native = NativeLoraStep(ctypes.addressof(self.slots.native_linears()), self._rows.ctypes.data,
                                          self._segments.ctypes.data, len(self._rows), len(self._segments))
        return self._native

    def add(self, out: Tensor, layer: int, group: str, x: Tensor, norm: tuple[Tensor, float] | None = None,
            swiglu: bool = False) -> None:
        stack = self.slots.layers[layer][group]
        if self.active.isdisjoint(stack.used_slots):
            return
        if not self._one_thread:
            self._add(out, stack, x, norm, swiglu)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._add(out, stack, x, norm, swiglu)
        finally:
            torch.set_num_threads(threads)

    def _add(self, out: Tensor, stack: _GroupStack, x: Tensor, norm: tuple[Tensor, float] | None,
             swiglu: bool) -> None:
        a, b = stack.a[self.lo:self.hi], stack.b[self.lo:self.hi]
        rows = input_transform(x.index_select(0, self._index), norm, swiglu).to(a.dtype)
        shrunk = torch.bmm(rows.view(self.hi - self.lo, self.tokens_per_slot, -1), a)
        if self._pad_mask is not None:
            shrunk.mul_(self._pad_mask)
        delta = torch.bmm(shrunk, b).view(len(self._index), -1)
        out.index_add_(0, self._index, delta.to(out.dtype))
