"""CUDA graphs of a model's forward, one per token-count bucket: the target's decode and
verification steps, and the drafting passes of a draft model or a draft head.

A flattened step's shape is its token count, so a graph captured for ``N`` rows serves every
step of ``N`` rows or fewer: the step is padded up to its bucket. Everything a graph reads
sits in static buffers sized for the largest bucket and filled before each replay (one
host-to-device copy per buffer):

- int64 ``[4, max_tokens]``: input ids, positions, slot mapping, logits row indices;
- int32 ``cu_seqlens_q [max_seqs + 2]``, ``context_lens [max_seqs + 1]``, ``block_tables
  [max_seqs + 1, max_blocks_per_seq]``;
- with ``input_width``, a float ``[max_tokens, input_width]`` of per-row inputs (a draft
  head's features or fed-back outputs), filled by a device-to-device copy.

Padding rows (``T .. N - 1`` for a step of ``T`` real rows) form one extra sequence whose
block table is all ``pad_block``: a KV block the engine allocates in every model but never
hands out, so whatever the padding rows write lands there, and what they attend to is
there; their logits and hidden states are sliced off. Rows never see each other's keys
except through their own sequence's block table, so padding leaves the real rows' results
unchanged (on the CPU bitwise: the padded path is tested against the unpadded one).

With ``capture=False`` the same padded static-buffer path runs the model eagerly, without
a graph: what the CPU tests check (``EngineConfig.cuda_graphs=True`` on the CPU). What a
graph runs is ``step_fn(batch, inputs)`` (by default the model's own forward); the
attention backend under capture must be ``graph_safe`` (``models.attention``): the Triton
paged attention, whose grid depends on the bucket only.

Capture follows torch's documented recipe: warm-up runs on a side stream (Triton compiles,
cuBLAS picks its kernels) before ``torch.cuda.graph``; the largest bucket is captured first,
every other graph shares its memory pool and copies its logits and hidden states into the
largest one's outputs (so the outputs take ``max_tokens`` rows once, not once per bucket).
A graph's outputs are only valid until the next replay of any of its runner's graphs:
callers consume (or copy) them before that. Each model has its own runner, pool and buffers.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from adaptspec.models.batch import FlatBatch, host_layout

log = logging.getLogger("adaptspec.models.cuda_graph")

DEFAULT_MAX_TOKENS = 512


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The captured token counts up to ``max_tokens`` (always included): 1, 2, 4, 8, every 8
    up to 64, then every 32. Decode at batch b and verification of b requests with k
    candidates ((k + 1) b rows) pad by at most 7 rows up to 64 and 31 past it."""
    if max_tokens < 1:
        raise ValueError(f"cuda_graph_max_tokens must be >= 1, got {max_tokens}")
    steps = [1, 2, 4, *range(8, 65, 8), *range(96, max_tokens + 1, 32)]
    return tuple(sorted({n for n in steps if n < max_tokens} | {max_tokens}))


class GraphRunner:
    """Runs a ``LlamaModel``'s forward for steps of up to ``max(buckets)`` rows from static
    buffers, replaying the bucket's CUDA graph (``capture=True``) or running the padded
    batch eagerly (``capture=False``).

    ``step_fn(batch, inputs) -> (logits | None, hidden)`` replaces the model's forward where a
    caller wraps it (a draft head: its own input layer around the decoder, ``model`` being
    that decoder, whose KV pool and attention the batch addresses); ``inputs`` is then the
    ``[N, input_width]`` view of the static input buffer, None without one."""

    def __init__(self, model, *, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, pad_block: int,
                 feature_layers: tuple[int, ...] = (), capture: bool = True,
                 buckets: tuple[int, ...] | None = None, step_fn=None, input_width: int = 0,
                 input_dtype: torch.dtype | None = None, name: str = "target"):
        if capture and model.device.type != "cuda":
            raise ValueError("cuda_graphs: capturing needs a CUDA device (capture=False runs the padded path)")
        if capture and not getattr(model.attn, "graph_safe", False):
            raise ValueError(f"cuda_graphs: the {model.attn.name!r} attention backend cannot be captured "
                             "(the Triton backend can: install triton)")
        if not 0 <= pad_block < model.num_blocks:
            raise ValueError(f"pad_block {pad_block} is outside the model's {model.num_blocks} KV blocks")
        self.model, self.pad_block, self.capture, self.name = model, pad_block, capture, name
        self.feature_layers = tuple(feature_layers)
        self.step_fn = step_fn or self._model_forward
        self.buckets = tuple(sorted(buckets)) if buckets else token_buckets(max_tokens)
        self.max_tokens, self.max_seqs, self.width = self.buckets[-1], max_seqs, max_blocks_per_seq
        self.block_size = model.block_size
        dev = model.device
        T, S, W = self.max_tokens, max_seqs, max_blocks_per_seq
        self._n32 = (S + 2) + (S + 1) + (S + 1) * W  # cu_seqlens | context_lens | block_tables
        pin = dev.type == "cuda"  # pinned staging: the copies are plain DMA, no staging by the driver
        self._t64 = torch.zeros(4 * T, dtype=torch.int64, pin_memory=pin)
        self._t32 = torch.zeros(self._n32, dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self._t64.numpy(), self._t32.numpy()
        self._d64 = torch.zeros(4 * T, dtype=torch.int64, device=dev)
        self._d32 = torch.zeros(self._n32, dtype=torch.int32, device=dev)
        # per-row float inputs (a head's features): padding rows keep whatever is there (finite:
        # earlier rows' inputs, or zeros), since their outputs are dropped
        self._x = (torch.zeros(T, input_width, dtype=input_dtype or model.compute_dtype, device=dev)
                   if input_width else None)
        # the staging buffers are rewritten only once the previous copy out of them has run
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple] = {}
        self.graph_bytes = 0  # device memory the captured graphs hold (pool, outputs, executables)
        if capture:
            self._capture()

    # ---- which steps --------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens`` rows (None: above the largest)."""
        if num_tokens < 1 or num_tokens > self.max_tokens:
            return None
        return next(b for b in self.buckets if b >= num_tokens)

    def fits(self, num_tokens: int, num_seqs: int, max_table_len: int) -> bool:
        return (self.bucket(num_tokens) is not None and num_seqs <= self.max_seqs
                and max_table_len <= self.width)

    # ---- the step -----------------------------------------------------------------------
    def forward(self, token_rows: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                logits_indices: list[int], inputs: torch.Tensor | None = None  # [num_tokens, input_width]
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``LlamaModel.forward`` (or ``step_fn``) for one step given as ``FlatBatch.build``'s
        host lists: ``(logits [len(logits_indices), vocab], hidden [num_tokens, ...])``, views
        of the bucket's outputs, valid until the next call."""
        if (inputs is None) != (self._x is None):
            raise ValueError(f"{self.name} graphs: inputs are needed exactly when the runner has an input "
                             f"buffer (input_width {0 if self._x is None else self._x.shape[1]})")
        ids, pos, cu, ctx, bt, slot, n = host_layout(token_rows, context_lens, block_tables, self.block_size)
        T, B, L = len(ids), len(token_rows), len(logits_indices)
        N = self.bucket(T)
        if N is None or not self.fits(T, B, bt.shape[1]):
            raise ValueError(f"step of {T} tokens, {B} sequences, {bt.shape[1]} blocks is past the graphs' "
                             f"buckets (<= {self.max_tokens} tokens, {self.max_seqs} sequences, {self.width} blocks)")
        max_ctx = int((ctx + n).max())
        if max_ctx > self.model.cfg.max_position:
            raise ValueError(f"context of {max_ctx} tokens exceeds the model's {self.model.cfg.max_position} positions")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy ran long ago (its transfer waited on it)
        self._stage(N, ids, pos, slot, logits_indices, cu, ctx, bt)
        self._upload(B)
        if inputs is not None:
            self._put_inputs(inputs)
        if self.capture:
            self.graphs[N].replay()
            logits, hidden = self._outputs[N]
        else:
            batch = self._batch(N, n.tolist() + [N - T], list(context_lens) + [0], max(max_ctx, N - T, 1))
            logits, hidden = self._run(batch, N)
        return (logits[:L] if logits is not None else None), hidden[:T]

    def _model_forward(self, batch: FlatBatch, inputs: torch.Tensor | None):
        return self.model.forward(batch, feature_layers=self.feature_layers)

    def _run(self, batch: FlatBatch, N: int):
        return self.step_fn(batch, None if self._x is None else self._x[:N])

    def _put_inputs(self, inputs: torch.Tensor) -> None:  # [T, input_width], on the device
        """The step's per-row inputs into the static buffer: a device-to-device copy queued
        before the replay (no host read)."""
        if inputs.shape[1:] != self._x.shape[1:]:
            raise ValueError(f"{self.name} graphs: inputs of width {tuple(inputs.shape[1:])}, the buffer holds "
                             f"{tuple(self._x.shape[1:])}")
        self._x[:inputs.shape[0]].copy_(inputs)

    def _stage(self, N, ids, pos, slot, logits_indices, cu, ctx, bt) -> None:
        """The step, padded to ``N`` rows, into the host staging buffers."""
        T, B, S, W = len(ids), len(cu) - 1, self.max_seqs, self.width
        M = self.max_tokens
        h64, h32 = self._h64, self._h32
        h64[0:T], h64[T:N] = ids, 0
        h64[M:M + T], h64[M + T:M + N] = pos, 0  # padding rows at position 0: one key each
        h64[2 * M:2 * M + T], h64[2 * M + T:2 * M + N] = slot, self.pad_block * self.block_size
        L = len(logits_indices)
        h64[3 * M:3 * M + L], h64[3 * M + L:3 * M + N] = logits_indices, 0  # row 0: in range for every bucket
        h32[0:B + 1], h32[B + 1:S + 2] = cu, N  # the padding rows: sequence B; any later ones are empty
        c0 = S + 2
        h32[c0:c0 + B], h32[c0 + B:c0 + S + 1] = ctx, 0
        tables = h32[2 * S + 3:].reshape(S + 1, W)
        tables[:B, :bt.shape[1]] = bt  # entries past a table are never read (a row reads up to its position)
        tables[B, :-(-N // self.block_size)] = self.pad_block  # as far as any padding row could read

    def _upload(self, num_seqs: int) -> None:
        """The staged step into the device buffers (the rows' tables up to sequence B only)."""
        n32 = 2 * self.max_seqs + 3 + (num_seqs + 1) * self.width
        self._d64.copy_(self._t64, non_blocking=True)
        self._d32[:n32].copy_(self._t32[:n32], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _batch(self, N: int, num_tokens: list[int], context_lens: list[int], max_ctx: int) -> FlatBatch:
        """The ``N``-row views of the device buffers as a FlatBatch (host fields for the
        eager path's CPU kernels; a captured graph reads the device tensors only)."""
        M, S, W = self.max_tokens, self.max_seqs, self.width
        d64, d32, h32 = self._d64, self._d32, self._h32
        host = {"cu": h32[0:S + 2], "ctx": h32[S + 2:2 * S + 3], "bt": h32[2 * S + 3:].reshape(S + 1, W)}
        pad = (S + 1) - len(num_tokens)
        return FlatBatch(d64[0:N], d64[M:M + N], d32[0:S + 2], d32[S + 2:2 * S + 3],
                         d32[2 * S + 3:].view(S + 1, W), d64[2 * M:2 * M + N], d64[3 * M:3 * M + N],
                         num_tokens + [0] * pad, context_lens + [0] * pad, max_ctx, self.block_size, host)

    # ---- capture ------------------------------------------------------------------------
    @torch.inference_mode()  # the outputs are inference tensors: the smaller graphs write into them
    def _capture(self) -> None:
        dev = self.model.device
        # an all-padding step: every row writes and reads the pad block only
        self._stage(self.max_tokens, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [],
                    np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32))
        self._upload(self.max_seqs)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(dev)[0]
        batches = {N: self._batch(N, [N], [0], 1) for N in self.buckets}
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks kernels
            for N in reversed(self.buckets):
                for _ in range(2):
                    self._run(batches[N], N)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        pool, shared = None, None
        for N in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool's blocks
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._run(batches[N], N)
                if shared is not None:  # into the largest graph's outputs: one [max_tokens, vocab] in all
                    out = tuple(buf[:N].copy_(x) for buf, x in zip(shared, out))
            pool = g.pool() if pool is None else pool
            shared = out if shared is None else shared
            self.graphs[N], self._outputs[N] = g, out
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(dev)[0])
        log.info("captured %d CUDA graphs of the %s (%d..%d tokens), %.1f MiB", len(self.graphs), self.name,
                 self.buckets[0], self.max_tokens, self.graph_bytes / 2**20)

    def release(self) -> None:
        """Drop the graphs and their memory (before the KV pool is resized)."""
        self.graphs.clear()
        self._outputs.clear()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
            torch.cuda.empty_cache()
