"""Attention over the paged KV cache, behind one small interface.

``attend(layer, qkv, batch)`` takes a layer's fused q/k/v projections for the step's flat
rows, applies the rotary embedding, writes k and v into the layer's paged cache and returns
each row's causal attention over its sequence's cached keys: ``[num_tokens, H * D]``.

- ``CpuAttention``: the C kernel (``cpu_gemm.attention``), ragged natively, fp32 on the CPU.
- ``TorchAttention``: plain torch that any device runs; the tests' ground truth. It gathers
  each sequence's keys through its block table and runs SDPA on a [num_seqs, max_q] layout
  (padding exists inside this reference only).

- ``TritonAttention``: the CUDA backend, a Triton kernel over the same block tables
  (``adaptspec_kernels.triton_attention``); needs only torch and triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaptspec.models.batch import FlatBatch


class AttentionBackend:
    name = "base"
    # prepare/attend use only the batch's device tensors, with shapes fixed by the token
    # count (no host lists, no data-dependent shapes): a CUDA graph can capture them
    graph_safe = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.cos, self.sin = cos, sin  # [max_position, head_dim]

    def prepare(self, batch: FlatBatch) -> object:
        """Per-step metadata shared by every layer (built once a forward)."""
        return None

    def attend(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: FlatBatch, meta: object) -> torch.Tensor:
        raise NotImplementedError

    def rotate_and_write(self, qkv, k_cache, v_cache, slot_mapping, cos, sin) -> torch.Tensor:
        """The rotary embedding of q and k (torch), k and v written at each row's slot of the
        paged cache; returns the rotated q [N, H, D]."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        N = qkv.shape[0]
        q = qkv[:, :H * D].view(N, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].view(N, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        bs = k_cache.shape[2]
        k_cache[slot_mapping // bs, :, slot_mapping % bs] = k.to(k_cache.dtype)  # into [blocks, Hkv, bs, D]
        v_cache[slot_mapping // bs, :, slot_mapping % bs] = v.to(v_cache.dtype)
        return q


class CpuAttention(AttentionBackend):
    name = "cpu"

    def attend(self, qkv, k_cache, v_cache, batch, meta):  # qkv [N, (H + 2 Hkv) D] fp32, rotated in place
        from adaptspec.models import cpu_gemm

        h = batch.host
        return cpu_gemm.attention(qkv, torch.from_numpy(h["cu"]), torch.from_numpy(h["bt"]),
                                  torch.from_numpy(h["ctx"]), self.cos, self.sin, k_cache, v_cache,
                                  self.num_heads, batch.max_ctx)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, batch: FlatBatch):
        dev = batch.input_ids.device
        B, bs = batch.num_seqs, batch.block_size
        nq = torch.tensor(batch.num_tokens, device=dev)
        max_q = max(batch.num_tokens)
        seq_of = torch.repeat_interleave(torch.arange(B, device=dev), nq, output_size=batch.total_tokens)
        col = torch.arange(batch.total_tokens, device=dev) - batch.cu_seqlens_q.long()[seq_of]  # [N]
        key_pos = torch.arange(batch.max_ctx, device=dev)  # [ctx]
        blk = batch.block_tables.long().gather(1, (key_pos // bs)[None].expand(B, -1).clamp(
            max=batch.block_tables.shape[1] - 1))  # [B, ctx]
        q_pos = torch.full((B, max_q), -1, dtype=torch.long, device=dev)
        q_pos[seq_of, col] = batch.positions
        mask = (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, max_q, ctx]; padding rows see nothing
        mask = mask | (q_pos[:, :, None] < 0)  # ...except key 0 .. (no NaN rows); their outputs are dropped
        cos, sin = self.cos[batch.positions][:, None], self.sin[batch.positions][:, None]  # [N, 1, D]
        return seq_of, col, blk, key_pos % bs, mask[:, None], max_q, cos, sin

    def attend(self, qkv, k_cache, v_cache, batch, meta):
        seq_of, col, blk, off, mask, max_q, cos, sin = meta
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        N = qkv.shape[0]
        q = self.rotate_and_write(qkv, k_cache, v_cache, batch.slot_mapping, cos, sin)
        keys = k_cache[blk, :, off].transpose(1, 2)  # [B, Hkv, ctx, D]
        values = v_cache[blk, :, off].transpose(1, 2)
        B = batch.num_seqs
        q_pad = torch.zeros(B, max_q, H, D, dtype=q.dtype, device=q.device)
        q_pad[seq_of, col] = q
        a = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=mask, enable_gqa=Hkv != H)  # [B, H, max_q, D]
        return a.transpose(1, 2)[seq_of, col].reshape(N, H * D)


class TritonAttention(AttentionBackend):
    """Two Triton launches a layer: the rotary embedding of q and k with the cache write of k
    and v (``rotary_and_write``, the torch ops' bits), then the attention over every row of
    the step (``paged_attention``)."""

    name = "triton"
    graph_safe = True

    def prepare(self, batch: FlatBatch):
        rows = batch.input_ids.shape[0]
        cu = batch.cu_seqlens_q
        # each row's sequence from cu_seqlens alone (rows are sequences' runs in order; an empty
        # sequence repeats its cu entry), on the device: no host list, same shapes for any data
        return torch.searchsorted(cu[1:], torch.arange(rows, device=cu.device, dtype=cu.dtype), right=True,
                                  out_int32=True)  # [N] int32: the row's sequence

    def attend(self, qkv, k_cache, v_cache, batch, meta):
        from adaptspec_kernels.triton_attention import paged_attention, rotary_and_write

        H, D = self.num_heads, self.head_dim
        N = qkv.shape[0]
        q = rotary_and_write(qkv, k_cache, v_cache, batch.slot_mapping, batch.positions, self.cos, self.sin, H)
        out = paged_attention(q, k_cache, v_cache, meta, batch.positions, batch.block_tables, D ** -0.5)
        return out.reshape(N, H * D)
