"""LoRA adapters inside the one-call decode step (csrc's kvq_decode_layers
with a kvq_lora_step) against the per-layer Python update (model/lora.LoraStep),
on a tiny quantized model: several adapters of odd ranks and partial targets,
one slot's tokens over more than one segment, beside base-model rows; a
bfloat16 model, whose adapter steps leave the one call for the per-layer
update (and say so); then one fused linear's update alone (kvq_lora_apply)
on shapes the tiny model lacks (ranks, inputs and output widths off the
16-column tiles), float32 and bfloat16 activations; each on the kernel's
AVX-512 and AVX2 tiles and its portable loops."""

import ctypes
import logging

import numpy as np
import pytest
import torch

from kvserve.contract import SamplingParams
from kvserve.model import quantized
from kvserve.model.llama import input_transform
from kvserve.model.lora import LoraAdapter, _GroupStack
from tests.tiny_models import random_prompts, tiny_engine, tiny_llama, tiny_peft_adapter

STEPS = 6
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
# Odd ranks, one adapter on attention only with a per-module rank, one on the MLP only whose
# rank passes 16 (the AVX2 tiles' width: one full tile of columns, then a partial one).
ADAPTERS = {
    "r3-all": dict(r=3, lora_alpha=6),
    "r5-attention": dict(r=5, lora_alpha=5, target_modules=("q_proj", "v_proj", "o_proj"),
                         rank_pattern={"v_proj": 1}),
    "r19-mlp": dict(r=19, lora_alpha=38, target_modules=("gate_proj", "up_proj", "down_proj")),
}
# Each decode step's batch, adapters interleaved with each other and with base rows: grouped by
# slot, r3-all's 11 rows make two segments (8 + 3), the others one each.
JOBS = ["r3-all", "r5-attention", None, "r3-all", "r19-mlp", "r3-all", None, "r3-all", "r3-all", "r5-attention",
        "r3-all", "r3-all", None, "r3-all", "r3-all", None, "r3-all", "r3-all"]
# Both paths compute each product in float32, in another summation order:
ATOL = 1e-5  # measured: <= 4e-7 of the largest value
# ...but the next matmul quantizes its input to int8 per block of 32, so where
# that last-bit difference sits on a rounding boundary, one activation moves by
# one step and its row (and the row's later steps, through its K/V) differs by
# about 1% of its largest value (measured: 0.7-1.0%, one row of 18, prefill on).
QUANT_STEP_BOUND = 0.03  # of the step's largest value
MIN_EXACT_SHARE = 0.8    # of the adapter rows, within ATOL
# bfloat16 activations against float32 ones (a rounding of 2^-9 per value, and the int8 steps
# it moves), on rows whose tokens so far agree: measured <= 3.1% of the step's largest value
BFLOAT16_BOUND = 0.05


# set_isa's mode per path of the update, and the matmul path it must report: the
# update's AVX-512 (zmm) tiles go with the AVX512-VNNI matmul (csrc's lora_isa)
ISA_PATHS = {"avx512": ("avx512_vnni", "avx512_vnni"), "avx2": ("avx2", "avx2"), "portable": ("portable", "portable")}


@pytest.fixture(params=list(ISA_PATHS))
def isa(request):
    """The native update on each of its code paths, where the CPU has it."""
    mode, expected = ISA_PATHS[request.param]
    got = quantized.set_isa(mode)
    if got != expected:
        quantized.set_isa("best")
        pytest.skip(f"this CPU has no {request.param} path (set_isa({mode!r}) gives {got})")
    yield got
    quantized.set_isa("best")


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=4)


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory):
    out = {}
    for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
        out[name] = tmp_path_factory.mktemp(name)
        tiny_peft_adapter(base, out[name], seed=seed, **options)
    return out


def decode_hidden(base, folders, native: bool, jobs=JOBS, dtype: str = "float32"):
    """Run `jobs` (adapter name or None per request) to completion on a q4_1
    engine; the LM head's input of every decode step, the greedy tokens, and
    the adapter step passed to each one-call step taken."""
    engine = tiny_engine(base, quantization="q4_1", enable_lora=True, max_loras=3, max_lora_rank=24, dtype=dtype)
    model = engine.runner.model
    assert model.native_decode is not None
    if not native:
        model.native_decode = None
    ids = {name: engine.load_lora_adapter(name, str(folder)).adapter_id for name, folder in folders.items()}
    prompts = random_prompts([5 + i % 4 for i in range(len(jobs))], seed=8)  # one prefill step
    requests = [engine.new_request(p, GREEDY, adapter_id=None if j is None else ids[j]) for p, j in zip(prompts, jobs)]
    for request in requests:
        engine.add_request(request)
    seen, compute_logits = [], model.compute_logits
    model.compute_logits = lambda hidden: seen.append(hidden.clone()) or compute_logits(hidden)
    calls = []
    if native:
        decode = model.native_decode
        model.native_decode = lambda *args: calls.append(args[-1]) or decode(*args)
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o.token_ids) for o in engine.step().outputs if o.finished)
    return seen, [final[r.request_id] for r in requests], calls


def test_adapters_in_the_native_decode_step_match_the_per_layer_update(base, folders, isa):
    native, native_tokens, calls = decode_hidden(base, folders, native=True)
    per_op, per_op_tokens, _ = decode_hidden(base, folders, native=False)
    # every step (the prefill, then each decode) went through the one-call path, with the adapters in it
    assert len(calls) == STEPS and all(lora is not None for lora in calls)
    assert all(lora.num_segments == 4 for lora in calls[1:])  # a decode step's segments, as JOBS says
    assert len(native) == len(per_op) == STEPS
    base_rows = [i for i, job in enumerate(JOBS) if job is None]
    adapter_rows = [i for i, job in enumerate(JOBS) if job is not None]
    for step, (a, b) in enumerate(zip(native, per_op)):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=QUANT_STEP_BOUND * scale)
        row_error = (a - b).abs().max(dim=1).values
        exact = sum(1 for i in adapter_rows if row_error[i] <= ATOL * scale)
        assert exact >= MIN_EXACT_SHARE * len(adapter_rows), (step, row_error)
        # base-model rows: the adapters beside them change no bit
        assert torch.equal(a[base_rows], b[base_rows])
    assert native_tokens == per_op_tokens


def test_the_adapters_change_every_adapter_row_and_no_base_row(base, folders, isa):
    """The comparison above could pass with the update missing from both
    paths: the adapters' rows must differ from the base model's."""
    with_adapters, _, _ = decode_hidden(base, folders, native=True)
    base_only, _, _ = decode_hidden(base, folders, native=True, jobs=[None] * len(JOBS))
    for a, b in zip(with_adapters[1:], base_only[1:]):
        for row, job in enumerate(JOBS):
            if job is None:
                assert torch.equal(a[row], b[row])
            else:
                assert (a[row] - b[row]).abs().max() > 100 * ATOL * b.abs().max()


def test_a_base_only_step_passes_no_adapter_work_to_the_native_step(base, folders):
    _, _, calls = decode_hidden(base, folders, native=True, jobs=[None] * 4)
    assert len(calls) == STEPS and all(lora is None for lora in calls)


def test_bfloat16_slots_run_adapter_steps_layer_by_layer_say_so_and_keep_the_update(base, folders, caplog):
    """The one-call step takes adapters in float32 on the CPU only (their
    panels are packed from float32 stacks): on a bfloat16 quantized model a
    step with adapter tokens runs layer by layer instead, which the runner
    logs once at start, and the adapters still apply there."""
    with caplog.at_level(logging.WARNING, logger="kvserve.model.lora"):
        bf16, bf16_tokens, calls = decode_hidden(base, folders, native=True, dtype="bfloat16")
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvserve.model.lora"]
    assert len(warnings) == 1 and "bfloat16" in warnings[0] and "layer by layer" in warnings[0]
    assert calls == []  # every step held adapter tokens: none took the one call
    _, _, base_calls = decode_hidden(base, folders, native=True, jobs=[None] * 4, dtype="bfloat16")
    assert len(base_calls) == STEPS  # ...while a base-only step does
    float32, float32_tokens, _ = decode_hidden(base, folders, native=True)
    base_only, _, _ = decode_hidden(base, folders, native=True, jobs=[None] * len(JOBS), dtype="bfloat16")
    adapter_rows = [i for i, job in enumerate(JOBS) if job is not None]
    for step, (a, b, plain) in enumerate(zip(bf16, float32, base_only)):
        scale = b.abs().max().item()
        # the rows whose greedy tokens so far are float32's (a near tie can go the other way)
        same_so_far = [i for i in range(len(JOBS)) if bf16_tokens[i][:step] == float32_tokens[i][:step]]
        assert len(same_so_far) >= len(JOBS) // 2, step
        error = (a[same_so_far].float() - b[same_so_far]).abs().max().item()
        assert error <= BFLOAT16_BOUND * scale, (step, error / scale)
        changed = (a[adapter_rows].float() - plain[adapter_rows].float()).abs().max(dim=1).values
        assert (changed > 100 * ATOL * scale).all(), (step, changed)


# ---- one fused linear's update alone (kvq_lora_apply) -------------------------------------------

X_PLAIN, X_RMS_NORM, X_SWIGLU = 0, 1, 2  # csrc's input transforms
# Three targets whose output widths are off the 16-column tiles (40 = 2.5 tiles; 12 and 5 under
# one AVX2 vector of 8), an input width that is odd (the even/odd reduction's tail).
TARGETS = ("q_proj", "k_proj", "v_proj")
IN_FEATURES, OUT_SIZES = 37, (40, 12, 5)
MAX_RANK = 21  # the shrunk rows' stride 63: a tile's columns past a rank may not be stored
# slot -> rank per target (0: not targeted): 19 (a full tile and a tail of 3, odd), 16 (exactly
# one tile), 1, 7, 3; slots 1 and 2 each leave one target out
SLOT_RANKS = {0: (19, 16, 1), 1: (7, 0, 19), 2: (16, 3, 0)}
# Each row's slot or -1 (base): slot 0's 10 rows make a segment of 8 (the zmm tiles' most rows)
# and one of 2; slot 1 has 5, slot 2 one; base rows in between
SLOT_OF_ROW = [0, 1, -1, 0, 2, 0, 0, 1, 0, -1, 0, 1, 0, 0, 1, 0, 1, -1]


def _stack(integer_valued: bool, seed: int) -> _GroupStack:
    """A native qkv-shaped stack with SLOT_RANKS' adapters written into it."""
    dims = {t: (IN_FEATURES, n) for t, n in zip(TARGETS, OUT_SIZES)}
    stack = _GroupStack(TARGETS, dims, num_slots=len(SLOT_RANKS), max_rank=MAX_RANK, dtype=torch.float32,
                        device=torch.device("cpu"), native=True)
    generator = torch.Generator().manual_seed(seed)

    def weights(shape):
        if integer_valued:  # small integers: every product and sum exact in float32, in any order
            return torch.randint(-3, 4, shape, generator=generator).float()
        return torch.randn(shape, generator=generator) * 0.3

    for slot, ranks in SLOT_RANKS.items():
        pairs = {(0, t): (weights((r, IN_FEATURES)), weights((n, r)))
                 for t, n, r in zip(TARGETS, OUT_SIZES, ranks) if r > 0}
        stack.write(slot, 0, LoraAdapter(f"s{slot}", "", f"id{slot}", max(ranks), pairs))
    return stack


def _segments() -> tuple[np.ndarray, np.ndarray]:
    """rows sorted by slot and (slot, first, end) segments of at most 8, as LoraStep.native_step."""
    slots = np.asarray(SLOT_OF_ROW)
    rows = np.flatnonzero(slots >= 0)
    rows = rows[np.argsort(slots[rows], kind="stable")]
    segments, first = [], 0
    while first < len(rows):
        end = first
        while end < len(rows) and end - first < quantized.LORA_SEGMENT_ROWS and slots[rows[end]] == slots[rows[first]]:
            end += 1
        segments.append((slots[rows[first]], first, end))
        first = end
    return np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(segments, dtype=np.int64)


def _apply(stack: _GroupStack, x: torch.Tensor, y: torch.Tensor, xop: int, norm: torch.Tensor | None = None,
           eps: float = 1e-5, threads: int = 2) -> None:
    rows, segments = _segments()
    view = stack.native_view()
    status = quantized.require_kernels().kvq_lora_apply(
        ctypes.addressof(view), rows.ctypes.data, segments.ctypes.data, len(rows), len(segments), x.data_ptr(),
        quantized.activation_type(x.dtype), x.stride(0), xop, None if norm is None else norm.data_ptr(), eps,
        y.data_ptr(), y.stride(0), threads)
    assert status == 0


def _expected_delta(stack: _GroupStack, xt: torch.Tensor) -> torch.Tensor:
    """[rows, out] float64: each adapter row's x A B per target, from the stack's (bf16-valued) weights."""
    delta = torch.zeros((len(SLOT_OF_ROW), stack.b.shape[2]), dtype=torch.float64)
    for row, slot in enumerate(SLOT_OF_ROW):
        if slot >= 0:
            delta[row] = xt[row].double() @ stack.a[slot].double() @ stack.b[slot].double()
    return delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_on_tile_tails_is_exact_where_the_arithmetic_is(isa, dtype):
    """Integer weights and inputs: x A B is exact on every path, so y must be
    y + x A B bit for bit (float32), or its round to nearest even (bfloat16,
    the same rounding as torch's). A column missed in a tail or a rank row
    skipped changes some output; y's rows are strided with 3 columns of -0.0
    after them, which a write past the last target's columns (even of +0.0,
    what its zero padding sums to) would flip to +0.0."""
    stack = _stack(integer_valued=True, seed=1)
    generator = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (len(SLOT_OF_ROW), IN_FEATURES), generator=generator).to(dtype)
    out = sum(OUT_SIZES)
    y_rows = torch.full((len(SLOT_OF_ROW), out + 3), -0.0, dtype=dtype)
    y = y_rows[:, :out]
    # fractions under the sum's ulp at bf16: the rounding of y + delta decides the result
    y.copy_(torch.randn((len(SLOT_OF_ROW), out), generator=generator) * 3)
    expected = (y.double() + _expected_delta(stack, x)).to(dtype)
    _apply(stack, x, y, X_PLAIN)
    assert torch.equal(y, expected)
    assert torch.signbit(y_rows[:, out:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", ["rms_norm", "swiglu"])
def test_the_update_applies_the_linears_input_transform(isa, dtype, transform):
    """Random weights through the RMSNorm (qkv's, gate_up's input) and SwiGLU
    (down's) transforms, float32 or bfloat16 activations, against float64."""
    stack = _stack(integer_valued=False, seed=3)
    generator = torch.Generator().manual_seed(4)
    width = 2 * IN_FEATURES if transform == "swiglu" else IN_FEATURES
    x = torch.randn((len(SLOT_OF_ROW), width), generator=generator).to(dtype)
    norm = (1 + 0.1 * torch.randn(IN_FEATURES, generator=generator)).to(dtype)
    y = torch.randn((len(SLOT_OF_ROW), sum(OUT_SIZES)), generator=generator).to(dtype)
    before = y.clone()
    if transform == "swiglu":
        _apply(stack, x, y, X_SWIGLU)
        xt = input_transform(x.double(), None, swiglu=True)
    else:
        _apply(stack, x, y, X_RMS_NORM, norm)
        xt = input_transform(x.double(), (norm.double(), 1e-5), swiglu=False)
    delta = _expected_delta(stack, xt)
    expected = before.double() + delta
    # float32: the kernel's sums in float32 (~1e-6 of the delta); bfloat16: y's own rounding
    atol = 1e-5 * delta.abs().max().item() if dtype == torch.float32 else 0.0
    rtol = 0 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol)
    base_rows = [r for r, slot in enumerate(SLOT_OF_ROW) if slot < 0]
    assert torch.equal(y[base_rows], before[base_rows])
    assert not torch.equal(y, before)
