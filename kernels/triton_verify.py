"""Triton kernels for exact speculative verification over a flattened ragged batch.

Layout (the same as ``adaptspec.engine.verifier``): request ``b`` drafted
``k_b = cu_num_draft_tokens[b + 1] - cu_num_draft_tokens[b]`` tokens (0 allowed); its
draft rows start at ``cu_num_draft_tokens[b]`` and its ``k_b + 1`` target rows at
``cu_num_draft_tokens[b] + b``.

Two kernels per verification, no host synchronisation between them:

* ``_row_stats_kernel``, grid ``(num_reqs, max_k + 1)``, one program per target row: the
  row's argmax (greedy), or the row's softmax statistics under the request's temperature
  (max of ``logits / T`` and the sum of ``exp(logits / T - max)``) so that no
  ``[num_tokens, vocab_size]`` probability tensor is ever written.
* ``_greedy_accept_kernel`` / ``_stochastic_accept_kernel``, grid ``(num_reqs,)``, one
  program per request: the accept test of every drafted token at once (vectorised over
  ``k``), the accepted length, then the recovered or bonus token by inverse-CDF sampling of
  one row (two passes over the vocabulary: total mass, then the first index whose
  cumulative mass exceeds ``u * total``), and the padded output row.

The CDF is accumulated in float64 and rounded to float32 element by element, which is what
``torch.cumsum`` does for float32 on the CPU, so given the same uniform draws the kernel
picks the same token as ``adaptspec.engine.sampling.sample_from_probs``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [num_tokens, vocab_size] raw target logits (any float dtype)
    stride_row,
    cu_num_draft_tokens_ptr,  # [num_reqs + 1] int64
    temperature_ptr,  # [num_reqs] float32 (stochastic only)
    argmax_ptr,  # [num_tokens] int64 out (greedy only)
    stats_ptr,  # [num_tokens, 2] float32 out: max(logits / T), sum exp(logits / T - max)
    vocab_size,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    d_start = tl.load(cu_num_draft_tokens_ptr + req)
    k = tl.load(cu_num_draft_tokens_ptr + req + 1) - d_start
    if j > k:  # grid is padded to max_k + 1 rows per request
        return
    row = (d_start + req + j).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    if GREEDY:
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        for v0 in range(0, vocab_size, BLOCK_V):
            idx = v0 + offs
            x = tl.load(base + idx, mask=idx < vocab_size, other=float("-inf")).to(tl.float32)
            blk_max = tl.max(x, 0)
            blk_idx = tl.min(tl.where(x == blk_max, idx, vocab_size), 0)  # first index of the max
            better = blk_max > best_val  # strict: an earlier block keeps ties, like torch.argmax
            best_idx = tl.where(better, blk_idx, best_idx)
            best_val = tl.where(better, blk_max, best_val)
        tl.store(argmax_ptr + row, best_idx.to(tl.int64))
    else:
        temp = tl.load(temperature_ptr + req).to(tl.float32)
        run_max = tl.full([], float("-inf"), tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            idx = v0 + offs
            x = tl.load(base + idx, mask=idx < vocab_size, other=float("-inf")).to(tl.float32) / temp
            new_max = tl.maximum(run_max, tl.max(x, 0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf prefix
            run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max), 0)
            run_max = new_max
        tl.store(stats_ptr + row * 2, run_max)
        tl.store(stats_ptr + row * 2 + 1, run_sum)


@triton.jit
def _greedy_accept_kernel(
    argmax_ptr,  # [num_tokens] int64 target argmax per row
    draft_token_ids_ptr,  # [num_draft_tokens_total] int64
    cu_num_draft_tokens_ptr,  # [num_reqs + 1] int64
    out_ptr,  # [num_reqs, max_k + 1] int64 out, -1 padded
    num_accepted_ptr,  # [num_reqs] int64 out
    out_cols,  # max_k + 1
    BLOCK_K: tl.constexpr,  # power of two > max_k
):
    req = tl.program_id(0)
    d_start = tl.load(cu_num_draft_tokens_ptr + req)
    k = tl.load(cu_num_draft_tokens_ptr + req + 1) - d_start
    jk = tl.arange(0, BLOCK_K)
    drafted_mask = jk < k
    drafted = tl.load(draft_token_ids_ptr + d_start + jk, mask=drafted_mask, other=-1)
    target = tl.load(argmax_ptr + d_start + req + jk, mask=jk <= k, other=-1)
    match = (drafted == target) & drafted_mask
    num_accepted = tl.min(tl.where(match, BLOCK_K, jk), 0)  # first mismatch, k if none
    # accepted positions hold the drafted (== target) token; position num_accepted holds the
    # target's own token: recovered on a mismatch, bonus after the last drafted token
    vals = tl.where(jk <= num_accepted, target, -1)
    tl.store(out_ptr + req * out_cols + jk, vals.to(tl.int64), mask=jk < out_cols)
    tl.store(num_accepted_ptr + req, num_accepted.to(tl.int64))


@triton.jit
def _stochastic_accept_kernel(
    target_ptr,  # [num_tokens, vocab_size] probabilities p, or raw logits when FROM_LOGITS
    stride_target,
    stats_ptr,  # [num_tokens, 2] float32 from _row_stats_kernel (FROM_LOGITS only)
    temperature_ptr,  # [num_reqs] float32 (FROM_LOGITS only)
    draft_token_ids_ptr,  # [num_draft_tokens_total] int64
    draft_probs_ptr,  # [num_draft_tokens_total, vocab_size] q (HAS_DRAFT_PROBS only)
    stride_draft,
    cu_num_draft_tokens_ptr,  # [num_reqs + 1] int64
    uniform_accept_ptr,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample_ptr,  # [num_reqs] in [0, 1)
    out_ptr,  # [num_reqs, max_k + 1] int64 out, -1 padded
    num_accepted_ptr,  # [num_reqs] int64 out
    vocab_size,
    out_cols,  # max_k + 1
    FROM_LOGITS: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two > max_k
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    d_start = tl.load(cu_num_draft_tokens_ptr + req)
    k = tl.load(cu_num_draft_tokens_ptr + req + 1) - d_start
    t_start = d_start + req
    jk = tl.arange(0, BLOCK_K)
    drafted_mask = jk < k
    drafted = tl.load(draft_token_ids_ptr + d_start + jk, mask=drafted_mask, other=0)
    t_rows = (t_start + jk).to(tl.int64)
    d_rows = (d_start + jk).to(tl.int64)
    temp = 1.0
    if FROM_LOGITS:
        temp = tl.load(temperature_ptr + req).to(tl.float32)
        x_tok = tl.load(target_ptr + t_rows * stride_target + drafted, mask=drafted_mask, other=0.0)
        r_max = tl.load(stats_ptr + t_rows * 2, mask=drafted_mask, other=0.0)
        r_sum = tl.load(stats_ptr + t_rows * 2 + 1, mask=drafted_mask, other=1.0)
        p_tok = tl.exp(x_tok.to(tl.float32) / temp - r_max) / r_sum
    else:
        p_tok = tl.load(target_ptr + t_rows * stride_target + drafted, mask=drafted_mask, other=0.0)
    if HAS_DRAFT_PROBS:
        q_tok = tl.load(draft_probs_ptr + d_rows * stride_draft + drafted, mask=drafted_mask, other=1.0)
    else:
        q_tok = tl.full([BLOCK_K], 1.0, tl.float32)  # one-hot drafts: q(x) = 1
    u_acc = tl.load(uniform_accept_ptr + d_start + jk, mask=drafted_mask, other=1.0)
    accept = (u_acc * q_tok < p_tok) & drafted_mask  # u < p/q: probability min(1, p/q)
    num_accepted = tl.min(tl.where(accept, BLOCK_K, jk), 0)  # first rejection, k if none
    rejected = num_accepted < k

    # the extra token: recovered from norm(max(0, p - q)) at the first rejection, else bonus from p
    f_row = (t_start + num_accepted).to(tl.int64)
    f_base = target_ptr + f_row * stride_target
    q_base = draft_probs_ptr + (d_start + num_accepted).to(tl.int64) * stride_draft
    rej_token = tl.sum(tl.where(jk == num_accepted, drafted, 0), 0)
    f_max = 0.0
    f_sum = 1.0
    if FROM_LOGITS:
        f_max = tl.load(stats_ptr + f_row * 2)
        f_sum = tl.load(stats_ptr + f_row * 2 + 1)
    q_len = tl.where(rejected, vocab_size, 0)  # the q row is read only after a rejection
    offs = tl.arange(0, BLOCK_V)
    # pass 1: total mass of the residual and of p (the residual may be empty when p == q)
    total_res = tl.full([], 0.0, tl.float64)
    total_p = tl.full([], 0.0, tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        idx = v0 + offs
        mask = idx < vocab_size
        if FROM_LOGITS:  # p from the logits and the row's softmax statistics (no helper call:
            # nested jit calls are slow in the interpreter)
            x = tl.load(f_base + idx, mask=mask, other=float("-inf")).to(tl.float32) / temp
            p = tl.where(mask, tl.exp(x - f_max) / f_sum, 0.0)
        else:
            p = tl.load(f_base + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_base + idx, mask=idx < q_len, other=0.0).to(tl.float32)
        else:
            q = tl.where(idx == rej_token, 1.0, 0.0)
        res = tl.maximum(p - q, 0.0)
        total_res += tl.sum(res.to(tl.float64), 0)
        total_p += tl.sum(p.to(tl.float64), 0)
    use_res = rejected & (total_res > 0)
    total = tl.where(use_res, total_res, total_p).to(tl.float32)
    thresh = tl.load(uniform_sample_ptr + req).to(tl.float32) * total
    # pass 2: count CDF entries <= thresh (searchsorted right), CDF summed in float64
    carry = tl.full([], 0.0, tl.float64)
    count = tl.full([], 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        idx = v0 + offs
        mask = idx < vocab_size
        if FROM_LOGITS:
            x = tl.load(f_base + idx, mask=mask, other=float("-inf")).to(tl.float32) / temp
            p = tl.where(mask, tl.exp(x - f_max) / f_sum, 0.0)
        else:
            p = tl.load(f_base + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_base + idx, mask=idx < q_len, other=0.0).to(tl.float32)
        else:
            q = tl.where(idx == rej_token, 1.0, 0.0)
        w = tl.where(use_res, tl.maximum(p - q, 0.0), p).to(tl.float64)
        cdf = (carry + tl.cumsum(w, 0)).to(tl.float32)
        count += tl.sum(((cdf <= thresh) & mask).to(tl.int32), 0)
        carry += tl.sum(w, 0)
    extra = tl.minimum(count, vocab_size - 1)

    vals = tl.where(jk < num_accepted, drafted, tl.where(jk == num_accepted, extra, -1))
    tl.store(out_ptr + req * out_cols + jk, vals.to(tl.int64), mask=jk < out_cols)
    tl.store(num_accepted_ptr + req, num_accepted.to(tl.int64))
