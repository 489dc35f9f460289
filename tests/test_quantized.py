"""The quantized kernels (model/quantized.py, csrc/kvq_kernels.c) against
dequantize-then-matmul in float64, and the quantized engine end to end.

Tolerance of the matmul: the kernels quantize each row of the activations to
int8 per block of 32 (d = max|x| / 127, round to nearest), so each activation
moves by at most half a step, d / 2 = max|x_block| / 254. The result then
differs from the exact float64 product by at most
    sum_k |W[n, k]| * max|x[m, block(k)]| / 254
plus float32 rounding; the tests allow 1.01x that bound + 1e-5 of the output
scale. A wrong nibble order, scale or block offset misses it by orders of
magnitude (checked by mutating the kernel).
"""

import logging
import time

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kvserve.model import quantized
from kvserve.model.quantized import KernelUnavailable, QuantizedWeight, prepare_weights, quantize_rows

pytestmark = pytest.mark.skipif(not quantized.kernels_available(), reason="quantized kernels not built")

QTYPES = ["q8_0", "q4_0", "q4_1"]
# (N, K, M): odd N, K a multiple of 32; on the AMX tiles where the CPU has them: Q8_0 from M = 16, Q4 from 48
SHAPES = [(13, 32, 1), (200, 96, 17), (37, 160, 1), (64, 576, 17), (40, 64, 50)]


_ISA_REQUESTS = {"amx": "best", "avx512_vnni": "avx512_vnni", "avx2": "avx2", "portable": "portable"}


@pytest.fixture(params=list(_ISA_REQUESTS))
def isa(request):
    """Each test on every code path (the SIMD ones only where the CPU has them)."""
    got = quantized.set_isa(_ISA_REQUESTS[request.param])
    if got != request.param:
        quantized.set_isa("best")
        pytest.skip(f"this CPU has no {request.param} path")
    yield got
    quantized.set_isa("best")


def _weight(qtype: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random quantized weight and its float64 values by gguf's own dequantizer."""
    rng = np.random.default_rng(seed)
    rows = quantize_rows(qtype, rng.standard_normal((n, k)).astype(np.float32))
    exact = torch.from_numpy(dequantize(rows, gguf.GGMLQuantizationType[qtype.upper()]).reshape(n, k)).double()
    return QuantizedWeight.from_gguf_rows(qtype, rows, k), exact


def _assert_within_activation_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y vs x @ w.T in float64, within the int8 activation rounding bound (module docstring)."""
    x = x.double()
    expected = x @ w.T
    block_max = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)  # [M, K]
    bound = (block_max / 254) @ w.abs().T * 1.01 + 1e-5 * expected.abs().max()
    excess = (y.double() - expected).abs() - bound
    assert excess.max() <= 0, f"worst excess over the bound {excess.max():.3g} (bound ~{bound.mean():.3g})"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_float64_dequantized_product(isa, qtype, shape, dtype):
    n, k, m = shape
    weight, exact = _weight(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = weight.matmul(x, out_dtype=torch.float32)
    assert y.shape == (m, n)
    _assert_within_activation_rounding(y, x, exact)


@pytest.mark.parametrize("qtype", QTYPES)
def test_vnni_path_is_bit_identical_to_avx2(qtype):
    """The VNNI tiles (up to 8 activation rows, two groups per 512-bit register)
    compute the AVX2 tiles' integer dot products and float ops in the same order,
    and the AVX-512 activation quantization and SwiGLU the AVX2 ones' per lane,
    so every output is the same float: checked over row counts that leave every
    remainder of a tile (and span up to three chunks of the quantizer, which
    writes the pair tiles' interleaved copy of the activations chunk by
    chunk) and group counts with a lone last group, float32 and bfloat16
    inputs. For Q8_0 the pair tiles take each activation offset to unsigned
    and the weights as they are; the 256-bit tiles |w| and the activation
    with w's sign: the same integer sums."""
    if quantized.set_isa("avx512_vnni") != "avx512_vnni" or quantized.set_isa("avx2") != "avx2":
        quantized.set_isa("best")
        pytest.skip("this CPU has no AVX512-VNNI path")
    _assert_paths_agree_bit_for_bit(qtype, "avx2", "avx512_vnni", [(40, 64), (72, 576), (13, 96)],
                                    [1, 3, 4, 7, 8, 9, 16, 19, 37])


@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_tiles_are_bit_identical_to_vnni(qtype):
    """The AMX tiles (16 activation rows x 16 weight rows, one 32-wide block
    per tile product) give the VNNI tiles' exact int32 dot products and run
    their float epilogue op for op, so every output is the same float and a
    row's numbers do not depend on how many rows share its step (the tiles
    take products of 16 rows or more for Q8_0, 48 for Q4): row counts around
    the thresholds and the multiples of 16, a lone last group, K of 1, 18
    and 48 blocks, float32 and bfloat16."""
    if quantized.set_isa("best") != "amx" or quantized.set_isa("avx512_vnni") != "avx512_vnni":
        quantized.set_isa("best")
        pytest.skip("this CPU has no AMX-INT8 tiles (or Linux does not grant them)")
    _assert_paths_agree_bit_for_bit(qtype, "avx512_vnni", "best", [(40, 64), (72, 576), (13, 96), (24, 1536)],
                                    [15, 16, 17, 33, 47, 48, 49, 63, 65, 100])


def _assert_paths_agree_bit_for_bit(qtype: str, path_a: str, path_b: str, shapes: list, row_counts: list) -> None:
    """Every output of `path_a` and `path_b` the same float: plain, with the
    fused RMS norm and residual, SwiGLU, float32 and bfloat16 in and out."""
    gen = torch.Generator().manual_seed(11)
    try:
        for n, k in shapes:
            weight, _ = _weight(qtype, n, k, seed=n)
            for m in row_counts:
                x, add = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
                norm_w = torch.rand(k, generator=gen) + 0.5
                gate_up = torch.randn(m, 2 * k, generator=gen) * 4  # silu's both sides, past exp's easy range
                outputs = {}
                for path in (path_a, path_b):
                    quantized.set_isa(path)
                    outputs[path] = (weight.matmul(x, add, norm=(norm_w, 1e-5)),
                                     weight.matmul(x, out_dtype=torch.bfloat16),
                                     weight.matmul(x.bfloat16(), add.bfloat16()),
                                     weight.matmul(gate_up, swiglu=True),
                                     weight.matmul(gate_up.bfloat16(), swiglu=True, out_dtype=torch.float32))
                for out_a, out_b in zip(outputs[path_a], outputs[path_b]):
                    assert torch.equal(out_a, out_b), f"N={n} K={k} M={m}"
    finally:
        quantized.set_isa("best")


@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_norm_swiglu_and_residual(isa, qtype):
    n, k, m = 40, 64, 17
    weight, exact = _weight(qtype, n, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, add = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    norm_w = torch.rand(k, generator=gen) + 0.5
    normed = torch.nn.functional.rms_norm(x.double(), (k,), norm_w.double(), 1e-5)
    y = weight.matmul(x, add, norm=(norm_w, 1e-5))
    _assert_within_activation_rounding(y - add, normed, exact)
    gate_up = torch.randn(m, 2 * k, generator=gen)
    act = torch.nn.functional.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    _assert_within_activation_rounding(weight.matmul(gate_up, swiglu=True), act, exact)


def test_bfloat16_output_and_strided_input(isa):
    weight, exact = _weight("q4_1", 24, 64, seed=5)
    wide = torch.randn(3, 100)
    x = wide[:, 10:74]  # rows strided 100 apart
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    weight.matmul(x, out=out[:, 8:32])
    expected = x.double() @ exact.T
    assert torch.allclose(out[:, 8:32].double(), expected, rtol=0.02, atol=0.05 * expected.abs().max())


@pytest.mark.parametrize("qtype", QTYPES)
def test_layout_round_trips_and_dequantizes_as_gguf(qtype):
    weight, exact = _weight(qtype, 21, 96, seed=6)
    assert torch.equal(weight.dequantize().double(), exact)
    rows = weight.gguf_rows()
    assert np.array_equal(rows, QuantizedWeight.from_gguf_rows(qtype, rows, 96).gguf_rows())
    picked = torch.tensor([20, 0, 7, 7])
    assert torch.equal(weight.rows(picked).double(), exact[picked])
    other, other_exact = _weight(qtype, 16, 96, seed=7)
    for parts in ([weight, other], [other, weight, other]):  # unaligned and aligned stacking
        stacked = QuantizedWeight.concat(parts)
        expected = torch.cat([exact if p is weight else other_exact for p in parts])
        assert torch.equal(stacked.dequantize().double(), expected)


def test_bad_operands_are_refused():
    weight, _ = _weight("q8_0", 8, 64, seed=8)
    with pytest.raises(ValueError, match="row-major"):
        weight.matmul(torch.randn(2, 32))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        weight.matmul(torch.randn(2, 64).half())
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([8]))
    with pytest.raises(ValueError, match="multiple"):
        QuantizedWeight.from_float("q8_0", torch.randn(4, 48))


# Head dims: 32 takes the AVX2 tiles on every SIMD path, 64 the AVX-512 ones on
# the "best" path where the CPU has them.
HEAD_DIMS = [32, 64]


# (activations, KV cache): alike, and float32 activations over a bfloat16 cache (--kv-cache-dtype)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("d", HEAD_DIMS + [128])  # 128: a bfloat16 cache's tile in two 64-wide halves
@pytest.mark.parametrize("h, hkv", [(6, 2), (10, 2)])  # 3 and 5 (4 + 1) query heads per KV head
def test_decode_attention_reads_paged_cache_like_sdpa(isa, dtype, cache_dtype, d, h, hkv):
    from kvserve.model.attention import AttentionMetadata, native_attention

    block_size = 4
    lens = [1, 9, 75]  # the last spans three of the kernel's 32-position tiles
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0)).tolist()  # scattered blocks
    blocks = [order[:1], order[1:4], order[4:23]]
    cache = torch.randn(30 * block_size + 1, 2, hkv, d).to(cache_dtype)
    table = torch.zeros(3, 19, dtype=torch.int64)
    for row, b in enumerate(blocks):
        table[row, :len(b)] = torch.tensor(b)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([b[(n - 1) // block_size] * block_size + (n - 1) % block_size for b, n in zip(blocks, lens)])
    qkv = torch.randn(3, (h + 2 * hkv) * d).to(dtype)
    cos, sin = torch.ones(80, d, dtype=dtype), torch.zeros(80, d, dtype=dtype)  # identity rotation: attention alone
    meta = AttentionMetadata(positions=positions, slot_mapping=slots, query_index=torch.arange(3),
                             context_slots=torch.zeros(3, 1, dtype=torch.int64), attn_mask=None, num_seqs=3,
                             max_query_len=1, context_lens=torch.tensor(lens), block_table=table,
                             block_size=block_size)
    out = native_attention(qkv.clone(), cache, cos, sin, meta, h, hkv, d, 0.2)
    for row, (b, n) in enumerate(zip(blocks, lens)):
        ctx_slots = torch.tensor([b[p // block_size] * block_size + p % block_size for p in range(n)])
        k, v = cache[ctx_slots, 0].transpose(0, 1), cache[ctx_slots, 1].transpose(0, 1)  # [Hkv, n, D]
        q = qkv[row, :h * d].view(hkv, h // hkv, d)
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.2)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[row].float(), expected.reshape(-1), atol=tolerance, rtol=tolerance)
        # The kernel wrote this token's k and v at its slot before attending (rounded as torch casts).
        assert torch.equal(cache[slots[row], 1].reshape(-1), qkv[row, (h + hkv) * d:].to(cache_dtype))


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_steps_with_several_tokens_per_sequence_attend_causally_like_sdpa(isa, dtype, cache_dtype, d):
    """Prefill chunks (one fresh, one on top of a cached prefix) and a decode in
    one step, indexed by the runner's own build_step_batch: the native kernel's
    per-token causal attention equals SDPA over the gathered, masked context."""
    from dataclasses import replace
    from types import SimpleNamespace

    from kvserve.model.attention import native_attention
    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk

    h, hkv, block_size = 6, 2, 4
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()  # scattered blocks
    # (start, new tokens): 37 fresh prompt tokens (two 32-position tiles), a 5-token
    # chunk after 7 cached ones, one decode token at position 40.
    shapes = [(0, 37), (7, 5), (40, 1)]
    blocks = [order[:10], order[10:13], order[13:24]]
    request = SimpleNamespace(token_ids_slice=lambda start, end: [1] * (end - start))
    chunks = [ScheduledChunk(request, start, n, b, True) for (start, n), b in zip(shapes, blocks)]
    meta = build_step_batch(chunks, block_size, torch.device("cpu")).meta
    assert meta.query_block_table is not None and meta.query_context_lens is not None
    num_tokens = int(meta.positions.numel())
    cache = torch.randn(40 * block_size, 2, hkv, d).to(cache_dtype)
    qkv = torch.randn(num_tokens, (h + 2 * hkv) * d).to(dtype)
    cos, sin = torch.ones(80, d, dtype=dtype), torch.zeros(80, d, dtype=dtype)  # identity rotation
    native = native_attention(qkv.clone(), cache.clone(), cos, sin, meta, h, hkv, d, 0.2)
    sdpa_meta = replace(meta, query_block_table=None, query_context_lens=None)  # the SDPA path
    expected = native_attention(qkv.clone(), cache.clone(), cos, sin, sdpa_meta, h, hkv, d, 0.2)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(native.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("d", [16, 64, 128])
def test_native_rope_and_kv_write_match_the_torch_path(isa, dtype, cache_dtype, d):
    """kvq_rope_write_kv rotates q and k in place as model/llama.apply_rope
    does (float32: bit for bit on every code path) and writes each token's
    k and v at its slot, rounded to the cache's dtype as torch casts."""
    from kvserve.model.llama import apply_rope

    h, hkv, tokens = 6, 2, 37
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (h + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.rand(90, d // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    positions = torch.randperm(90, generator=gen)[:tokens]
    slots = torch.randperm(64, generator=gen)[:tokens]
    cache = torch.zeros(64, 2, hkv, d, dtype=cache_dtype)
    out = qkv.clone()
    quantized.require_kernels().kvq_rope_write_kv(
        out.data_ptr(), quantized.activation_type(dtype), tokens, out.stride(0), positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), slots.data_ptr(), cache.data_ptr(), quantized.activation_type(cache_dtype), h, hkv, d, 2)
    qk = qkv[:, :(h + hkv) * d].view(tokens, h + hkv, d)
    expected = apply_rope(qk.float(), cos[positions].float()[:, None], sin[positions].float()[:, None]).to(dtype)
    got = out[:, :(h + hkv) * d].view(tokens, h + hkv, d)
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:  # bfloat16 in and out: one rounding of the float32 result, where torch rounds each op
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[:, (h + hkv) * d:], qkv[:, (h + hkv) * d:])  # v untouched
    k, v = got[:, h:], qkv[:, (h + hkv) * d:].view(tokens, hkv, d)
    assert torch.equal(cache[slots, 0], k.to(cache_dtype)) and torch.equal(cache[slots, 1], v.to(cache_dtype))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()


def _attend(q, cache, table, lens, block_size, h, hkv, d, first, count, prompt_from, scale=0.2, threads=2,
            run_min_rows=0):
    """kvq_decode_attention over rows first .. first + count - 1 (rows from
    prompt_from on, counted from first, as a step's prompt rows; before them,
    runs of run_min_rows rows or more across lanes, 0: none)."""
    lib = quantized.require_kernels()
    out = torch.empty(count, h * d, dtype=q.dtype)
    assert lib.kvq_decode_attention(q[first].data_ptr(), quantized.activation_type(q.dtype), q.stride(0),
                                    cache.data_ptr(), quantized.cache_type(cache.dtype), table[first].data_ptr(),
                                    table.shape[1], lens[first].data_ptr(), block_size, count, h, hkv, d, scale,
                                    out.data_ptr(), threads, prompt_from, run_min_rows) == 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_attention_rows_sharing_a_work_item_get_the_bits_they_get_alone(isa, dtype, d):
    """The kernel attends a prefill's query rows several to a work item, tile by
    tile, so the rows of one sequence share each tile's K/V reads; each row still
    does its own work on its own context, so every output equals the same row's
    attended alone (one row per call), across items spanning two sequences.
    Decode rows (one per sequence), when there are enough of them or one
    thread takes them all (a batch-1 decode step), go one row to an item
    over every KV head: those too must equal the row alone, on one item per
    head."""
    from types import SimpleNamespace

    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk

    h, hkv, block_size = 6, 2, 4
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2)).tolist()  # scattered blocks
    shapes = [(0, 203), (9, 6), (70, 1), (30, 1), (5, 1), (12, 1), (41, 1)]
    blocks = [order[:51], order[51:55], order[45:63], order[10:18], order[20:22], order[30:34], order[33:44]]
    request = SimpleNamespace(token_ids_slice=lambda start, end: [1] * (end - start))
    chunks = [ScheduledChunk(request, start, n, b, True) for (start, n), b in zip(shapes, blocks)]
    table, lens = build_step_batch(chunks, block_size, torch.device("cpu")).meta.decode_rows()
    rows = lens.numel()
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(64 * block_size, 2, hkv, d, generator=gen).to(dtype)
    q = torch.randn(rows, h * d, generator=gen).to(dtype)

    def attend(first: int, count: int, threads: int = 2) -> torch.Tensor:  # every row on the row kernel
        return _attend(q, cache, table, lens, block_size, h, hkv, d, first, count, prompt_from=count,
                       threads=threads)

    together = attend(0, rows)
    for row in range(rows):
        alone = attend(row, 1)[0]  # two threads, one row: an item per KV head
        assert torch.equal(together[row], alone), f"row {row} (context {int(lens[row])})"
        assert torch.equal(attend(row, 1, threads=1)[0], alone), f"row {row} on one thread"


LANE_ISAS = ("avx512_vnni", "amx")  # where the kernel attends runs of rows across vector lanes


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS + [(torch.float32, torch.int8)])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_runs_across_lanes_give_each_query_its_bits_alone_and_the_exact_attention(isa, dtype, cache_dtype, d):
    """A run of one sequence's rows attends across vector lanes, 16 queries
    (rows x query heads) to a vector: each query's output is the same bits
    whichever queries share its vector, its run or its step (every row
    attended again alone, on one and two threads), and is the exact attention
    (float64 over the cache's values) to float32 rounding. Runs shorter than
    run_min_rows stay on the row kernel, and run_min_rows 0 keeps every row
    there."""
    if isa not in LANE_ISAS:
        pytest.skip("the lanes need AVX-512")
    from types import SimpleNamespace

    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk

    h, hkv, block_size = 6, 2, 4
    order = torch.randperm(64, generator=torch.Generator().manual_seed(4)).tolist()  # scattered blocks
    # a 70-token prompt, a 21-token chunk after 30 cached, a 5-token chunk, two decode rows
    shapes = [(0, 70), (30, 21), (9, 5), (40, 1), (12, 1)]
    blocks = [order[:18], order[18:32], order[32:36], order[36:47], order[47:51]]
    request = SimpleNamespace(token_ids_slice=lambda start, end: [1] * (end - start))
    chunks = [ScheduledChunk(request, start, n, b, True) for (start, n), b in zip(shapes, blocks)]
    table, lens = build_step_batch(chunks, block_size, torch.device("cpu")).meta.decode_rows()
    rows = lens.numel()
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(64 * block_size, 2, hkv, d, generator=gen)
    if cache_dtype == torch.int8:  # each row its float32 scale, then D int8 values (the kernels' layout)
        scale = values.abs().amax(-1, keepdim=True) / 127
        codes = torch.round(values / scale).to(torch.int8)
        cache = torch.cat((scale.view(torch.int8).view(*scale.shape[:-1], 4), codes), dim=-1)
        values = codes.double() * scale.double()
    else:
        cache = values.to(cache_dtype)
        values = cache.double()
    q = torch.randn(rows, h * d, generator=gen).to(dtype)

    def attend(first: int, count: int, run_min_rows: int, threads: int = 2) -> torch.Tensor:
        return _attend(q, cache, table, lens, block_size, h, hkv, d, first, count, prompt_from=count,
                       threads=threads, run_min_rows=run_min_rows)

    lanes, by_rows = attend(0, rows, run_min_rows=16), attend(0, rows, run_min_rows=0)
    run_rows = 70 + 21  # the two runs of 16 rows or more
    assert not torch.equal(lanes[:run_rows], by_rows[:run_rows])  # summed in another order: the lanes ran
    assert torch.equal(lanes[run_rows:], by_rows[run_rows:])  # the 5-row chunk and the decode rows did not
    for row in range(run_rows):
        assert torch.equal(attend(row, 1, run_min_rows=1)[0], lanes[row]), f"row {row} alone"
    assert torch.equal(attend(3, 40, run_min_rows=1, threads=1), lanes[3:43])
    for row in range(rows):  # the exact attention over the cache's values
        L = int(lens[row])
        slots = torch.tensor([int(table[row, p // block_size]) * block_size + p % block_size for p in range(L)])
        k, v = values[slots, 0].transpose(0, 1), values[slots, 1].transpose(0, 1)  # [Hkv, L, D]
        qr = q[row].double().view(hkv, h // hkv, d)
        weights = torch.softmax(qr @ k.transpose(1, 2) * 0.2, dim=-1)
        expected = (weights @ v).reshape(-1)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(lanes[row].double(), expected, atol=tolerance, rtol=tolerance)


def test_a_run_whose_float32_copy_passes_64_mib_stays_on_the_row_kernel():
    """The lanes copy a run's whole context to float32 first (each KV head's
    K and V), kept as scratch: a run whose copy would pass 64 MiB stays on
    the row kernel (the same bits as run_min_rows 0); one just under it
    takes the lanes. 16 KV heads of 256 dims: 32 KiB a position."""
    if quantized.set_isa("best") not in LANE_ISAS:
        pytest.skip("the lanes need AVX-512")
    h = hkv = 16
    d, block_size, rows = 256, 16, 16
    gen = torch.Generator().manual_seed(9)
    for context, lanes_expected in ((2016, True), (2080, False)):  # 63 and 65 MiB of copy
        num_blocks = context // block_size
        cache = torch.randn(num_blocks * block_size, 2, hkv, d, generator=gen)
        table = torch.arange(num_blocks).repeat(rows, 1).contiguous()
        lens = torch.arange(context - rows + 1, context + 1)
        q = torch.randn(rows, h * d, generator=gen)

        def attend(run_min_rows: int) -> torch.Tensor:
            return _attend(q, cache, table, lens, block_size, h, hkv, d, 0, rows, prompt_from=rows,
                           run_min_rows=run_min_rows)

        assert torch.equal(attend(16), attend(0)) != lanes_expected, f"context {context}"


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_batch_invariant_keeps_runs_of_rows_off_the_lanes(monkeypatch, one_call, batch_invariant):
    """Which kernel a row attends with depends on the length of its run (a
    prompt's chunk: one chunk alone, several beside other requests), so the
    engine asks the kernels for runs across lanes only without
    batch_invariant: every attention call of a prefill, in the one-call step
    and layer by layer, gets run_min_rows LANE_MIN_ROWS, or 0."""
    from kvserve.contract import SamplingParams
    from kvserve.model import attention, llama
    from kvserve.model.attention import LANE_MIN_ROWS
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    class Recording:  # the kernels, with the last argument of each attention call noted
        def __init__(self, lib):
            self.lib, self.run_min_rows = lib, []

        def __getattr__(self, name):
            function = getattr(self.lib, name)
            if name not in ("kvq_decode_attention", "kvq_decode_layers"):
                return function

            def call(*args):
                self.run_min_rows.append(args[-1])
                return function(*args)
            return call

    recording = Recording(quantized.require_kernels())
    monkeypatch.setattr(attention, "require_kernels", lambda: recording)
    monkeypatch.setattr(llama, "require_kernels", lambda: recording)
    engine = tiny_engine(tiny_llama(seed=3), quantization="q8_0", batch_invariant=batch_invariant)
    if not one_call:
        engine.runner.model.native_decode = None
    run_to_completion(engine, random_prompts([45, 20], seed=8), SamplingParams(max_tokens=3, ignore_eos=True))
    assert recording.run_min_rows and set(recording.run_min_rows) == {0 if batch_invariant else LANE_MIN_ROWS}


# ---- --quantization at load and in the runner ------------------------------------

def _tiny_gguf(tmp_path, qtype_name: str):
    from tests.test_loader import _randomize, tiny_hf_model, write_tiny_gguf

    model = tiny_hf_model("llama")
    _randomize(model)
    path = tmp_path / f"tiny-{qtype_name}.gguf"
    write_tiny_gguf(path, model, gguf.GGMLQuantizationType[qtype_name])
    return path


def test_auto_keeps_the_files_blocks_and_none_dequantizes(tmp_path):
    from kvserve.model.loader import load_model

    path = _tiny_gguf(tmp_path, "Q4_1")
    kept = load_model(path, quantization="auto").weights
    floats = load_model(path, quantization="none").weights
    name = "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(kept[name], QuantizedWeight) and kept[name].qtype == "q4_1"
    assert isinstance(floats[name], torch.Tensor)
    assert torch.equal(kept[name].dequantize(), floats[name])  # same values, Q rows un-permuted alike


def test_unsupported_type_falls_back_to_float_with_one_log_line(tmp_path, caplog):
    from kvserve.model.loader import load_model

    path = _tiny_gguf(tmp_path, "Q5_0")
    with caplog.at_level(logging.WARNING):
        weights = load_model(path, quantization="auto").weights
    lines = [r for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert len(lines) == 1 and "Q5_0" in lines[0].getMessage()
    assert all(isinstance(w, torch.Tensor) for w in weights.values())
    # An explicit type is honoured: every matrix requantized to it.
    prepared = prepare_weights(weights, "q8_0", torch.device("cpu"))
    assert prepared["model.layers.1.mlp.down_proj.weight"].qtype == "q8_0"
    assert isinstance(prepared["model.norm.weight"], torch.Tensor)


def test_explicit_quantization_refuses_where_kernels_cannot_run(tmp_path, caplog):
    weights = {"w": QuantizedWeight.from_float("q4_1", torch.randn(8, 32))}
    with pytest.raises(KernelUnavailable, match="CPU"):
        prepare_weights(weights, "q4_1", torch.device("cuda"))
    with caplog.at_level(logging.WARNING):
        floats = prepare_weights(weights, "auto", torch.device("cuda"))
    assert isinstance(floats["w"], torch.Tensor) and "computed in float" in caplog.text
    with pytest.raises(ValueError, match="quantization must be one of"):
        prepare_weights(weights, "q3_k", torch.device("cpu"))


def test_q4_request_keeps_the_embedding_table_in_q8_0():
    weights = {"model.embed_tokens.weight": torch.randn(16, 32), "model.layers.0.mlp.up_proj.weight":
               torch.randn(8, 32), "model.norm.weight": torch.ones(32)}
    prepared = prepare_weights(weights, "q4_0", torch.device("cpu"))
    assert prepared["model.embed_tokens.weight"].qtype == "q8_0"
    assert prepared["model.layers.0.mlp.up_proj.weight"].qtype == "q4_0"


# ---- prompt positions on the bfloat16 AMX tiles ---------------------------------------

needs_prompt_tiles = pytest.mark.skipif(not quantized.prompt_tiles_available(),
                                        reason="this CPU (or Linux) gives no AMX-BF16 for the prompt tiles")


@needs_prompt_tiles
@pytest.mark.parametrize("qtype", QTYPES)
def test_prompt_tiles_compute_the_bfloat16_product_whatever_the_row_count(qtype):
    """Rows on the prompt tiles are bf16(f(x)) @ bf16(W).T summed in float32
    (a few ulps of float32 from float64), the fused norm, SwiGLU and residual
    included; and a row's bits do not depend on how many rows come with it."""
    gen = torch.Generator().manual_seed(21)
    for n, k in [(13, 32), (40, 64), (200, 96), (72, 576), (24, 1536)]:
        plain, _ = _weight(qtype, n, k, seed=n)
        weight = plain.with_prompt_tiles()
        w16 = plain.dequantize().bfloat16().double()
        m = 70
        x, add = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
        norm_w = torch.rand(k, generator=gen) + 0.5
        gate_up = torch.randn(m, 2 * k, generator=gen) * 4

        def reference(inputs: torch.Tensor) -> torch.Tensor:
            return inputs.float().bfloat16().double() @ w16.T

        normed = torch.nn.functional.rms_norm(x, (k,), norm_w, 1e-5)
        act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
        cases = [(weight.matmul(x, bf16_from=0), reference(x)),
                 (weight.matmul(x, add, norm=(norm_w, 1e-5), bf16_from=0), reference(normed) + add.double()),
                 (weight.matmul(gate_up, swiglu=True, bf16_from=0), reference(act))]
        for got, expected in cases:
            scale = float(expected.abs().max())
            # float32 sums over K terms; the norm and SwiGLU rounded to bfloat16 may land a step apart
            assert torch.allclose(got.double(), expected, rtol=2e-2, atol=2e-2 * scale), f"N={n} K={k}"
        assert (weight.matmul(x, bf16_from=0).double() - reference(x)).abs().max() <= 1e-5 * float(
            reference(x).abs().max()) + 1e-6
        full = weight.matmul(x, add, norm=(norm_w, 1e-5), bf16_from=0)
        for rows in (1, 15, 16, 17, 33):
            part = weight.matmul(x[:rows], add[:rows], norm=(norm_w, 1e-5), bf16_from=0)
            assert torch.equal(part, full[:rows]), f"N={n} K={k} rows={rows}"
        assert torch.equal(weight.matmul(x[40:41], bf16_from=0), weight.matmul(x, bf16_from=0)[40:41])


@needs_prompt_tiles
def test_prompt_tiles_take_only_the_rows_from_bf16_from():
    plain, _ = _weight("q4_1", 40, 64, seed=2)
    weight = plain.with_prompt_tiles()
    gen = torch.Generator().manual_seed(3)
    x, add = torch.randn(30, 64, generator=gen), torch.randn(30, 40, generator=gen)
    quantized_rows = plain.matmul(x, add)
    tiled_rows = weight.matmul(x, add, bf16_from=0)
    split = weight.matmul(x, add, bf16_from=12)
    assert torch.equal(split[:12], quantized_rows[:12]) and torch.equal(split[12:], tiled_rows[12:])
    assert torch.equal(weight.matmul(x, add), quantized_rows)  # no bf16_from: every row quantized
    assert torch.equal(weight.matmul(x, add, bf16_from=30), quantized_rows)
    # bfloat16 in and out, strided rows, an output slice of a wider buffer
    wide = torch.randn(30, 100, generator=gen)
    out = torch.zeros(30, 50, dtype=torch.bfloat16)
    weight.matmul(wide[:, 10:74], out=out[:, 5:45], bf16_from=7)
    expected = weight.matmul(wide[:, 10:74].contiguous(), out_dtype=torch.bfloat16, bf16_from=7)
    assert torch.equal(out[:, 5:45], expected) and not out[:, :5].any() and not out[:, 45:].any()


def _prompt_step(block_size: int, shapes: list, prompt_lens: list, blocks: list):
    """A step's rows as the runner builds them with prompt tiles: (block table,
    context lengths, bf16_rows_from), prompt positions last."""
    from types import SimpleNamespace

    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk

    chunks = [ScheduledChunk(SimpleNamespace(num_prompt_tokens=length, token_ids_slice=lambda s, e: [1] * (e - s)),
                             start, n, b, True) for (start, n), b, length in zip(shapes, blocks, prompt_lens)]
    meta = build_step_batch(chunks, block_size, torch.device("cpu"), prompt_rows_last=True).meta
    table, lens = meta.decode_rows()
    return table, lens, meta.bf16_rows_from


# A fresh 203-token prompt (seven 32-key tiles), a 6-token chunk after 9 cached
# positions, two sequences whose first blocks are one cached prefix (rows of
# different sequences side by side, each with its own later blocks), a decode
# row, and a recomputed row past its prompt (both row by row).
PROMPT_STEP = dict(shapes=[(0, 203), (9, 6), (8, 13), (8, 10), (70, 1), (22, 4)],
                   prompt_lens=[203, 15, 21, 18, 20, 24])


def _prompt_step_blocks() -> list:
    order = torch.randperm(100, generator=torch.Generator().manual_seed(2)).tolist()  # scattered blocks
    shared = order[60:62]  # two 4-slot blocks: 8 cached positions
    return [order[:51], order[51:55], shared + order[62:66], shared + order[66:69], order[69:87], order[87:94]]


@needs_prompt_tiles
@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("d, h, hkv", [(64, 9, 3), (16, 4, 2), (48, 6, 2), (128, 8, 2)])
def test_prompt_rows_attend_on_bfloat16_tiles_as_the_rounded_reference(dtype, cache_dtype, d, h, hkv):
    """Rows from prompt_from on (a step's prompt positions) attend on AMX-BF16:
    q * scale, K, V and the softmax numerators P rounded to bfloat16, sums in
    float32. Each output is that reference, computed in float64, within what
    one bfloat16 step of each P (the kernel's exp may round the other way)
    and float32 sums allow. The other rows stay on the row kernel (float32)."""
    block_size = 4
    table, lens, prompt_from = _prompt_step(block_size, blocks=_prompt_step_blocks(), **PROMPT_STEP)
    rows = int(lens.numel())
    assert 0 < prompt_from < rows - 200
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(100 * block_size, 2, hkv, d, generator=gen).to(cache_dtype)
    q = (torch.randn(rows, h * d, generator=gen) * 2).to(dtype)
    out = _attend(q, cache, table, lens, block_size, h, hkv, d, 0, rows, prompt_from).double()
    by_rows = _attend(q, cache, table, lens, block_size, h, hkv, d, 0, rows, rows).double()  # no prompt rows

    def bf16(x: torch.Tensor) -> torch.Tensor:
        return x.float().bfloat16().double()

    for r in range(rows):
        n, blocks = int(lens[r]), table[r]
        slots = torch.tensor([int(blocks[p // block_size]) * block_size + p % block_size for p in range(n)])
        k, v = cache[slots, 0].double().transpose(0, 1), cache[slots, 1].double().transpose(0, 1)  # [Hkv, n, D]
        qr = q[r].double().view(hkv, h // hkv, d)
        if r < prompt_from:
            expected = torch.softmax(qr @ k.transpose(1, 2) * 0.2, dim=-1) @ v
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2 * float(expected.abs().max())
            assert (out[r] - expected.reshape(-1)).abs().max() <= tolerance, f"row {r}"
            continue
        scores = bf16(qr.float() * 0.2) @ bf16(k).transpose(1, 2)
        p = bf16(torch.exp(scores - scores.amax(dim=-1, keepdim=True)))
        expected = (p @ bf16(v)) / p.sum(dim=-1, keepdim=True)
        slack = (p @ bf16(v).abs()) / p.sum(dim=-1, keepdim=True) * 2 ** -8 + 1e-5  # one bf16 step of a P
        if dtype == torch.bfloat16:
            slack = slack + expected.abs() * 2 ** -8  # the output's own rounding
        assert ((out[r] - expected.reshape(-1)).abs() <= slack.reshape(-1)).all(), f"row {r} (context {n})"
    assert not torch.equal(out[prompt_from:], by_rows[prompt_from:])  # they did take the tiles


@needs_prompt_tiles
def test_prompt_rows_attend_the_same_whichever_rows_share_their_tiles():
    """A prompt row's output depends on its own query, context and the cache,
    not on which rows share its 16-row tile or its call: each row alone, the
    rows in chunks of odd sizes and all rows in one call agree bit for bit
    (prefill chunks of any budget, alone or beside other requests)."""
    block_size, h, hkv, d = 4, 9, 3, 64
    table, lens, prompt_from = _prompt_step(block_size, blocks=_prompt_step_blocks(), **PROMPT_STEP)
    rows = int(lens.numel())
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(100 * block_size, 2, hkv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(rows, h * d, generator=gen)
    together = _attend(q, cache, table, lens, block_size, h, hkv, d, 0, rows, prompt_from)
    for size in (1, 7, 16, 23):
        for first in range(prompt_from, rows, size):
            count = min(size, rows - first)
            part = _attend(q, cache, table, lens, block_size, h, hkv, d, first, count, 0)
            assert torch.equal(part, together[first:first + count]), f"rows {first}..{first + count - 1}"


@needs_prompt_tiles
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_batch_invariant_tiles_keep_tokens_alone_crowded_preempted_and_in_the_one_call_step(qtype):
    """With the tiles and batch_invariant, a request's tokens and logprobs
    are the same alone or in a crowd, with or without being preempted (its
    prompt positions always on the tiles, its generated tokens, computed
    again, never: the rule is the position, not the step), and the one-call
    native step equals the layer-by-layer path. With a 48-token budget, a
    request's decode rows run alone in 1-row steps and in a crowd beside
    other prompts' chunks in steps of 36-48 rows, where the default rule
    (TILES_MIN_ROWS) puts them on the tiles: its logprobs would differ. (What the tiles
    do to the numbers: test_prompt_tiles_compute_the_bfloat16_product...;
    to the default model's tokens: test_quantized_default_model_agrees_with_the_float_path.)"""
    from kvserve.contract import SamplingParams
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    hf = tiny_llama(seed=9)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True, logprobs=0)
    prompts = random_prompts([40, 19, 36, 33], seed=15)
    # A 48-token budget: prompts go in chunks beside other requests' decodes. A float32
    # cache: num_blocks below counts its blocks.
    fields = dict(quantization=qtype, prefill_weights="bf16", batch_invariant=True, enable_prefix_caching=False,
                  max_num_batched_tokens=48, kv_cache_dtype="float32")

    def run(engine, batch: list) -> list:
        """(tokens, their logprobs) per prompt of the batch."""
        return [(o.token_ids, [lp.logprob for lp in o.logprobs])
                for o in run_to_completion(engine, batch, params).values()]

    engine = tiny_engine(hf, **fields)
    assert engine.runner.model.prompt_rows_last
    alone = [run(engine, [p])[0] for p in prompts]
    assert run(engine, prompts) == alone
    # 4 requests of 33-40 + 12 tokens need 12-13 blocks each; 26 blocks hold two.
    small = tiny_engine(hf, num_blocks=26, **fields)
    assert run(small, prompts) == alone
    assert small.scheduler.stats().num_preemptions > 0
    per_op = tiny_engine(hf, **fields)
    per_op.runner.model.native_decode = None
    splits, forward = [], per_op.runner.model.forward
    per_op.runner.model.forward = lambda ids, caches, meta, lora=None: (
        splits.append((meta.bf16_rows_from, len(ids))) or forward(ids, caches, meta, lora))
    assert run(per_op, prompts) == alone
    assert any(0 < first < num_rows for first, num_rows in splits), splits  # steps of both kinds of row


def test_tiles_take_every_row_of_a_large_step_or_by_batch_invariant_the_prompt_rows():
    """tiles_from: by default a step's size decides (every row from
    TILES_MIN_ROWS on, none under it); batch_invariant: the prompt rows,
    however few; a model without tiles (prompt_from None): none."""
    from kvserve.model.quantized import TILES_MIN_ROWS, tiles_from

    n = TILES_MIN_ROWS
    assert tiles_from(n, n) == 0  # decode rows only: all on the tiles
    assert tiles_from(n - 1, n - 1) is None
    assert tiles_from(n, 0) == 0 and tiles_from(n + 5, 3) == 0  # prompt rows with decode rows beside
    assert tiles_from(n - 1, 0) is None  # a small prompt chunk stays quantized
    assert tiles_from(4, 1, batch_invariant=True) == 1  # prompt rows 1-3, however few
    assert tiles_from(2 * n, 2 * n, batch_invariant=True) is None  # generated rows never
    assert tiles_from(2 * n, None) is None and tiles_from(2 * n, None, batch_invariant=True) is None


def test_prompt_rows_go_last_by_position_and_sampled_rows_follow():
    """build_step_batch(prompt_rows_last=True): a row is a prompt row when its
    position is inside its request's prompt, whatever the step (a preempted
    request's generated tokens computed again are not); prompt rows go last,
    each kind in chunk order, and every per-row index moves with its row."""
    from kvserve.contract import Request, SamplingParams
    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    decoding = Request("decode", [1, 2, 3], greedy, 0.0)
    decoding.output_token_ids.extend([4, 5])
    resumed = Request("resumed", [10, 11, 12, 13], greedy, 0.0)  # preempted after 3 outputs
    resumed.output_token_ids.extend([14, 15, 16])
    fresh = Request("fresh", [20, 21, 22, 23, 24], greedy, 0.0)
    chunks = [ScheduledChunk(decoding, 4, 1, [0, 1], samples=True),
              ScheduledChunk(resumed, 0, 7, [2, 3], samples=True),  # 4 prompt positions, then 3 generated
              ScheduledChunk(fresh, 0, 3, [4, 5], samples=False)]  # the first chunk of its prompt
    batch = build_step_batch(chunks, 4, torch.device("cpu"), sdpa_context=False, prompt_rows_last=True)
    order = [(5, 4), (14, 4), (15, 5), (16, 6), (10, 0), (11, 1), (12, 2), (13, 3), (20, 0), (21, 1), (22, 2)]
    assert list(zip(batch.token_ids.tolist(), batch.meta.positions.tolist())) == order
    assert batch.meta.bf16_rows_from == 4
    # Each row's context and blocks are its token's; sampled: decode's row and resumed's last (16).
    assert batch.meta.query_context_lens.tolist() == [p + 1 for _, p in order]
    assert batch.meta.query_block_table[:, 0].tolist() == [0, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4]
    assert batch.token_ids[batch.sample_rows].tolist() == [5, 16]
    plain = build_step_batch(chunks, 4, torch.device("cpu"), sdpa_context=False)
    assert plain.meta.bf16_rows_from is None and plain.token_ids[plain.sample_rows].tolist() == [5, 16]
    # The same rows, as a set, with the same slots: only their order moved.
    rows = lambda b: sorted(zip(b.token_ids.tolist(), b.meta.positions.tolist(), b.meta.slot_mapping.tolist()))
    assert rows(batch) == rows(plain)


@pytest.mark.parametrize("quantization", ["q8_0", "none"])
def test_a_bfloat16_kv_cache_holds_twice_the_tokens_and_keeps_the_model(quantization):
    """--kv-cache-dtype bfloat16 with float32 activations: twice the blocks in
    the same memory; K/V rounded to bfloat16 when written, read by the native
    kernels (quantized) or cast after SDPA's gather (float path); greedy
    tokens as with the float32 cache; the one-call step equal to the
    layer-by-layer path bit for bit."""
    from kvserve.contract import SamplingParams
    from kvserve.engine.core import EngineConfig
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    hf = tiny_llama(seed=12)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([21, 9, 33, 14], seed=3)
    wide = tiny_engine(hf, quantization=quantization, kv_cache_dtype="float32", num_blocks=None)
    half = tiny_engine(hf, quantization=quantization, kv_cache_dtype="bfloat16", num_blocks=None)
    assert half.runner.kv_cache.dtype == torch.bfloat16 and half.kv_cache_dtype == "bfloat16"
    assert wide.kv_cache_dtype == "float32"
    # One memory budget (auto: what the weights leave), twice the blocks in it.
    assert half.runner.kv_cache_memory_bytes == wide.runner.kv_cache_memory_bytes
    assert half.runner.num_blocks in (2 * wide.runner.num_blocks, 2 * wide.runner.num_blocks + 1)
    # auto: bfloat16 where the model computes on quantized weights in the native kernels, else --dtype.
    auto = tiny_engine(hf, quantization=quantization)
    assert auto.kv_cache_dtype == ("bfloat16" if auto.runner.model.native_ops else "float32")
    tokens = [o.token_ids for o in run_to_completion(half, prompts, greedy).values()]
    expected = [o.token_ids for o in run_to_completion(wide, prompts, greedy).values()]
    assert sum(a[:3] == b[:3] for a, b in zip(tokens, expected)) >= 3, (tokens, expected)
    if half.runner.model.native_decode is not None:
        per_op = tiny_engine(hf, quantization=quantization, kv_cache_dtype="bfloat16")
        per_op.runner.model.native_decode = None
        assert [o.token_ids for o in run_to_completion(per_op, prompts, greedy).values()] == tokens
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


def test_prefill_weights_refuse_what_cannot_apply():
    from kvserve.engine.core import EngineConfig
    from tests.tiny_models import tiny_engine, tiny_llama

    hf = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="not quantized"):
        tiny_engine(hf, quantization="none", prefill_weights="bf16")
    with pytest.raises(ValueError, match="prefill_weights must be one of"):
        EngineConfig(prefill_weights="fp8")
    assert not tiny_engine(hf, quantization="q8_0", prefill_weights="none").runner.model.prompt_rows_last
    # auto: the tiles where they can run, and with LoRA adapters never (their rows keep chunk order)
    auto = tiny_engine(hf, quantization="q8_0")
    assert auto.runner.model.prompt_rows_last == quantized.prompt_tiles_available()
    assert not tiny_engine(hf, quantization="q8_0", enable_lora=True).runner.model.prompt_rows_last
    if not quantized.prompt_tiles_available():
        with pytest.raises(ValueError, match="AMX-BF16"):
            tiny_engine(hf, quantization="q8_0", prefill_weights="bf16")
        return
    # auto stops at PROMPT_TILES_AUTO_MAX_BYTES of tiles (a large model's copy); bf16 takes any size.
    weights, cpu = {"w": _weight("q8_0", 8, 32, seed=1)[0]}, torch.device("cpu")
    limit = quantized.PROMPT_TILES_AUTO_MAX_BYTES
    assert quantized.wants_prompt_tiles("auto", weights, cpu, False, limit)
    assert not quantized.wants_prompt_tiles("auto", weights, cpu, False, limit + 1)
    assert quantized.wants_prompt_tiles("bf16", weights, cpu, False, limit + 1)


# ---- the quantized engine end to end -----------------------------------------------

def test_seeded_sampling_is_reproducible_across_batch_compositions():
    """batch_invariant: a seeded request's tokens and logprobs, bit for bit,
    alone and among others (a step of 69 prompt rows: the default rule puts
    such a step on the tiles where the CPU has them, and a 19-row one not)."""
    from kvserve.contract import SamplingParams
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    hf = tiny_llama(seed=3)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True, logprobs=0)
    prompt = random_prompts([19], seed=5)[0]
    others = random_prompts([7, 31, 12], seed=6)
    alone = list(run_to_completion(tiny_engine(hf, quantization="q8_0", batch_invariant=True), [prompt],
                                   params).values())[0]
    engine = tiny_engine(hf, quantization="q8_0", batch_invariant=True)
    assert isinstance(engine.runner.model.layers[0].qkv, QuantizedWeight)
    crowded = list(run_to_completion(engine, others[:2] + [prompt] + others[2:], params).values())[2]
    assert alone.token_ids == crowded.token_ids
    assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in crowded.logprobs]


@pytest.mark.parametrize("qtype, prefill_weights, batch_invariant", [
    ("q4_1", "none", False), ("q8_0", "none", False),
    pytest.param("q4_1", "bf16", False, marks=needs_prompt_tiles),
    pytest.param("q8_0", "bf16", False, marks=needs_prompt_tiles),
    pytest.param("q4_1", "bf16", True, marks=needs_prompt_tiles)])
def test_native_decode_step_is_bit_identical_to_the_layer_by_layer_path(qtype, prefill_weights, batch_invariant,
                                                                        monkeypatch):
    """Steps run all layers in one native call (kvq_decode_layers); the
    hidden states it hands the LM head equal the per-op path's exactly. With
    the tiles, the one call takes an MLP in one pass (kvq_prompt_mlp: SwiGLU
    written straight into the down projection's tiles) where the per-op path
    goes through the float32 gate_up rows: a 48-token budget gives steps of
    48 prompt rows (whole and partial 32-row tiles), steps of decode rows
    beside a prompt's chunk (on the tiles with it by default), and steps of
    11 prompt rows and a few decode rows, too few for the tiles by default
    (TILES_MIN_ROWS: the matmuls take the quantized blocks while the prompt
    rows still attend on AMX-BF16); with batch_invariant, exactly the prompt
    rows take the tiles in every step."""
    import kvserve.model.llama as llama_module
    from kvserve.contract import SamplingParams
    from kvserve.model.quantized import TILES_MIN_ROWS, tiles_from
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    splits = []  # (rows, prompt rows, first row on the tiles): each step, each layer on the per-op path

    def recorded_tiles_from(num_rows: int, prompt_from: int | None, invariant: bool = False) -> int | None:
        split = tiles_from(num_rows, prompt_from, invariant)
        splits.append((num_rows, 0 if prompt_from is None else num_rows - prompt_from, split))
        return split

    monkeypatch.setattr(llama_module, "tiles_from", recorded_tiles_from)

    hf = tiny_llama(seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([5, 13, 9, 37, 40], seed=7)
    hidden_by_path = {}
    for native in (True, False):
        engine = tiny_engine(hf, quantization=qtype, prefill_weights=prefill_weights, batch_invariant=batch_invariant,
                             max_num_batched_tokens=48)
        model = engine.runner.model
        assert model.prompt_rows_last == (prefill_weights == "bf16")
        assert model.native_decode is not None
        if not native:
            model.native_decode = None
        seen, compute_logits = [], model.compute_logits
        model.compute_logits = lambda hidden, _seen=seen, _f=compute_logits: _seen.append(hidden.clone()) or _f(hidden)
        run_to_completion(engine, prompts, params)
        hidden_by_path[native] = seen
    assert len(hidden_by_path[True]) == len(hidden_by_path[False]) > 3  # a prefill, then decode steps
    for native, per_op in zip(hidden_by_path[True], hidden_by_path[False]):
        assert torch.equal(native, per_op)
    if prefill_weights == "bf16" and not batch_invariant:
        assert all((split == 0) == (rows >= TILES_MIN_ROWS) for rows, _, split in splits)
        assert any(split == 0 and prompt_rows < rows for rows, prompt_rows, split in splits)  # decode rows too
        assert any(split is None and prompt_rows > 0 for rows, prompt_rows, split in splits)  # a small chunk
    elif prefill_weights == "bf16":
        assert all(split == (rows - prompt_rows if prompt_rows else None) for rows, prompt_rows, split in splits)
        assert any(0 < prompt_rows < rows for rows, prompt_rows, _ in splits)


def test_native_steps_build_no_sdpa_context_and_match_steps_that_do(monkeypatch):
    """A quantized CPU model attends in the native kernels, so the runner builds
    its steps without SDPA's gathered context slots and causal mask; the float
    model's steps keep them. The hidden states of the native model's steps,
    prefill and decode, are the same bits as the same step built with them."""
    import kvserve.runner.model_runner as model_runner_module
    from kvserve.contract import SamplingParams
    from kvserve.runner.step_batch import build_step_batch
    from tests.tiny_models import random_prompts, run_to_completion, tiny_engine, tiny_llama

    hf = tiny_llama(seed=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([11, 30, 6], seed=8)
    for quantization, native in (("q4_1", True), ("none", False)):
        engine = tiny_engine(hf, quantization=quantization)
        runner, model = engine.runner, engine.runner.model
        assert model.attends_natively is native
        steps, forward = [], model.forward

        def building(chunks, *args, _steps=steps, **kwargs):
            batch = build_step_batch(chunks, *args, **kwargs)
            _steps.append({"meta": batch.meta, "chunks": chunks})
            return batch

        def forward_twice(token_ids, kv_caches, meta, lora=None, _steps=steps, _forward=forward):
            out = _forward(token_ids, kv_caches, meta, lora).clone()
            # the same step again, built with SDPA's context: it rewrites the same K/V
            # (its rows in the same order: prompt rows last where the model has prompt tiles)
            full = build_step_batch(_steps[-1]["chunks"], runner.block_size, runner.device,
                                    prompt_rows_last=_steps[-1]["meta"].bf16_rows_from is not None).meta
            _steps[-1]["same"] = torch.equal(out, _forward(token_ids, kv_caches, full, lora))
            return out

        monkeypatch.setattr(model_runner_module, "build_step_batch", building)
        model.forward = forward_twice
        run_to_completion(engine, prompts, params)
        metas = [step["meta"] for step in steps]
        assert any(m.max_query_len > 1 for m in metas) and any(m.is_decode_only for m in metas)
        for step in steps:
            assert (step["meta"].context_slots is None) is native, quantization
            assert (step["meta"].attn_mask is None) or not native
            assert step["same"], f"{quantization}: a step's hidden states depend on SDPA's context being built"


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_a_verifying_step_runs_in_the_one_call_step_with_the_causal_mask(qtype):
    """A step of drafts under verification (1 + k tokens per sequence) beside a
    plain decode runs every layer in the one native call, each token a row
    whose context ends at its own position: its hidden states equal (to the
    attention kernels' rounding) those of the same tokens run as prefill
    chunks through SDPA's causal mask, which a draft seeing the drafts after
    it, or the step going layer by layer, would not pass. Prefill chunks take
    the one call too."""
    from dataclasses import replace

    from kvserve.contract import SamplingParams
    from kvserve.runner.step_batch import build_step_batch
    from kvserve.scheduler.scheduler import ScheduledChunk
    from tests.tiny_models import random_prompts, tiny_engine, tiny_llama

    engine = tiny_engine(tiny_llama(seed=4), quantization=qtype)
    runner, model = engine.runner, engine.runner.model
    calls = []
    one_call = model.native_decode
    model.native_decode = lambda *args, _f=one_call: calls.append(args[0].shape[0]) or _f(*args)  # its rows
    params = SamplingParams(max_tokens=4, temperature=0.0)
    contexts, drafts = random_prompts([9, 23, 14], seed=3), [(5, 17, 2), (), (40, 8)]
    requests = [engine.new_request(c + list(d), params) for c, d in zip(contexts, drafts)]
    blocks = [list(range(row * 10, row * 10 + 10)) for row in range(3)]  # 40 slots each, of block size 4

    def forward(chunks, per_token_rows=True):
        batch = build_step_batch(chunks, runner.block_size, runner.device)
        meta = batch.meta
        if not per_token_rows:  # no rows for the native kernels: layer by layer, SDPA's mask
            meta = replace(meta, query_block_table=None, query_context_lens=None)
        return model.forward(batch.token_ids, runner.kv_caches, meta).clone()

    forward([ScheduledChunk(r, 0, len(c) - 1, b, False) for r, c, b in zip(requests, contexts, blocks)])
    assert calls == [8 + 22 + 13]  # the prefill chunks, in one call
    verified = forward([ScheduledChunk(r, len(c) - 1, 1 + len(d), b, True, d)
                        for r, c, d, b in zip(requests, contexts, drafts, blocks)])
    assert calls == [43, 4 + 1 + 3]  # the verifying step, in one call
    as_prefill = forward([ScheduledChunk(r, len(c) - 1, 1 + len(d), b, True)
                          for r, c, d, b in zip(requests, contexts, drafts, blocks)], per_token_rows=False)
    assert calls == [43, 8]  # the reference went layer by layer (SDPA)
    torch.testing.assert_close(verified, as_prefill, atol=1e-4, rtol=1e-4)


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
                "1, 2, 3, 4,", "Water boils at", "The quick brown fox", "In machine learning, a transformer is",
                "Hello"]
# Mean share of the 16 greedy tokens before the first divergence from the float
# path, shipped Q4_1 (auto); docs/quantization.md has the measured figure (~0.8).
MIN_GREEDY_AGREEMENT = 0.5


def test_quantized_default_model_agrees_with_the_float_path():
    from kvserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for quantization in ("none", "auto"):
        llm = LLM(quantization=quantization, device="cpu", kv_cache_memory="64MiB")
        runs[quantization] = [o.token_ids for o in llm.generate(SMOL_PROMPTS, params)]
    assert isinstance(llm.engine.runner.model.lm_head, QuantizedWeight)
    agreement = [_prefix_len(a, b) / 16 for a, b in zip(runs["none"], runs["auto"])]
    assert sum(agreement) / len(agreement) >= MIN_GREEDY_AGREEMENT, agreement


def _prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_plan_reports_the_resident_bytes_of_the_quantized_and_the_float_engine(capsys):
    import json

    from kvserve import LLM
    from kvserve.cli import main
    from kvserve.model_facts.default_model import default_model_path

    assert main(["plan", "--model", str(default_model_path()), "--memory", "2GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    fallback = plan["float_fallback"]
    for quantization, planned in (("auto", plan["weight_bytes"]), ("none", fallback["weight_bytes"])):
        llm = LLM(quantization=quantization, device="cpu", kv_cache_memory="16MiB")
        assert llm.engine.runner.weight_bytes == planned, quantization
    # The bytes the quantized weights free are KV capacity: more sequences at every context.
    for ours, theirs in zip(plan["max_concurrency"], fallback["max_concurrency"]):
        assert ours["max_concurrency"] > theirs["max_concurrency"]


def test_kernels_release_the_gil():
    """The engine thread's kernels must leave the GIL to the HTTP event loop:
    while one long call runs in a thread, the main thread never waits for it.
    A call holding the GIL locks the main thread out for all of it, every
    time; a loaded machine can deschedule the main thread for tens of ms
    without any lock, so the call is long and a single calm try suffices."""
    import threading

    weight = QuantizedWeight.from_float("q4_1", torch.randn(8192, 1024))
    for rows in (1024, 2048, 4096, 8192):  # long enough on this CPU's code path
        x = torch.randn(rows, 1024)
        t0 = time.perf_counter()
        weight.matmul(x)
        call_s = time.perf_counter() - t0
        if call_s > 0.05:
            break
    assert call_s > 0.05, "the call is too short to tell"
    worst_gaps = []
    for _ in range(3):
        worker = threading.Thread(target=weight.matmul, args=(x,))
        gaps, last = [], time.perf_counter()
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            gaps.append(now - last)  # a gap as long as the call: the main thread was locked out
            last = now
        worst_gaps.append(max(gaps))
        if worst_gaps[-1] < call_s / 2:
            return
    pytest.fail(f"main thread blocked {worst_gaps} s during each {call_s:.3f} s call")
