"""LoRA adapters inside the one-call decode step (csrc's kvq_decode_layers
with a kvq_lora_step) against the per-layer Python update (model/lora.LoraStep),
on a tiny quantized model: several adapters of odd ranks and partial targets,
one slot's tokens over more than one segment, beside base-model rows; the
kernel's AVX2 tiles and its portable loops alike."""

import pytest
import torch

from kvserve.contract import SamplingParams
from kvserve.model import quantized
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


@pytest.fixture(params=["simd", "portable"])
def isa(request):
    """The native update on both code paths: the CPU's best SIMD one (AVX2,
    with the AVX512-VNNI matmul where the CPU has it) and the portable C."""
    got = quantized.set_isa("portable" if request.param == "portable" else "best")
    if request.param == "simd" and got == "portable":
        quantized.set_isa("best")
        pytest.skip("this CPU has no SIMD path")
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


def decode_hidden(base, folders, native: bool, jobs=JOBS):
    """Run `jobs` (adapter name or None per request) to completion on a q4_1
    engine; the LM head's input of every decode step, and the greedy tokens."""
    engine = tiny_engine(base, quantization="q4_1", enable_lora=True, max_loras=3, max_lora_rank=24)
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
