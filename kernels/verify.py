"""Host entry points for the Triton verification kernels.

Same inputs and outputs as ``adaptspec.engine.verifier.verify_greedy`` /
``verify_stochastic`` (returned as a plain ``(output_token_ids, num_accepted)`` pair, so
this package does not depend on the engine's types), plus:

* ``max_num_draft_tokens``: the batch's largest ``k``. The engine knows it on the host (it
  chose the arms); when omitted it is read from ``num_draft_tokens`` (one host sync if that
  tensor lives on the GPU).
* ``cu_num_draft_tokens``: ``[num_reqs + 1]`` offsets starting at 0; built when omitted.
* ``block_size``: vocabulary tile of one program step (a power of two).

Everything else runs on the device without a sync: two kernel launches per call (one when
the target probabilities are given).
"""
from __future__ import annotations

import torch
import triton

from adaptspec_kernels.triton_verify import (
    _greedy_accept_kernel,
    _row_stats_kernel,
    _stochastic_accept_kernel,
)

DEFAULT_BLOCK_SIZE = 1024


def _ragged_layout(
    num_draft_tokens: torch.Tensor,  # [num_reqs] int
    device: torch.device,
    max_num_draft_tokens: int | None,
    cu_num_draft_tokens: torch.Tensor | None,  # [num_reqs + 1] int64 or None
) -> tuple[torch.Tensor, int]:
    if cu_num_draft_tokens is None:
        n = num_draft_tokens.to(device=device, dtype=torch.int64)
        cu_num_draft_tokens = torch.nn.functional.pad(torch.cumsum(n, 0), (1, 0))
    else:
        cu_num_draft_tokens = cu_num_draft_tokens.to(device=device, dtype=torch.int64)
    if max_num_draft_tokens is None:
        max_num_draft_tokens = int(num_draft_tokens.max()) if num_draft_tokens.numel() else 0
    return cu_num_draft_tokens.contiguous(), int(max_num_draft_tokens)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _empty_result(num_reqs: int, max_k: int, device: torch.device):
    return (torch.full((num_reqs, max_k + 1), -1, dtype=torch.int64, device=device),
            torch.zeros(num_reqs, dtype=torch.int64, device=device))


def greedy_verify(
    target_logits: torch.Tensor,  # [num_tokens, vocab_size], num_tokens = sum(num_draft_tokens + 1)
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    num_draft_tokens: torch.Tensor,  # [num_reqs] int
    *,
    max_num_draft_tokens: int | None = None,
    cu_num_draft_tokens: torch.Tensor | None = None,  # [num_reqs + 1] int64
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_reqs, max_k + 1] int64, [num_reqs] int64)
    """Greedy verification: accept while the drafted token is the target's argmax."""
    device = target_logits.device
    num_reqs = num_draft_tokens.numel()
    cu, max_k = _ragged_layout(num_draft_tokens, device, max_num_draft_tokens, cu_num_draft_tokens)
    out, num_accepted = _empty_result(num_reqs, max_k, device)
    if num_reqs == 0:
        return out, num_accepted
    target_logits = _rows_contiguous(target_logits)
    vocab_size = target_logits.shape[-1]
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64).contiguous()
    argmax = torch.empty(target_logits.shape[0], dtype=torch.int64, device=device)  # [num_tokens]
    block_v = min(block_size, triton.next_power_of_2(vocab_size))
    _row_stats_kernel[(num_reqs, max_k + 1)](
        target_logits, target_logits.stride(0), cu, cu, argmax, argmax, vocab_size,
        GREEDY=True, BLOCK_V=block_v,
    )
    _greedy_accept_kernel[(num_reqs,)](
        argmax, draft_token_ids, cu, out, num_accepted, max_k + 1,
        BLOCK_K=triton.next_power_of_2(max_k + 1),
    )
    return out, num_accepted


def stochastic_verify(
    target_probs: torch.Tensor,  # [num_tokens, vocab_size] processed target distributions p
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] q; None: one-hot drafts
    num_draft_tokens: torch.Tensor,  # [num_reqs] int
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] in [0, 1): the recovered/bonus draw
    *,
    max_num_draft_tokens: int | None = None,
    cu_num_draft_tokens: torch.Tensor | None = None,  # [num_reqs + 1] int64
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_reqs, max_k + 1] int64, [num_reqs] int64)
    """Exact rejection sampling from given target probabilities (one launch)."""
    return _stochastic(target_probs, None, draft_token_ids, draft_probs, num_draft_tokens,
                       uniform_accept, uniform_sample, max_num_draft_tokens, cu_num_draft_tokens,
                       block_size)


def stochastic_verify_from_logits(
    target_logits: torch.Tensor,  # [num_tokens, vocab_size] raw target logits
    temperature: torch.Tensor,  # [num_reqs] float, > 0
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] q; None: one-hot drafts
    num_draft_tokens: torch.Tensor,  # [num_reqs] int
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] in [0, 1)
    *,
    top_k: torch.Tensor | None = None,  # [num_reqs] int, 0 = no cut; None: no request cuts
    top_p: torch.Tensor | None = None,  # [num_reqs] float in (0, 1]; None: no request cuts
    probs_fn=None,  # (logits, temperature, top_k, top_p per row) -> probs: the caller's torch cuts
    max_num_draft_tokens: int | None = None,
    cu_num_draft_tokens: torch.Tensor | None = None,  # [num_reqs + 1] int64
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_reqs, max_k + 1] int64, [num_reqs] int64)
    """Exact rejection sampling with the temperature softmax fused into the kernels.

    top-k / top-p are not fused: when either is given the target probabilities are built by
    ``probs_fn`` (the engine passes its torch ``logits_to_probs``; this package does not
    import the engine) and the probability kernel verifies them. Pass ``None`` when no
    request in the batch cuts (the engine knows this on the host).
    """
    num_reqs = num_draft_tokens.numel()
    if top_k is not None or top_p is not None:
        if probs_fn is None:
            raise ValueError("top_k/top_p: pass probs_fn, the function that applies the cuts")
        logits_to_probs = probs_fn

        rows_per_req = num_draft_tokens.to(device=target_logits.device, dtype=torch.int64) + 1
        def per_row(x, fill):  # [num_reqs] -> [num_tokens]
            x = torch.full((num_reqs,), fill, device=target_logits.device) if x is None else x
            return torch.repeat_interleave(x.to(target_logits.device), rows_per_req,
                                           output_size=target_logits.shape[0])
        probs = logits_to_probs(target_logits, per_row(temperature, 1.0), per_row(top_k, 0),
                                per_row(top_p, 1.0))
        return stochastic_verify(probs, draft_token_ids, draft_probs, num_draft_tokens,
                                 uniform_accept, uniform_sample,
                                 max_num_draft_tokens=max_num_draft_tokens,
                                 cu_num_draft_tokens=cu_num_draft_tokens, block_size=block_size)
    return _stochastic(target_logits, temperature, draft_token_ids, draft_probs, num_draft_tokens,
                       uniform_accept, uniform_sample, max_num_draft_tokens, cu_num_draft_tokens,
                       block_size)


def _stochastic(
    target: torch.Tensor,  # [num_tokens, vocab_size] probs, or logits when temperature is given
    temperature: torch.Tensor | None,  # [num_reqs] or None
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total]
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] or None
    num_draft_tokens: torch.Tensor,  # [num_reqs]
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total]
    uniform_sample: torch.Tensor,  # [num_reqs]
    max_num_draft_tokens: int | None,
    cu_num_draft_tokens: torch.Tensor | None,  # [num_reqs + 1]
    block_size: int,
):
    device = target.device
    num_reqs = num_draft_tokens.numel()
    cu, max_k = _ragged_layout(num_draft_tokens, device, max_num_draft_tokens, cu_num_draft_tokens)
    out, num_accepted = _empty_result(num_reqs, max_k, device)
    if num_reqs == 0:
        return out, num_accepted
    target = _rows_contiguous(target)
    vocab_size = target.shape[-1]
    block_v = min(block_size, triton.next_power_of_2(vocab_size))
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64).contiguous()
    if draft_token_ids.numel() == 0:  # all k = 0: keep the pointers valid
        draft_token_ids = torch.zeros(1, dtype=torch.int64, device=device)
        uniform_accept = torch.ones(1, device=device)
    uniform_accept = uniform_accept.to(device).contiguous()
    uniform_sample = uniform_sample.to(device).contiguous()
    from_logits = temperature is not None
    if from_logits:
        temperature = temperature.to(device=device, dtype=torch.float32).contiguous()
        stats = torch.empty(target.shape[0], 2, dtype=torch.float32, device=device)  # [num_tokens, 2]
        _row_stats_kernel[(num_reqs, max_k + 1)](
            target, target.stride(0), cu, temperature, stats, stats, vocab_size,
            GREEDY=False, BLOCK_V=block_v,
        )
    else:
        temperature = stats = target  # unused pointers
    has_q = draft_probs is not None and draft_probs.numel() > 0
    q = _rows_contiguous(draft_probs) if has_q else target  # unused pointer when one-hot
    _stochastic_accept_kernel[(num_reqs,)](
        target, target.stride(0), stats, temperature, draft_token_ids, q, q.stride(0), cu,
        uniform_accept, uniform_sample, out, num_accepted, vocab_size, max_k + 1,
        FROM_LOGITS=from_logits, HAS_DRAFT_PROBS=has_q,
        BLOCK_K=triton.next_power_of_2(max_k + 1), BLOCK_V=block_v,
    )
    return out, num_accepted
