"""The Triton paged-attention kernel (the CUDA backend) against the torch reference backend,
under the Triton interpreter on the CPU (compiled on a GPU, where every tensor is on it)."""
from __future__ import annotations

import random

import pytest
import torch

from adaptspec_kernels.testing import load_kernels_or_skip

_, DEVICE = load_kernels_or_skip()
from adaptspec_kernels.triton_attention import (  # noqa: E402  (after the interpreter is chosen)
    paged_attention, rotary_and_write, split_policy,
)

from adaptspec.models.attention import TorchAttention, TritonAttention  # noqa: E402
from adaptspec.models.batch import FlatBatch  # noqa: E402


def _setup(H=4, Hkv=2, D=16, BS=16, ctx=(0, 37, 5), rows=(9, 1, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = 16
    ids = list(range(nb))
    random.Random(seed).shuffle(ids)  # no sequence's blocks are contiguous
    tables = [ids[0:5], ids[5:10], ids[10:15]]
    tokens = [torch.randint(0, 50, (n,), generator=g).tolist() for n in rows]
    batch = FlatBatch.build(tokens, list(ctx), tables, [], BS, DEVICE)
    kc = torch.randn(nb, Hkv, BS, D, generator=g).to(DEVICE)
    vc = torch.randn(nb, Hkv, BS, D, generator=g).to(DEVICE)
    qkv = torch.randn(batch.total_tokens, (H + 2 * Hkv) * D, generator=g).to(DEVICE)
    pos = torch.arange(64, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1, D // 2)[None, :]
    emb = torch.cat([pos, pos], -1).to(DEVICE)
    return batch, kc, vc, qkv, emb.cos(), emb.sin(), (H, Hkv, D)


@pytest.mark.parametrize("heads", [(4, 2, 16), (4, 4, 32), (6, 2, 16)])
def test_triton_backend_matches_the_torch_reference(heads):
    """A prompt chunk over an empty context, a decode token over 37 cached keys and a 5-token
    verification row over 5, through shuffled blocks: outputs and the written caches agree."""
    H, Hkv, D = heads
    batch, kc, vc, qkv, cos, sin, _ = _setup(H, Hkv, D)
    ref, tri = TorchAttention(H, Hkv, D, cos, sin), TritonAttention(H, Hkv, D, cos, sin)
    kc2, vc2 = kc.clone(), vc.clone()
    want = ref.attend(qkv.clone(), kc, vc, batch, ref.prepare(batch))
    got = tri.attend(qkv.clone(), kc2, vc2, batch, tri.prepare(batch))
    assert torch.allclose(kc, kc2) and torch.allclose(vc, vc2)
    assert (got - want).abs().max() <= 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 32)])
def test_fused_rotary_and_cache_write_are_the_torch_ops_bit_for_bit(heads, dtype):
    """The one-launch rotary + cache write against ``rotate_and_write`` (a dozen torch ops):
    the same rotated queries and the same caches, bit for bit, in fp32 and bf16 (the torch
    ops round each product and the sum; a fused multiply-add would not)."""
    H, Hkv, D = heads
    batch, kc, vc, qkv, cos, sin, _ = _setup(H, Hkv, D)
    kc, vc, qkv, cos, sin = (x.to(dtype) for x in (kc, vc, qkv, cos, sin))
    ref = TorchAttention(H, Hkv, D, cos, sin)
    kc2, vc2 = kc.clone(), vc.clone()
    c, s = cos[batch.positions][:, None], sin[batch.positions][:, None]
    want = ref.rotate_and_write(qkv, kc, vc, batch.slot_mapping, c, s)
    got = rotary_and_write(qkv, kc2, vc2, batch.slot_mapping, batch.positions, cos, sin, H)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # the control: one row's position off by one moves its rotated q (the check can fail)
    off = batch.positions.clone()
    off[-1] += 1
    moved = rotary_and_write(qkv, kc2.clone(), vc2.clone(), batch.slot_mapping, off, cos, sin, H)
    assert not torch.equal(moved[-1], want[-1]) and torch.equal(moved[:-1], want[:-1])


def test_fused_rotary_refuses_mismatched_shapes():
    batch, kc, vc, qkv, cos, sin, (H, Hkv, D) = _setup()
    with pytest.raises(ValueError, match="qkv width"):
        rotary_and_write(qkv[:, :-1], kc, vc, batch.slot_mapping, batch.positions, cos, sin, H)
    with pytest.raises(ValueError, match="rotary tables"):
        rotary_and_write(qkv, kc, vc, batch.slot_mapping, batch.positions, cos[:, :-2], sin, H)
    with pytest.raises(ValueError, match="contiguous"):
        rotary_and_write(qkv, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, batch.slot_mapping, batch.positions,
                         cos, sin, H)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 16)])
def test_a_context_split_into_slices_gives_the_reference(heads, split):
    """Flash-decoding: the context cut into slices of ``split`` blocks, one program each, and
    the slices combined by their maxima. Rows whose context ends before a slice leave it
    empty (weight 0); the result is the torch reference's."""
    H, Hkv, D = heads
    batch, kc, vc, qkv, cos, sin, _ = _setup(H, Hkv, D)
    ref, tri = TorchAttention(H, Hkv, D, cos, sin), TritonAttention(H, Hkv, D, cos, sin)
    want = ref.attend(qkv.clone(), kc.clone(), vc.clone(), batch, ref.prepare(batch))
    kc2, vc2 = kc.clone(), vc.clone()
    q = rotary_and_write(qkv.clone(), kc2, vc2, batch.slot_mapping, batch.positions, cos, sin, H)
    seq_of = tri.prepare(batch)
    got = paged_attention(q, kc2, vc2, seq_of, batch.positions, batch.block_tables, D ** -0.5, split=split)
    whole = paged_attention(q, kc2, vc2, seq_of, batch.positions, batch.block_tables, D ** -0.5, split=0)
    assert (got.reshape(want.shape) - want).abs().max() <= 2e-5
    assert (got - whole).abs().max() <= 2e-5
    # the control: a slice combined with the wrong weight (its sum doubled) is caught
    wrong = got.clone()
    wrong[1] = got[1] * 0.5
    assert (wrong.reshape(want.shape) - want).abs().max() > 1e-3


def test_the_split_policy(monkeypatch):
    monkeypatch.delenv("ADAPTSPEC_ATTENTION_SPLIT", raising=False)
    assert split_policy(1, 8, 256, torch.device("cpu")) == 0  # auto: the CPU never splits
    monkeypatch.setenv("ADAPTSPEC_ATTENTION_SPLIT", "8")
    assert split_policy(64, 8, 4, torch.device("cpu")) == 8  # forced
    monkeypatch.setenv("ADAPTSPEC_ATTENTION_SPLIT", "0")
    assert split_policy(1, 8, 256, torch.device("cpu")) == 0
    for bad in ("often", "-2"):
        monkeypatch.setenv("ADAPTSPEC_ATTENTION_SPLIT", bad)
        with pytest.raises(ValueError, match="ADAPTSPEC_ATTENTION_SPLIT"):
            split_policy(1, 8, 256, torch.device("cpu"))


def test_the_comparison_can_fail():
    """Attending one key short (a position off by one) is caught by the same tolerance."""
    batch, kc, vc, qkv, cos, sin, (H, Hkv, D) = _setup()
    tri = TritonAttention(H, Hkv, D, cos, sin)
    seq_of = tri.prepare(batch)
    q = qkv[:, :H * D].view(-1, H, D)
    good = paged_attention(q, kc, vc, seq_of, batch.positions, batch.block_tables, D ** -0.5)
    short = paged_attention(q, kc, vc, seq_of, (batch.positions - 1).clamp(min=0), batch.block_tables, D ** -0.5)
    assert (good[1:] - short[1:]).abs().max() > 1e-3


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 4, 12, device=DEVICE)
    kc = torch.zeros(2, 2, 16, 12, device=DEVICE)
    with pytest.raises(ValueError, match="powers of two"):
        paged_attention(q, kc, kc, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                        torch.zeros(1, 2, dtype=torch.int32), 1.0)
