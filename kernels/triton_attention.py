"""Triton attention over the paged KV cache, for ragged flattened batches (the CUDA backend).

One program per (query row, kv head): it walks the row's sequence's keys block by block
through the block table (``[num_blocks, Hkv, BS, D]`` caches, the engine's layout) with an
online softmax, for every query head that shares the kv head (grouped-query attention), up
to the row's own position (causal). Prefill chunks, decode tokens and k + 1 verification
rows are all just rows, so one launch serves a whole step. It needs only torch and triton
(no FlashAttention or FlashInfer install): what a locked-down GPU node has. On the CPU it
runs under the Triton interpreter, which is how the tests check it against the torch
reference (``adaptspec.models.attention.TorchAttention``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [N, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, Hkv, BS, D]
    out_ptr,  # [N, H, D]
    seq_of_ptr,  # [N] int32: the row's sequence
    pos_ptr,  # [N] int64: the row's position (it sees keys 0..pos)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    stride_bt, stride_kb, stride_kh,  # block-table row; cache block and head strides
    scale,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two (>= 16 for tl.dot)
    D: tl.constexpr,
    BS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for an fp32 cache (exact fp32 products), else "tf32"
):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    seq = tl.load(seq_of_ptr + t)
    pos = tl.load(pos_ptr + t)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D)
    heads = kh * GROUP + g
    gmask = g < GROUP
    H = tl.num_programs(1) * GROUP
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    q = (q.to(tl.float32) * scale)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    s_off = tl.arange(0, BS)
    n_blocks = pos // BS + 1
    for j in range(0, n_blocks):
        blk = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        base = blk * stride_kb + kh * stride_kh
        k = tl.load(k_cache_ptr + base + s_off[:, None] * D + d[None, :]).to(tl.float32)  # [BS, D]
        v = tl.load(v_cache_ptr + base + s_off[:, None] * D + d[None, :]).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [GROUP_P, BS]
        key_pos = j * BS + s_off
        scores = tl.where((key_pos <= pos)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + (t * H + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None])


def paged_attention(
    q: torch.Tensor,  # [N, H, D] (rotated)
    k_cache: torch.Tensor,  # [num_blocks, Hkv, BS, D] (this step's keys already written)
    v_cache: torch.Tensor,
    seq_of: torch.Tensor,  # [N] int32
    positions: torch.Tensor,  # [N] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
) -> torch.Tensor:  # [N, H, D]
    N, H, D = q.shape
    _, Hkv, BS, Dk = k_cache.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"paged_attention: q heads {H} x {D} against a cache of {Hkv} x {Dk}")
    if D & (D - 1) or BS & (BS - 1) or BS < 16:
        raise ValueError(f"paged_attention: head_dim ({D}) and block size ({BS}) must be powers of two, block >= 16")
    group = H // Hkv
    out = torch.empty_like(q)
    if N == 0:
        return out
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.contiguous()
    _paged_attention_kernel[(N, Hkv)](
        q, k_cache, v_cache, out, seq_of, positions, block_tables,
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), scale,
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=D, BS=BS,
        # on a GPU an fp32 dot defaults to TF32 (10-bit mantissa): an fp32 model would attend
        # less exactly than its torch reference; a 16-bit cache's values are exact in TF32
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32")
    return out


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded to the dtype torch computes in (to nearest, ties to even), kept in
    fp32. bf16 by its bits: the Triton interpreter (the CPU tests) truncates in ``.to``."""
    if ROUND == 1:  # bfloat16
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    elif ROUND == 2:  # float16
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rotary_write_kernel(
    qkv_ptr,  # [N, (H + 2 Hkv) D]: the step's fused projections
    q_out_ptr,  # [N, H, D] out: the rotated queries
    k_cache_ptr, v_cache_ptr,  # [num_blocks, Hkv, BS, D]
    slot_ptr,  # [N] int64: the row's cache slot (block * BS + offset)
    pos_ptr,  # [N] int64: the row's position (its rotary angle)
    cos_ptr, sin_ptr,  # [max_position, D], the halves repeated (the model's tables)
    stride_qkv, stride_cos, stride_kb, stride_kh,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr,
    ROUND: tl.constexpr,  # the dtype torch computes in: 0 float32, 1 bfloat16, 2 float16
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..H-1: a query head; H..H+Hkv-1: a key head; then a value head
    j = tl.arange(0, HALF)
    src = qkv_ptr + t * stride_qkv + h * D
    x1 = tl.load(src + j).to(tl.float32)  # 16-bit values are exact in fp32, their products too
    x2 = tl.load(src + HALF + j).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk, off = slot // BS, slot % BS
    if h < H + HKV:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * stride_cos + j).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * stride_cos + HALF + j).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * stride_cos + j).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * stride_cos + HALF + j).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded where torch rounds (each product, then the
        # sum): the torch backend's bits, with no fused multiply-add (the launch turns fp
        # fusion off); the stores below then only drop bits that are already zero
        o1 = _round(_round(x1 * c1, ROUND) + _round(-x2 * s1, ROUND), ROUND)
        o2 = _round(_round(x2 * c2, ROUND) + _round(x1 * s2, ROUND), ROUND)
        if h < H:
            dst = q_out_ptr + (t * H + h) * D
            tl.store(dst + j, o1.to(q_out_ptr.dtype.element_ty))
            tl.store(dst + HALF + j, o2.to(q_out_ptr.dtype.element_ty))
        else:
            dst = k_cache_ptr + blk * stride_kb + (h - H) * stride_kh + off * D
            tl.store(dst + j, o1.to(k_cache_ptr.dtype.element_ty))
            tl.store(dst + HALF + j, o2.to(k_cache_ptr.dtype.element_ty))
    else:
        dst = v_cache_ptr + blk * stride_kb + (h - H - HKV) * stride_kh + off * D
        tl.store(dst + j, x1.to(v_cache_ptr.dtype.element_ty))
        tl.store(dst + HALF + j, x2.to(v_cache_ptr.dtype.element_ty))


_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def rotary_and_write(
    qkv: torch.Tensor,  # [N, (H + 2 Hkv) D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, BS, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64
    cos: torch.Tensor,  # [max_position, D]
    sin: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:  # [N, H, D] rotated queries, in cos's dtype (as the torch ops give)
    """The rotary embedding of q and k and the cache write of k and v, in one launch: what
    ``AttentionBackend.rotate_and_write`` does in a dozen element-wise torch ops a layer
    (each a kernel launch), bit for bit."""
    N, width = qkv.shape
    _, Hkv, BS, D = k_cache.shape
    if width != (num_heads + 2 * Hkv) * D or D & (D - 1) or D < 2:
        raise ValueError(f"rotary_and_write: qkv width {width} against {num_heads} + 2 x {Hkv} heads of {D} "
                         "(head_dim a power of two)")
    if cos.shape[1] != D or sin.shape != cos.shape:
        raise ValueError(f"rotary_and_write: rotary tables {tuple(cos.shape)} / {tuple(sin.shape)}, head_dim {D}")
    q = torch.empty(N, num_heads, D, dtype=torch.promote_types(qkv.dtype, cos.dtype), device=qkv.device)
    if q.dtype not in _ROUND:
        raise ValueError(f"rotary_and_write: {q.dtype} is not float32, bfloat16 or float16")
    if N == 0:
        return q
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    _rotary_write_kernel[(N, num_heads + 2 * Hkv)](
        qkv, q, k_cache, v_cache, slot_mapping, positions, cos, sin,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
        H=num_heads, HKV=Hkv, D=D, HALF=D // 2, BS=BS, ROUND=_ROUND[q.dtype], enable_fp_fusion=False)
    return q
