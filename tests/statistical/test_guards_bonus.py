"""The bonus position: the law of the token a fully accepted k = 2 step adds (chi-square).

``test_exactness`` tallies the first two tokens of a speculative step; at k = 2 the bonus
is the third, drawn only when both drafts are accepted. Here each request emits its first
token from the prefill, then one k = 2 step: tokens 1-2 are drafted positions, token 3 is
the bonus (or, after a rejection, comes from the next step). The joint law of (token 2,
token 3) is compared with the target's, computed exactly by enumeration in float64 with an
independent softmax / top-k / top-p (not the engine's ``logits_to_probs``).

Two drafts: the tiny random draft (acceptance in between: token 3 is sometimes a bonus,
sometimes not), and the target as its own draft, where every draft is accepted (q = p),
so token 3 is always the bonus: its law given full acceptance. Negative control: a
verifier that draws the bonus from the row before it (the previous position's
distribution) is rejected at the threshold the real one passes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from adaptspec import Engine, SamplingParams, SpecConfig
from adaptspec.engine import verifier
from adaptspec.engine.sampling import sample_from_probs
from tests.statistical.test_exactness import chi2_pvalue

N_SAMPLES = 8_000
BATCH = 500
V = 16
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def engines(tiny_dir, tiny_draft_dir):
    def make(draft):
        return Engine.from_pretrained(str(tiny_dir), draft=str(draft), max_num_seqs=BATCH, max_model_len=40)
    return {"draft": make(tiny_draft_dir), "self": make(tiny_dir)}


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64).eval()


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[n, V] logits -> distributions: softmax at ``temperature`` over the ``top_k`` largest
    logits (0: all), then the smallest most-probable set whose mass reaches ``top_p``."""
    z = logits / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True)


def exact_pair_law(hf, prompt, temperature, top_k, top_p) -> np.ndarray:
    """P(token 2, token 3) = sum over tokens 0, 1 of the product of the four conditionals,
    every context of a depth in one batched float64 forward."""
    def dists(contexts: list[list[int]]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + c for c in contexts])).logits[:, -1].numpy()
        return reference_probs(logits, temperature, top_k, top_p)

    paths = [[]]
    weight = np.ones(1)
    for _ in range(3):  # tokens 0, 1, 2: weight of every path of that length
        p = dists(paths)
        paths = [c + [t] for c in paths for t in range(V)]
        weight = (weight[:, None] * p).ravel()
    p3 = dists(paths)  # [V**3, V] law of token 3 after each path
    joint = weight[:, None] * p3  # [V**3, V]: (tokens 0-2 path, token 3)
    return joint.reshape(V * V, V, V).sum(0)  # sum over tokens 0, 1 -> [token 2, token 3]


def sample_pairs(engine, temperature, top_k, top_p, n_samples=N_SAMPLES):
    counts = np.zeros((V, V))
    full = 0
    for b in range(n_samples // BATCH):
        params = [SamplingParams(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=10_000 + b * BATCH + i) for i in range(BATCH)]
        for o in engine.generate([PROMPT] * BATCH, params, SpecConfig("draft", 2)):
            counts[o.token_ids[2], o.token_ids[3]] += 1
            full += o.stats.accepted_per_position[1]  # the first step accepted both drafts
    return counts, full / n_samples


CASES = [  # (engine, temperature, top_k, top_p)
    ("draft", 1.0, 0, 1.0),
    ("self", 0.8, 6, 0.9),  # the cuts on every row, the bonus row included
]


@pytest.mark.parametrize("which,temperature,top_k,top_p", CASES)
def test_bonus_position_matches_target(engines, hf, which, temperature, top_k, top_p):
    counts, full = sample_pairs(engines[which], temperature, top_k, top_p)
    pvalue = chi2_pvalue(counts, exact_pair_law(hf, PROMPT, temperature, top_k, top_p))
    print(f"{which}: both drafts accepted in {full:.3f} of first steps, p-value {pvalue:.3f}")
    if which == "self":  # q = p: every draft accepted, token 3 is always the bonus
        assert full == 1.0
    else:  # both outcomes happen, so token 3 mixes bonus and next-step tokens
        assert 0.05 < full < 0.95
    assert pvalue > 1e-3


def _bonus_from_the_previous_row(real):
    """The planted bug: after k >= 2 accepted drafts, the bonus comes from row k - 1."""
    def wrong(p, draft_ids, q, num_draft, u_accept, u_sample):
        res = real(p, draft_ids, q, num_draft, u_accept, u_sample)
        n = num_draft.long()
        full = (res.num_accepted == n) & (n >= 2)
        rows = torch.cumsum(n + 1, 0) - (n + 1) + (n - 1).clamp(min=0)
        at = res.num_accepted[:, None]
        extra = torch.where(full, sample_from_probs(p[rows], u_sample), res.output_token_ids.gather(1, at).squeeze(1))
        return verifier.VerifyResult(res.output_token_ids.clone().scatter_(1, at, extra[:, None]), res.num_accepted)
    return wrong


def test_negative_control_bonus_from_the_wrong_row_is_detected(engines, hf, monkeypatch):
    monkeypatch.setattr(verifier, "verify_stochastic", _bonus_from_the_previous_row(verifier.verify_stochastic))
    counts, _ = sample_pairs(engines["self"], 1.0, 0, 1.0, n_samples=N_SAMPLES // 8)
    pvalue = chi2_pvalue(counts, exact_pair_law(hf, PROMPT, 1.0, 0, 1.0))
    print(f"negative control p-value {pvalue:.2e}")
    assert pvalue < 1e-5
