"""Logits to sampling distributions, and sampling by inverse CDF from given uniforms.

Temperature, top-k and top-p are applied row by row with per-row parameters, the same
way to the target's and the draft's logits (exactness needs both processed alike).
Sampling takes its uniform draws as input so that the pure-torch path and a fused
kernel given the same draws produce the same tokens.
"""
from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1).tolist()`` for [num_rows, vocab] logits, the same indices (first
    maximum; a NaN counts as the maximum, as in torch), through numpy for fp32 logits on the
    CPU: torch's CPU argmax took 43 / 126 / 1,315 us for 1 / 5 / 64 rows of SmolLM2's 49,152
    logits and numpy's 4 / 18 / 205 on the project's 2-core machine, i.e. 40 us of every
    plain decoding step and 1.1 ms of a 64-request one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float, > 0
    top_k: torch.Tensor | None,  # [num_rows] int, 0 = no cut; None: no row cuts
    top_p: torch.Tensor | None,  # [num_rows] float in (0, 1]; None: no row cuts
    *,
    max_top_k: int | None = None,  # host-known largest top_k of the rows (0: none cuts)
    any_top_p: bool | None = None,  # host-known: does any row cut by top_p
) -> torch.Tensor:  # [num_rows, vocab_size] float32, rows sum to 1
    """``max_top_k`` / ``any_top_p``: what the caller knows on the host. Given, the cuts read
    nothing back from the device (on CUDA every such read waits for all queued work: a sync
    in the middle of a step); None: read from the tensors. Rows without a top-k cut take no
    part in the top-k pass, so a batch that mixes cut and uncut rows needs ``max_top_k``
    values per row, not a sort of the whole vocabulary."""
    logits = logits.float() / temperature[:, None]
    if top_k is not None:
        kmax = int(top_k.max()) if max_top_k is None else int(max_top_k)
        kmax = min(kmax, logits.shape[-1])
        if kmax > 0:
            vals = torch.topk(logits, kmax, dim=-1).values  # [num_rows, kmax], descending
            kth = vals.gather(1, (top_k.clamp(min=1, max=kmax) - 1).long()[:, None])  # [num_rows, 1]
            kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and (bool((top_p < 1.0).any()) if any_top_p is None else any_top_p):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly ahead of each token
        drop_sorted = before >= top_p[:, None]  # keeps the smallest prefix reaching top_p (>= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(
    probs: torch.Tensor,  # [num_rows, vocab_size], non-negative, rows need not be normalised
    uniform: torch.Tensor,  # [num_rows] in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds ``u * total``."""
    cdf = probs.float().cumsum(-1)
    thresh = uniform.float()[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, thresh, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)
