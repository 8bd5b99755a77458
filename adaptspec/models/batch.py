"""One step's flattened batch: what every model forward and attention backend reads.

Sequences' new tokens are laid one after another (no padding): sequence ``b`` owns rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``, at positions ``context_lens[b] ..``. A row
can be a prefill chunk, a plain decode token, or a token followed by ``k`` drafted ones to
verify; the forward does not tell them apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32: positions cached before this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (-padded with 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each row
    logits_indices: torch.Tensor  # [num_logits] int64: rows whose logits the caller wants
    # host-side copies of what loops and the C kernels need (no device reads for them)
    num_tokens: list[int]  # [num_seqs]
    context_lens_host: list[int]  # [num_seqs]
    max_ctx: int  # the longest context after this step
    block_size: int
    # on the CPU the int32 tensors above are these arrays' memory (the C kernels take them)
    host: dict | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, token_rows: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
              logits_indices: list[int], block_size: int, device: torch.device) -> "FlatBatch":
        """From per-sequence new tokens, cached lengths and block tables (host lists), with
        one host-to-device copy per tensor (none on the CPU)."""
        ids, pos, cu, ctx, bt, slot, n = host_layout(token_rows, context_lens, block_tables, block_size)
        host = {"cu": cu, "ctx": ctx, "bt": bt}
        dev = torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

        return cls(put(ids), put(pos), put(cu), put(ctx), put(bt), put(slot),
                   put(np.asarray(logits_indices, dtype=np.int64)), n.tolist(), list(context_lens),
                   int((ctx + n).max()) if len(token_rows) else 0, block_size, host)


def host_layout(token_rows: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                block_size: int) -> tuple[np.ndarray, ...]:
    """The flattened layout on the host: ``(input_ids [T] int64, positions [T] int64,
    cu_seqlens_q [B + 1] int32, context_lens [B] int32, block_tables [B, max_blocks] int32
    (0-padded), slot_mapping [T] int64, num_tokens [B] int64)``. ``FlatBatch.build`` and the
    CUDA-graph runner's padded static buffers (``models.cuda_graph``) both start from it."""
    n = np.fromiter((len(r) for r in token_rows), dtype=np.int64, count=len(token_rows))
    ctx = np.asarray(context_lens, dtype=np.int64)
    cu = np.zeros(len(token_rows) + 1, dtype=np.int32)
    np.cumsum(n, out=cu[1:])
    total = int(cu[-1])
    ids = np.fromiter((t for r in token_rows for t in r), dtype=np.int64, count=total)
    seq_of = np.repeat(np.arange(len(token_rows)), n)
    pos = ctx[seq_of] + (np.arange(total) - cu[:-1][seq_of])
    max_blocks = max((len(t) for t in block_tables), default=1) or 1
    bt = np.zeros((len(token_rows), max_blocks), dtype=np.int32)
    for b, t in enumerate(block_tables):
        bt[b, :len(t)] = t
    slot = bt[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return ids, pos, cu, ctx.astype(np.int32), bt, slot, n
