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
        scores = tl.dot(q, tl.trans(k))  # [GROUP_P, BS]
        key_pos = j * BS + s_off
        scores = tl.where((key_pos <= pos)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
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
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=D, BS=BS)
    return out
