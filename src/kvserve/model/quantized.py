"""Weights that stay quantized in memory (GGUF Q8_0 / Q4_0 / Q4_1) and the
CPU kernels that compute on them (csrc/kvq_kernels.c, built by `make install`
into kvserve/model/_kvq.so and called through ctypes, which releases the GIL
for the whole call; their threads: `kernel_threads`).

`QuantizedWeight` holds one [N, K] weight in the kernels' 8-row interleaved
layout (the same bytes per block as the GGUF file, reordered once at load)
and computes `x @ W.T` with x in float32 or bfloat16: activations are
quantized to int8 per block of 32 inside the call, weights are never
expanded. Why this kernel and not torch's int8/int4 ops, torchao or a ggml
binding: docs/quantization.md (the kernel comparison).

Where the CPU has AMX-BF16, a weight may also hold `prompt_tiles`: a
bfloat16 copy packed for the AMX tiles (`pack_prompt_tiles`), which
`matmul(..., bf16_from=i)` uses for rows i and after (`tiles_from`: every
row of a large step, or by position a request's prompt rows): many rows
against one weight, where the int8 path's per-block epilogue binds and
bfloat16 products run ~1.5x faster (docs/quantization.md). Named for the
prompt positions that first took them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvserve.config import PREFILL_WEIGHTS_CHOICES, PROMPT_TILES_AUTO_MAX_BYTES, QUANTIZATION_CHOICES
from kvserve.cpu_features import amx_bf16_available

log = logging.getLogger(__name__)

BLOCK = 32  # inputs per quantization block, every supported type
ROWS_PER_GROUP = 8  # output rows interleaved by the kernels' layout
# name -> (ggml type id, GGUF bytes per block, kernel bytes per block of 8 rows)
QUANT_TYPES = {"q4_0": (2, 18, 144), "q4_1": (3, 20, 160), "q8_0": (8, 34, 272)}
_ACT_TYPES = {torch.float32: 0, torch.bfloat16: 1}
_XOP_PLAIN, _XOP_RMS_NORM, _XOP_SWIGLU = 0, 1, 2  # csrc's KVQ_X_*
LIBRARY_PATH = Path(__file__).with_name("_kvq.so")
# csrc's KVQ_ABI_VERSION that this module's calls are written against.
KVQ_ABI_VERSION = 3


# Matrices an explicit Q4 request stores as Q8_0, as llama.cpp's Q4 files do:
# the embedding table (and tied LM head) is read row by row and costs little.
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


class KernelUnavailable(ValueError):
    """The quantized kernels cannot run here (library not built, not a CPU
    device, or a shape they do not take)."""


@functools.cache
def _built_library() -> ctypes.CDLL | None:
    if not LIBRARY_PATH.exists():
        return None
    return ctypes.CDLL(str(LIBRARY_PATH))  # CDLL, not PyDLL: calls release the GIL


def library_problem() -> str | None:
    """Why the kernels cannot be called (None: they can): the library is
    not built, or was built from other sources than this module's (a stale
    `_kvq.so` would be called with arguments in the wrong places)."""
    lib = _built_library()
    if lib is None:
        return f"the quantized CPU kernels are not built ({LIBRARY_PATH} is missing)"
    try:
        version = int(lib.kvq_abi_version())
    except AttributeError:
        version = None
    if version != KVQ_ABI_VERSION:
        built = "before interface versions" if version is None else f"for interface version {version}"
        return (f"the quantized CPU kernels in {LIBRARY_PATH} are stale (built {built}; this kvserve calls "
                f"version {KVQ_ABI_VERSION}): rebuild them")
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    if library_problem() is not None:
        return None
    lib = _built_library()
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    f32 = ctypes.c_float
    # The last argument of each parallel kernel: how many threads (the caller
    # and pool helpers) it may use; kernel_threads() gives torch's count.
    lib.kvq_matmul.argtypes = [i32, ptr, i64, i64, ptr, i32, i64, i32, ptr, f32,
                               i64, ptr, i32, i64, ptr, i32, i64, i32]
    lib.kvq_matmul.restype = i32
    lib.kvq_rope_write_kv.argtypes = [ptr, i32, i64, i64, ptr, ptr, ptr, ptr, ptr, i32, i64, i64, i64, i32]
    lib.kvq_rope_write_kv.restype = None
    lib.kvq_decode_attention.argtypes = [ptr, i32, i64, ptr, i32, ptr, i64, ptr, i64, i64, i64, i64, i64, f32,
                                         ptr, i32, i64, i64]
    lib.kvq_decode_attention.restype = i32
    lib.kvq_dequantize_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, i32, i32]
    lib.kvq_dequantize_rows.restype = None
    lib.kvq_matmul_bf16.argtypes = [ptr, i64, i64, ptr, i32, i64, i32, ptr, f32, i64, ptr, i32, i64, ptr, i32,
                                    i64, i32]
    lib.kvq_matmul_bf16.restype = i32
    lib.kvq_decode_layers.argtypes = [ptr, i64, ptr, i32, i64, i64, i64, i64, i64, i64, f32, f32,
                                      ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i32, ptr, i64, i64,
                                      i32, i64]
    lib.kvq_decode_layers.restype = i32
    lib.kvq_lora_apply.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i32, i64, i32, ptr, f32, ptr, i64, i32]
    lib.kvq_lora_apply.restype = i32
    lib.kvq_set_isa.argtypes = [i32]
    lib.kvq_set_isa.restype = i32
    lib.kvq_set_isa(int(os.environ.get("KVSERVE_KVQ_PORTABLE", "0") == "1"))
    return lib


def kernels_available() -> bool:
    return _library() is not None


def require_kernels() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelUnavailable(f"{library_problem()}; run `make install` (needs gcc), or use --quantization none")
    return lib


# A step's matmuls take the tiles only for at least this many rows. The
# tiles stream the weights in bfloat16 (the default model's: 0.2 GiB a step,
# ~3.5x its Q4_1 blocks) and pay that back only once enough rows share them.
# Measured on the AMX Xeon (1 and 2 threads), a step's cost on the tiles over
# its cost on the quantized blocks: 2.0-2.4x for 1 prompt row, 1.5-1.8x for 8,
# 1.0-1.1x for 24, 0.86-0.97x for 32 (with 0 and 8 decode rows beside);
# decode-only steps 1.11x at 16 rows, 0.94x at 32, 0.91x at 64. Small prompt
# chunks are common: a prefix-cache hit's remainder, a chunked prompt's tail,
# a preempted request's recompute. (Prompt rows' attention stays on AMX-BF16
# either way: over a long cached prefix it is what the rows cost.)
TILES_MIN_ROWS = 32


def tiles_from(num_rows: int, prompt_from: int | None, batch_invariant: bool = False) -> int | None:
    """The first of a step's rows whose matmuls take the bfloat16 tiles
    (None: every row on the quantized blocks). `prompt_from`: the first
    prompt row (AttentionMetadata.bf16_rows_from; None where the model holds
    no tiles).

    By default the rule is the step's size: every row, prompt or generated,
    where the step has at least TILES_MIN_ROWS rows (the decode rows beside a
    prompt's chunk then share its stream of the tiles instead of streaming
    the quantized blocks too), else none. So a row's last bits depend on how
    many rows came with it. `batch_invariant` makes the rule the position:
    a request's prompt positions take the tiles however few, its generated
    tokens never do, so its tokens are the same alone or in a crowd (at the
    cost of small prompt chunks streaming the tiles)."""
    if prompt_from is None:
        return None
    if batch_invariant:
        return prompt_from if prompt_from < num_rows else None
    return 0 if num_rows >= TILES_MIN_ROWS else None


def prompt_tiles_available() -> bool:
    """Whether the bfloat16 prompt tiles can run here: the kernels are built
    and the CPU (and Linux) give AMX-BF16, and no portable path is pinned."""
    return amx_bf16_available()


def pack_prompt_tiles(weight: Tensor) -> Tensor:
    """A float [N, K] weight as kvq_matmul_bf16's B tiles, bfloat16: per 16
    output rows (N padded with zeros) and 32-wide input block, 16 input pairs
    x 16 outputs x 2 (csrc's layout comment)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of the {BLOCK}-wide blocks")
    padded = torch.zeros((-(-n // 16) * 16, k), dtype=torch.bfloat16)
    padded[:n] = weight.to(torch.bfloat16)
    return padded.view(-1, 16, k // BLOCK, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def kernel_threads(num_rows: int | None = None) -> int:
    """Threads a kernel call may use: torch's intra-op count (`--torch-threads`,
    torch.set_num_threads), read on every call so one setting governs both and
    a call from any thread (the server's engine thread) gets it. The kernels'
    pool never makes the caller wait for a helper that has not started
    (csrc/kvq_kernels.c), so a count above the free cores degrades gently.

    A call on one activation row (a batch-1 decode step, the LM head of a
    prompt's last token) runs on the caller alone: it streams the weights,
    which one core reads nearly as fast as two, and the other core is left
    to the server's event loop, which streams the tokens meanwhile (served
    single-stream TPOT p50 1.13x faster, p90 1.23x, than with both threads
    on the step: benchmarks/served_tpot_ab.py, quiet box, 2026-12-02)."""
    if num_rows == 1:
        return 1
    return torch.get_num_threads()


_ISA_MODES = {"best": 0, "portable": 1, "avx2": 2, "avx512_vnni": 3}  # kvq_set_isa's modes
_ISA_NAMES = {0: "portable", 2: "avx2", 3: "avx512_vnni", 4: "amx"}  # its answers: the matmul's path


def set_isa(isa: str) -> str:
    """Pin the kernels' code path: "portable" (C), "avx2" (AVX2, no AVX-512),
    "avx512_vnni" (VNNI matmul tiles and 512-bit quantization, SwiGLU and
    attention, without AMX), or "best" (the CPU's best: where it also has
    AMX-INT8, the VNNI path with its larger products, 16 activation rows or
    more for Q8_0 and 48 for Q4, on the AMX tiles: the same numbers, faster).
    Returns the path taken ("portable", "avx2", "avx512_vnni" or "amx");
    tests run each."""
    return _ISA_NAMES[require_kernels().kvq_set_isa(_ISA_MODES[isa])]


def pack_gguf_rows(qtype: str, rows: np.ndarray) -> Tensor:
    """GGUF blocks [N, K / 32 * block bytes] (uint8) -> the kernels' layout, a flat
    uint8 tensor of ceil(N / 8) groups; padding rows have zero scales."""
    _, gguf_bytes, _ = QUANT_TYPES[qtype]
    num_rows = rows.shape[0]
    nb = rows.shape[1] // gguf_bytes
    pad = -num_rows % ROWS_PER_GROUP
    blocks = np.ascontiguousarray(rows, dtype=np.uint8).reshape(num_rows, nb, gguf_bytes)
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, nb, gguf_bytes), np.uint8)])
    groups = blocks.reshape(-1, ROWS_PER_GROUP, nb, gguf_bytes).transpose(0, 2, 1, 3)  # [G, nb, 8, bytes]
    num_scales = 2 if qtype == "q4_1" else 1
    scales = groups[..., :2 * num_scales].reshape(*groups.shape[:3], num_scales, 2)
    scales = scales.transpose(0, 1, 3, 2, 4).reshape(*groups.shape[:2], -1)  # d[8] then m[8]
    quants = groups[..., 2 * num_scales:]  # [G, nb, 8 rows, 32 (q8) or 16 (q4) bytes]
    # Per step of 4 inputs, the 8 rows side by side: [G, nb, steps, 8 rows, 4]
    steps = quants.reshape(*quants.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)
    packed = np.concatenate([scales, steps.reshape(*groups.shape[:2], -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))


def unpack_gguf_rows(qtype: str, packed: Tensor, num_rows: int, in_features: int) -> np.ndarray:
    """The inverse of `pack_gguf_rows`: GGUF blocks [num_rows, bytes per row]."""
    _, gguf_bytes, group_bytes = QUANT_TYPES[qtype]
    nb = in_features // BLOCK
    groups = packed.numpy().reshape(-1, nb, group_bytes)
    num_scales = 2 if qtype == "q4_1" else 1
    scales = groups[..., :16 * num_scales].reshape(*groups.shape[:2], num_scales, ROWS_PER_GROUP, 2)
    steps = groups[..., 16 * num_scales:].reshape(*groups.shape[:2], -1, ROWS_PER_GROUP, 4)
    rows = np.concatenate([scales.transpose(0, 1, 3, 2, 4).reshape(*groups.shape[:2], ROWS_PER_GROUP, -1),
                           steps.transpose(0, 1, 3, 2, 4).reshape(*groups.shape[:2], ROWS_PER_GROUP, -1)],
                          axis=-1)  # [G, nb, 8, gguf bytes]
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3).reshape(-1, nb * gguf_bytes)[:num_rows])


def quantize_rows(qtype: str, weight: np.ndarray) -> np.ndarray:
    """Float [N, K] -> GGUF blocks of `qtype` [N, K / 32 * block bytes], with the
    gguf package's reference quantizer (the same rounding as llama.cpp's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[qtype.upper()])


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One [out_features, in_features] weight kept quantized (kernel layout)."""

    qtype: str
    packed: Tensor  # flat uint8, ceil(N / 8) * K / 32 * group block bytes
    out_features: int
    in_features: int
    # The dequantized weight as bfloat16 AMX tiles (pack_prompt_tiles) for
    # the rows matmul's bf16_from names; None: every row on `packed`.
    prompt_tiles: Tensor | None = None

    @classmethod
    def from_gguf_rows(cls, qtype: str, rows: np.ndarray, in_features: int) -> "QuantizedWeight":
        if qtype not in QUANT_TYPES:
            raise ValueError(f"unsupported quantization {qtype!r}; supported: {', '.join(QUANT_TYPES)}")
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of the {BLOCK}-wide blocks")
        return cls(qtype, pack_gguf_rows(qtype, rows), rows.shape[0], in_features)

    @classmethod
    def from_float(cls, qtype: str, weight: Tensor) -> "QuantizedWeight":
        """Quantize a float [N, K] weight (requantizing: it may itself come from a GGUF)."""
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise ValueError(f"a quantized weight is [N, K] with K a multiple of {BLOCK}; got {list(weight.shape)}")
        return cls.from_gguf_rows(qtype, quantize_rows(qtype, weight.float().numpy()), weight.shape[1])

    @property
    def nbytes(self) -> int:
        """The quantized blocks' bytes (prompt_tiles, when held, are extra)."""
        return self.packed.numel()

    def with_prompt_tiles(self) -> "QuantizedWeight":
        """This weight plus its bfloat16 prompt tiles (2 bytes per weight)."""
        return replace(self, prompt_tiles=pack_prompt_tiles(self.dequantize()))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def matmul(self, x: Tensor, add: Tensor | None = None, *, norm: "tuple[Tensor, float] | None" = None,
               swiglu: bool = False, out: Tensor | None = None, out_dtype: torch.dtype | None = None,
               bf16_from: int | None = None) -> Tensor:
        """x: [M, K] float32/bfloat16 (rows may be strided) -> f(x) @ W.T [M, N] (+ add),
        with f applied to each row inside the kernel: rms_norm with norm = (weight [K],
        eps), or swiglu: x is [M, 2K] (gate, up) and f = silu(gate) * up.
        add: [M, N] added to the product (a fused residual); out: an [M, N]
        destination (may be a column slice of a wider buffer). bf16_from: rows
        from it on take the prompt tiles where this weight holds them."""
        lib = require_kernels()
        m, k = x.shape[0], self.in_features
        _check_operand(x, "x", (m, 2 * k if swiglu else k))
        if out is None:
            out = torch.empty((m, self.out_features), dtype=out_dtype or x.dtype)
        _check_operand(out, "out", (m, self.out_features))
        if add is not None:
            _check_operand(add, "add", (m, self.out_features))
        xop, norm_weight, eps = _XOP_PLAIN, None, 0.0
        if norm is not None:
            xop, (norm_weight, eps) = _XOP_RMS_NORM, norm
            if norm_weight.dtype != x.dtype or norm_weight.shape != (k,) or not norm_weight.is_contiguous():
                raise ValueError(f"norm weight must be a contiguous [{k}] tensor of x's dtype")
        elif swiglu:
            xop = _XOP_SWIGLU
        if m == 0:
            return out
        split = m if self.prompt_tiles is None or bf16_from is None else min(max(bf16_from, 0), m)
        if split < m:
            self._matmul_prompt_rows(lib, x[split:], None if add is None else add[split:], xop, norm_weight, eps,
                                     out[split:])
            if split == 0:
                return out
            self._matmul_quantized(lib, x[:split], None if add is None else add[:split], xop, norm_weight, eps,
                                   out[:split])
            return out
        self._matmul_quantized(lib, x, add, xop, norm_weight, eps, out)
        return out

    def _matmul_quantized(self, lib: ctypes.CDLL, x: Tensor, add: Tensor | None, xop: int,
                          norm_weight: Tensor | None, eps: float, out: Tensor) -> None:
        m, k = x.shape[0], self.in_features
        status = lib.kvq_matmul(QUANT_TYPES[self.qtype][0], self.packed.data_ptr(), self.out_features, k,
                                x.data_ptr(), _ACT_TYPES[x.dtype], x.stride(0), xop,
                                None if norm_weight is None else norm_weight.data_ptr(), eps, m,
                                out.data_ptr(), _ACT_TYPES[out.dtype], out.stride(0),
                                None if add is None else add.data_ptr(),
                                0 if add is None else _ACT_TYPES[add.dtype], 0 if add is None else add.stride(0),
                                kernel_threads(m))
        if status != 0:
            raise MemoryError(f"the quantized matmul could not allocate {m} x {k} quantized activations")

    def _matmul_prompt_rows(self, lib: ctypes.CDLL, x: Tensor, add: Tensor | None, xop: int,
                            norm_weight: Tensor | None, eps: float, out: Tensor) -> None:
        m, k = x.shape[0], self.in_features
        status = lib.kvq_matmul_bf16(self.prompt_tiles.data_ptr(), self.out_features, k, x.data_ptr(),
                                     _ACT_TYPES[x.dtype], x.stride(0), xop,
                                     None if norm_weight is None else norm_weight.data_ptr(), eps, m,
                                     out.data_ptr(), _ACT_TYPES[out.dtype], out.stride(0),
                                     None if add is None else add.data_ptr(),
                                     0 if add is None else _ACT_TYPES[add.dtype],
                                     0 if add is None else add.stride(0), kernel_threads(m))
        if status == -2:
            raise KernelUnavailable("this CPU has no AMX-BF16 for the bfloat16 prompt tiles")
        if status != 0:
            raise MemoryError(f"the bfloat16 prompt matmul could not allocate {m} x {k} activations")

    def rows(self, indices: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Dequantized rows [len(indices), K] (an embedding lookup)."""
        lib = require_kernels()
        idx = indices.to(torch.int64).contiguous()
        out = torch.empty((idx.numel(), self.in_features), dtype=dtype)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.out_features):
            raise IndexError(f"row index out of range [0, {self.out_features})")
        lib.kvq_dequantize_rows(QUANT_TYPES[self.qtype][0], self.packed.data_ptr(), self.in_features,
                                idx.data_ptr(), idx.numel(), out.data_ptr(), _ACT_TYPES[dtype], kernel_threads())
        return out

    def dequantize(self) -> Tensor:
        """The whole weight as float32 [N, K] (tests and the float fallback)."""
        return self.rows(torch.arange(self.out_features))

    def gguf_rows(self) -> np.ndarray:
        """The weight back in GGUF blocks [N, bytes per row]."""
        return unpack_gguf_rows(self.qtype, self.packed, self.out_features, self.in_features)

    @classmethod
    def concat(cls, parts: "list[QuantizedWeight]") -> "QuantizedWeight":
        """Stack weights of one type and input size along the output rows
        (q, k, v -> qkv): one kernel call instead of several."""
        qtype, in_features = parts[0].qtype, parts[0].in_features
        if any(p.qtype != qtype or p.in_features != in_features for p in parts):
            raise ValueError("only weights of one quantization type and input size concatenate")
        if all(p.out_features % ROWS_PER_GROUP == 0 for p in parts[:-1]):
            packed = torch.cat([p.packed for p in parts])  # whole groups: bytes stack as they are
            return cls(qtype, packed, sum(p.out_features for p in parts), in_features)
        return cls.from_gguf_rows(qtype, np.concatenate([p.gguf_rows() for p in parts]), in_features)


class NativeLayer(ctypes.Structure):
    """csrc's kvq_layer: one decoder layer's packed weights, norms and KV cache
    as raw pointers (the tensors must outlive the table holding them)."""

    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("qkv_type", ctypes.c_int), ("o_type", ctypes.c_int),
                ("gate_up_type", ctypes.c_int), ("down_type", ctypes.c_int), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("kv_cache", ctypes.c_void_p), ("qkv_bf16", ctypes.c_void_p),
                ("o_bf16", ctypes.c_void_p), ("gate_up_bf16", ctypes.c_void_p), ("down_bf16", ctypes.c_void_p)]

    @classmethod
    def of(cls, qkv: QuantizedWeight, o: QuantizedWeight, gate_up: QuantizedWeight, down: QuantizedWeight,
           input_norm: Tensor, post_norm: Tensor, kv_cache: Tensor) -> "NativeLayer":
        weights = (qkv, o, gate_up, down)
        return cls(*(w.packed.data_ptr() for w in weights), *(QUANT_TYPES[w.qtype][0] for w in weights),
                   input_norm.data_ptr(), post_norm.data_ptr(), kv_cache.data_ptr(),
                   *(None if w.prompt_tiles is None else w.prompt_tiles.data_ptr() for w in weights))


LORA_MAX_TARGETS = 3  # csrc's KVQ_LORA_MAX_TARGETS: q, k, v of the fused qkv
LORA_SEGMENT_ROWS = 8  # csrc's KVQ_LORA_SEG_ROWS: tokens of one slot per segment


class NativeLoraLinear(ctypes.Structure):
    """csrc's kvq_lora_linear: one fused linear's resident adapters
    (model/lora._GroupStack's bf16 packed_a, packed_b panels and its ranks) as pointers."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("ranks", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64), ("width", ctypes.c_int64),
                ("max_rank", ctypes.c_int64), ("num_targets", ctypes.c_int64),
                ("out_offsets", ctypes.c_int64 * (LORA_MAX_TARGETS + 1))]


class NativeLoraStep(ctypes.Structure):
    """csrc's kvq_lora_step: a step's adapter rows grouped by slot in
    segments of (slot, first, end) into `rows` (the arrays must outlive it)."""

    _fields_ = [("linears", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("segments", ctypes.c_void_p),
                ("num_rows", ctypes.c_int64), ("num_segments", ctypes.c_int64)]


# The KV cache's element types in the kernels (csrc: KVQ_F32, KVQ_BF16, KVQ_I8).
_CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def cache_type(dtype: torch.dtype) -> int:
    """The kernels' code for a KV cache's dtype: float32, bfloat16, or int8
    (rows of a float32 scale and head_dim int8 values: model_facts/memory.KV_ROW_SCALE_BYTES)."""
    if dtype not in _CACHE_TYPES:
        raise TypeError(f"the native kernels' KV cache is float32, bfloat16 or int8, got {dtype}")
    return _CACHE_TYPES[dtype]


def activation_type(dtype: torch.dtype) -> int:
    """The kernels' code for an activation dtype (float32 or bfloat16)."""
    if dtype not in _ACT_TYPES:
        raise TypeError(f"the native kernels take float32 or bfloat16, got {dtype}")
    return _ACT_TYPES[dtype]


def _check_operand(t: Tensor, name: str, shape: tuple[int, int]) -> None:
    if t.device.type != "cpu":
        raise KernelUnavailable(f"quantized kernels run on CPU tensors; {name} is on {t.device}")
    if t.dtype not in _ACT_TYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape or t.stride(1) != 1:
        raise ValueError(f"{name} must be a row-major {list(shape)} tensor, got {list(t.shape)} "
                         f"strides {t.stride()}")


def wants_prompt_tiles(prefill_weights: str, weights: dict, device: torch.device, lora: bool,
                       tile_bytes: int) -> bool:
    """Whether a model over `weights` (prepare_weights' output) gets bfloat16
    prompt tiles of `tile_bytes` (model_facts.memory.prompt_tile_bytes):
    `prefill_weights` "auto" where they can run (quantized matrices on CPU,
    AMX-BF16, no LoRA adapters: the adapters' rows are laid out in chunk
    order) and take at most PROMPT_TILES_AUTO_MAX_BYTES, "bf16" where they
    can run or a ValueError saying why not, "none" never."""
    if prefill_weights not in PREFILL_WEIGHTS_CHOICES:
        raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS_CHOICES)}; "
                         f"got {prefill_weights!r}")
    if prefill_weights == "none":
        return False
    quantized = any(isinstance(w, QuantizedWeight) for w in weights.values())
    problem = ("the weights are not quantized (--quantization none, or a float model)" if not quantized
               else f"quantized weights compute on CPU, not {device}" if device.type != "cpu"
               else "LoRA adapters are enabled (their rows keep chunk order)" if lora
               else "this CPU (or Linux) gives no AMX-BF16" if not prompt_tiles_available() else None)
    if problem is not None and prefill_weights == "bf16":
        raise ValueError(f"--prefill-weights bf16 cannot apply: {problem}; use auto or none")
    return problem is None and (prefill_weights == "bf16" or tile_bytes <= PROMPT_TILES_AUTO_MAX_BYTES)


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {quantization!r}")
    return quantization


def prepare_weights(weights: dict, quantization: str, device: torch.device) -> dict:
    """The weights the model computes with, for `--quantization`:

    - "none": every matrix as a float tensor (QuantizedWeights dequantized);
    - "auto": as given (the file's quantized matrices stay quantized), except
      where the kernels cannot run (not CPU, not built): float, one log line;
    - "q8_0" / "q4_0" / "q4_1": every matrix in that type, requantized from its
      float values where it is stored otherwise; Q4 requests keep the embedding
      table in Q8_0. Refuses (KernelUnavailable) where the kernels cannot run.
    """
    check_quantization(quantization)
    has_quantized = any(isinstance(w, QuantizedWeight) for w in weights.values())
    if quantization == "none" or (quantization == "auto" and not has_quantized):
        return _dequantized(weights)
    problem = _kernel_problem(device)
    if problem is not None:
        if quantization != "auto":
            raise KernelUnavailable(f"--quantization {quantization}: {problem}; use --quantization none "
                                    "(the float path) or auto")
        log.warning("quantized weights computed in float (the kernels cannot run: %s); "
                    "resident weights grow to float size", problem)
        return _dequantized(weights)
    if quantization == "auto":
        return dict(weights)
    return _requantized(weights, quantization)


def _kernel_problem(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not on {device.type}"
    if not kernels_available():
        return f"{library_problem()}; run `make install`"
    return None


def _dequantized(weights: dict) -> dict:
    return {name: w.dequantize() if isinstance(w, QuantizedWeight) else w for name, w in weights.items()}


def _requantized(weights: dict, quantization: str) -> dict:
    out, converted = {}, []
    for name, w in weights.items():
        target = "q8_0" if quantization != "q8_0" and name in _TABLES else quantization
        is_matrix = isinstance(w, QuantizedWeight) or (w.dim() == 2 and w.shape[1] % BLOCK == 0)
        if not is_matrix or (isinstance(w, QuantizedWeight) and w.qtype == target):
            out[name] = w
            continue
        source = w.qtype if isinstance(w, QuantizedWeight) else str(w.dtype).removeprefix("torch.")
        out[name] = QuantizedWeight.from_float(target, w.dequantize() if isinstance(w, QuantizedWeight) else w)
        converted.append(f"{source}->{target}")
    if converted:
        counts = {c: converted.count(c) for c in sorted(set(converted))}
        log.info("--quantization %s: requantized %s", quantization,
                 ", ".join(f"{n} matrices {c}" for c, n in counts.items()))
    return out
