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
    SPLIT: tl.constexpr,  # False: the whole context, normalised into out_ptr; True: a slice of it
    BLOCKS_PER_SPLIT: tl.constexpr,  # (SPLIT) the cache blocks of one slice
    part_m_ptr, part_l_ptr,  # (SPLIT) [N, H, NSPLIT] fp32 out: the slice's running max and sum
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
    j0 = 0
    if SPLIT:  # this program's slice of the context (one beyond the row's keys does nothing)
        j0 = tl.program_id(2) * BLOCKS_PER_SPLIT
        n_blocks = tl.minimum(n_blocks, j0 + BLOCKS_PER_SPLIT)
    for j in range(j0, n_blocks):
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
    if SPLIT:  # unnormalised: the combine kernel weighs the slices by their maxima
        ns = tl.num_programs(2)
        part = (t * H + heads) * ns + tl.program_id(2)  # [GROUP_P]
        tl.store(out_ptr + part[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_m_ptr + part, m, mask=gmask)
        tl.store(part_l_ptr + part, l_sum, mask=gmask)
    else:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + (t * H + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gmask[:, None])


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,  # [N * H, NSPLIT, D] fp32: each slice's unnormalised output
    part_m_ptr, part_l_ptr,  # [N * H, NSPLIT] fp32
    out_ptr,  # [N * H, D]
    nsplit,
    NSPLIT_P: tl.constexpr,  # nsplit rounded up to a power of two
    D: tl.constexpr,
):
    r = tl.program_id(0)
    sp = tl.arange(0, NSPLIT_P)
    d = tl.arange(0, D)
    ok = sp < nsplit
    m = tl.load(part_m_ptr + r * nsplit + sp, mask=ok, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + r * nsplit + sp, mask=ok, other=0.0)
    top = tl.max(m, 0)  # finite: the first slice always holds key 0
    w = tl.where(ok & (m > float("-inf")), tl.exp(m - top), 0.0)  # an empty slice weighs nothing
    acc = tl.load(part_acc_ptr + (r * nsplit + sp)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,  # [N, H, D] (rotated)
    k_cache: torch.Tensor,  # [num_blocks, Hkv, BS, D] (this step's keys already written)
    v_cache: torch.Tensor,
    seq_of: torch.Tensor,  # [N] int32
    positions: torch.Tensor,  # [N] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    *,
    split: int | None = None,  # cache blocks per slice of the context; None: split_policy's choice, 0: none
) -> torch.Tensor:  # [N, H, D]
    """Each row's causal attention over its sequence's cached keys. One program per (row, kv
    head) walks the whole context; with ``split`` the context is cut into slices of that many
    blocks, one program each (flash-decoding), and a second launch combines the slices: at a
    small batch and a long context the first leaves most of a GPU idle. The slice count
    follows the block tables' width, which is fixed for a CUDA graph's buffers."""
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
    if split is None:
        split = split_policy(N, Hkv, block_tables.shape[1], q.device)
    nsplit = -(-block_tables.shape[1] // split) if split else 1
    # on a GPU an fp32 dot defaults to TF32 (10-bit mantissa): an fp32 model would attend less
    # exactly than its torch reference; a 16-bit cache's values are exact in TF32
    common = dict(GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=D, BS=BS,
                  PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32")
    args = (q, k_cache, v_cache)
    tail = (seq_of, positions, block_tables, block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), scale)
    if nsplit <= 1:
        _paged_attention_kernel[(N, Hkv)](*args, out, *tail, **common, SPLIT=False, BLOCKS_PER_SPLIT=1,
                                          part_m_ptr=out, part_l_ptr=out)
        return out
    acc = torch.empty(N * H, nsplit, D, dtype=torch.float32, device=q.device)
    m = torch.empty(N * H, nsplit, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _paged_attention_kernel[(N, Hkv, nsplit)](*args, acc, *tail, **common, SPLIT=True, BLOCKS_PER_SPLIT=split,
                                              part_m_ptr=m, part_l_ptr=l_sum)
    _combine_splits_kernel[(N * H,)](acc, m, l_sum, out, nsplit, NSPLIT_P=triton.next_power_of_2(nsplit), D=D)
    return out


SPLIT_BLOCKS = 16  # cache blocks per slice when the context is split (256 keys at 16 a block)
_SMS: dict = {}


def split_policy(rows: int, kv_heads: int, table_blocks: int, device) -> int:
    """Blocks per slice, 0 for no split: split where one program per (row, kv head) would
    leave most of the GPU's multiprocessors idle and the block table is wide enough for four
    slices or more. ``ADAPTSPEC_ATTENTION_SPLIT``: ``auto`` (this rule; the default), ``0``
    (never), or a block count (always, slices of that many blocks). Everything it reads is
    fixed by a CUDA graph's shapes, so a captured graph keeps its choice."""
    import os

    env = os.environ.get("ADAPTSPEC_ATTENTION_SPLIT", "auto")
    if env != "auto":
        try:
            blocks = int(env)
        except ValueError:
            raise ValueError(f"ADAPTSPEC_ATTENTION_SPLIT={env!r}: expected auto, 0 or a block count") from None
        if blocks < 0:
            raise ValueError(f"ADAPTSPEC_ATTENTION_SPLIT={env!r}: expected auto, 0 or a block count")
        return blocks
    if getattr(device, "type", str(device)) != "cuda":
        return 0
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    if rows * kv_heads >= _SMS[device] or table_blocks < 4 * SPLIT_BLOCKS:
        return 0
    return SPLIT_BLOCKS


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
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("rotary_and_write: the caches must be contiguous [num_blocks, Hkv, BS, D] of one shape "
                         "(the kernel writes at offsets computed from that layout)")
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
