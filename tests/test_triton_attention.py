"""The Triton paged decode attention against a float64 reference: on a GPU
with the compiled kernel, elsewhere through Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1). Skipped where Triton is not installed (the
CPU build of torch does not bring it)."""

import os

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        # The interpreter turns loop bounds into ints from 1-element arrays,
        # which numpy 2.4 refuses (triton 3.6).
        pytest.skip("Triton's interpreter cannot run this kernel's loop with numpy >= 2.4",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is first imported

from kvserve.model.triton_attention import decode_attention, supports  # noqa: E402


def reference(q, kv_cache, slots, lens, scale):
    """softmax(q k^T * scale) v per sequence over its own context, in float64."""
    num_seqs, num_heads, _ = q.shape
    group = num_heads // kv_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(num_seqs):
        context = kv_cache[slots[b, :lens[b]].long()].double().cpu()  # [L, 2, Hkv, D]
        k = context[:, 0].repeat_interleave(group, dim=1)  # [L, H, D]
        v = context[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double().cpu(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_matches_the_reference(num_heads, num_kv_heads):
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, num_slots = 64, 1024
    lens = torch.tensor([1, 17, 64, 65, 200])
    # Context slots scattered over slots 1.., padded past each length with
    # slot 0 (never read: the kernel stops at the length).
    slots = torch.zeros(len(lens), 256, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = 1 + torch.randperm(num_slots - 1, generator=generator)[:n]
    kv_cache = torch.randn(num_slots, 2, num_kv_heads, head_dim, generator=generator)
    kv_cache[0] = float("nan")  # a read past a length would poison the output
    # q as the model passes it: a strided view of a wider projection (on the device).
    qk = torch.randn(len(lens), num_heads + num_kv_heads, head_dim, generator=generator)
    q = qk[:, :num_heads]
    to = dict(device=DEVICE)
    q_device = qk.to(**to)[:, :num_heads]
    assert not q_device.is_contiguous()
    out = decode_attention(q_device, kv_cache.to(**to), slots.to(**to), lens.to(**to), 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, kv_cache, slots, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_decode_attention_in_bfloat16_tracks_float32():
    generator = torch.Generator().manual_seed(7)
    lens = torch.tensor([33, 128])
    slots = torch.arange(2 * 128).view(2, 128)
    kv_cache = torch.randn(256, 2, 2, 64, generator=generator)
    q = torch.randn(2, 6, 64, generator=generator)
    to = dict(device=DEVICE)
    out = decode_attention(q.bfloat16().to(**to), kv_cache.bfloat16().to(**to), slots.to(**to),
                           lens.to(**to), 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), reference(q, kv_cache, slots, lens, 0.125),
                               atol=3e-2, rtol=3e-2)


def test_shapes_the_kernel_does_not_take_are_refused_not_miscomputed():
    kv_cache = torch.zeros(8, 2, 2, 96)
    slots = torch.zeros(1, 4, dtype=torch.int64)
    q = torch.zeros(1, 4, 96)
    assert not supports(q, kv_cache, slots)  # head_dim 96: not a power of two
    assert supports(torch.zeros(1, 4, 64), torch.zeros(8, 2, 2, 64), slots)
    with pytest.raises(ValueError, match="head_dim 96"):
        decode_attention(q, kv_cache, slots, torch.ones(1, dtype=torch.int64), 0.1)
