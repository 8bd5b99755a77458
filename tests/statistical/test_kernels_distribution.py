"""The stochastic Triton kernel emits the target's distribution (chi-square), with a
negative control showing the test rejects a wrong verifier.

Synthetic setup: every request has the same k = 3 target rows p_0..p_3 (temperature 0.8)
and draws its drafted tokens from fixed draft rows q_0..q_2. The target rows do not depend on the prefix, so exact speculative sampling
gives: the first emitted token ~ p_0; given position 1 is emitted, its token ~ p_1; the
accepted length follows P(accepted >= j + 1 | accepted >= j) = beta_j = sum min(p_j, q_j).

The Triton interpreter costs about 10 ms per request program on a CPU, so the batches are
small (vocabulary 8, 800 requests) and the probability entry point is used; the fused
temperature softmax is checked draw for draw against the torch path in
tests/unit/test_kernels.py (same tokens given the same uniforms, hence the same law).
"""
from __future__ import annotations

import pytest
import torch

from adaptspec_kernels.testing import load_kernels_or_skip

scipy_stats = pytest.importorskip("scipy.stats")
kv, DEVICE = load_kernels_or_skip()  # imports triton (interpreted on a machine without CUDA)

VOCAB, K, TEMP, NUM_REQS = 8, 3, 0.8, 800


def _chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; categories expected below 5 are pooled into one."""
    n = float(observed.sum())
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(scipy_stats.chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    row_logits = torch.randn(K + 1, VOCAB, generator=g)  # [K + 1, vocab_size] target rows
    p = torch.softmax(row_logits / TEMP, -1)
    q = torch.softmax(row_logits[:K] / TEMP + 0.7 * torch.randn(K, VOCAB, generator=g), -1)  # [K, vocab]
    n = torch.full((NUM_REQS,), K, dtype=torch.int64)
    drafts = torch.stack([torch.multinomial(q[j], NUM_REQS, replacement=True, generator=g) for j in range(K)], 1)
    return g, row_logits, p, q, n, drafts.reshape(-1)  # drafts: [NUM_REQS * K], request-major


def _run(g, target, q_claimed, n, drafts):
    ua = torch.rand(NUM_REQS * K, generator=g)
    us = torch.rand(NUM_REQS, generator=g)
    tgt = target.repeat(NUM_REQS, 1).to(DEVICE)  # [NUM_REQS * (K + 1), vocab_size]
    qd = q_claimed.repeat(NUM_REQS, 1).to(DEVICE)  # [NUM_REQS * K, vocab_size]
    args = (drafts.to(DEVICE), qd, n.to(DEVICE), ua.to(DEVICE), us.to(DEVICE))
    out, num_accepted = kv.stochastic_verify(tgt, *args, max_num_draft_tokens=K)
    return out.cpu(), num_accepted.cpu()


def _pvalues(out, num_accepted, p, q) -> tuple[float, float, float]:
    """(first emitted token ~ p_0, second token where emitted ~ p_1, accepted length ~ the
    law of per-position acceptance beta_j = sum min(p_j, q_j)), for the true p and q."""
    first = _chi2_pvalue(torch.bincount(out[:, 0], minlength=VOCAB), p[0])
    second_tokens = out[num_accepted >= 1, 1]
    assert second_tokens.numel() > 200
    second = _chi2_pvalue(torch.bincount(second_tokens, minlength=VOCAB), p[1])
    beta = torch.minimum(p[:K], q).sum(-1).double()
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(beta, 0)])  # P(accepted >= j)
    expected = torch.cat([reach[:-1] * (1 - beta), reach[-1:]])  # P(accepted == j), j = 0..K
    length = _chi2_pvalue(torch.bincount(num_accepted, minlength=K + 1), expected)
    return first, second, length


def test_kernel_emits_the_target_distribution():
    g, row_logits, p, q, n, drafts = _setup(0)
    out, num_accepted = _run(g, p, q, n, drafts)
    assert min(_pvalues(out, num_accepted, p, q)) > 1e-3


def test_negative_control_wrong_draft_probs_is_detected():
    # the kernel is told the drafts came from uniform q while they came from the skewed q:
    # acceptance is then wrong and the first token no longer follows p_0
    g, row_logits, p, q, n, drafts = _setup(1)
    wrong_q = torch.full_like(q, 1.0 / VOCAB)
    out, num_accepted = _run(g, p, wrong_q, n, drafts)
    first, second, length = _pvalues(out, num_accepted, p, q)
    assert first < 1e-6 and length < 1e-3  # the first token's and the accepted length's tests both catch it
