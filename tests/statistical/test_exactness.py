"""Speculative sampling reproduces the target's distribution exactly (chi-square).

A tiny random target/draft pair (vocabulary 16) keeps the exact distribution computable by
enumeration. Each request's first output token comes from the prefill (plain target
sampling); the next two come from a speculative step with k = 2, so their joint law
exercises acceptance at both draft positions, the recovered token and the bonus token.
The reference distribution is computed here in float64 numpy (softmax at the temperature,
then the top-p cut), not by the engine's own ``logits_to_probs``, so a bug there cannot
hide on both sides. Negative controls: a wrong acceptance rule, and for each drafter path
(a draft model, a draft head over a reduced vocabulary, n-gram's one-hot drafts) a wrong
recovered distribution (the target's p instead of norm(max(0, p - q))); the same test must
reject each.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from adaptspec import Engine, SamplingParams, SpecConfig
from adaptspec.engine import verifier
from adaptspec.engine.sampling import logits_to_probs

N_SAMPLES = 20_000
BATCH = 500
V = 16


@pytest.fixture(scope="module")
def engine(tiny_dir, tiny_draft_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_draft_dir), max_num_seqs=BATCH, max_model_len=40)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64).eval()


def reference_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Softmax at ``temperature``, then nucleus: keep the most probable tokens while the mass
    strictly before a token (in descending order) is below ``top_p``; renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ahead = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[ahead < top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def test_reference_probs_agree_with_the_engines_processing():
    """The two implementations, side by side (the engine's in float32)."""
    g = np.random.default_rng(0)
    for temperature, top_p in [(1.0, 1.0), (0.6, 0.8), (1.3, 1.0), (0.7, 0.3), (2.0, 0.95)]:
        x = g.normal(0, 2, size=(8, V))
        ours = logits_to_probs(torch.tensor(x, dtype=torch.float32), torch.full((8,), temperature),
                               torch.zeros(8, dtype=torch.long), torch.full((8,), top_p)).double().numpy()
        ref = np.stack([reference_probs(r, temperature, top_p) for r in x])
        np.testing.assert_allclose(ours, ref, atol=1e-6)
    # and they can disagree: a top-p cut one token too late is visible
    x = np.array([3.0, 2.0, 1.0, 0.0] + [-9.0] * (V - 4))
    assert (reference_probs(x, 1.0, 0.5) > 0).sum() == 1 and (reference_probs(x, 1.0, 0.8) > 0).sum() == 2


def exact_joint(hf, prompt, temperature, top_p):
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), with the same processing."""
    def dist(ctx):
        with torch.no_grad():
            logits = hf(torch.tensor([ctx])).logits[0, -1].numpy()
        return torch.from_numpy(reference_probs(logits, temperature, top_p))
    joint = torch.zeros(V, V, dtype=torch.float64)
    p1 = dist(prompt)
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        p2 = dist(prompt + [t1])
        for t2 in range(V):
            if p2[t2] > 0:
                joint[t2] += p1[t1] * p2[t2] * dist(prompt + [t1, t2])
    return joint.numpy()


def sample_joint(engine, prompt, temperature, top_p, drafter, n_samples=N_SAMPLES):
    counts = np.zeros((V, V))
    for b in range(n_samples // BATCH):
        params = [SamplingParams(max_new_tokens=4, temperature=temperature, top_p=top_p, seed=b * BATCH + i)
                  for i in range(BATCH)]
        outs = engine.generate([prompt] * BATCH, params, SpecConfig(drafter, 3))
        for o in outs:
            counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


def chi2_pvalue(counts, probs):
    expected = probs.ravel() * counts.sum()
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


CASES = [  # (temperature, top_p, drafter, prompt)
    (1.0, 1.0, "draft", [3, 7, 1]),
    (0.6, 0.8, "draft", [5, 2]),
    # repetitive: the n-gram drafter proposes 15, 14, ... which this target takes about half the
    # time (p(draft) (1 - p(draft)), what a wrong recovery shifts, is 0.17 here; [3, 7, 3, 7, 3]
    # at 1.3 gave 8e-5: almost no n-gram draft was ever accepted)
    (1.0, 1.0, "ngram", [14, 15, 14, 15, 14]),
]


@pytest.mark.parametrize("temperature,top_p,drafter,prompt", CASES)
def test_speculative_joint_matches_target(engine, hf, temperature, top_p, drafter, prompt):
    drafted, accepted = engine.totals.drafted, engine.totals.accepted  # the engine is shared: this case's own
    counts = sample_joint(engine, prompt, temperature, top_p, drafter)
    assert engine.totals.drafted > drafted and engine.totals.accepted > accepted
    assert engine.totals.accepted - accepted < engine.totals.drafted - drafted  # rejections happened too
    assert chi2_pvalue(counts, exact_joint(hf, prompt, temperature, top_p)) > 1e-3


def test_negative_control_wrong_acceptance_rule_is_detected(engine, hf, monkeypatch):
    """Accepting every drafted token the target allows (u = 0) yields the draft's law: caught.

    The bias is large, so a quarter of the samples already rejects it far below 1e-6."""
    real = verifier.verify_stochastic

    def accept_everything(p, draft_ids, q, num_draft, u_accept, u_sample):
        return real(p, draft_ids, q, num_draft, torch.zeros_like(u_accept), u_sample)

    monkeypatch.setattr(verifier, "verify_stochastic", accept_everything)
    temperature, top_p, drafter, prompt = CASES[0]
    counts = sample_joint(engine, prompt, temperature, top_p, drafter, n_samples=N_SAMPLES // 4)
    assert chi2_pvalue(counts, exact_joint(hf, prompt, temperature, top_p)) < 1e-6


@pytest.fixture(scope="module")
def head_engine(tiny_dir, tmp_path_factory):
    """The same target with a random draft HEAD over a reduced vocabulary (10 of 16 tokens):
    tokens outside it have draft probability 0, the recovered distribution must fill them in."""
    from adaptspec.distill.head import DraftHead, HeadConfig, save_head
    from adaptspec.engine.engine import Engine as _Engine, EngineConfig
    from adaptspec.models.loader import load_draft, load_model, load_weights

    t = load_model(str(tiny_dir))
    w = load_weights(tiny_dir)
    torch.manual_seed(0)
    ids = torch.tensor([0, 1, 2, 3, 5, 7, 8, 11, 12, 14])
    head = DraftHead(HeadConfig.for_target(t.model.cfg, 1, len(ids)), w["model.embed_tokens.weight"],
                     w["lm_head.weight"][ids], ids)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    folder = save_head(head, tmp_path_factory.mktemp("head"), dtype=torch.float32)
    return _Engine(t, load_draft(str(folder), t), EngineConfig(max_num_seqs=BATCH, max_model_len=40))


def test_draft_head_with_reduced_vocabulary_matches_target(head_engine, hf):
    temperature, top_p, prompt = 1.0, 1.0, [3, 7, 1]
    drafted, accepted = head_engine.totals.drafted, head_engine.totals.accepted
    counts = sample_joint(head_engine, prompt, temperature, top_p, "draft")
    assert head_engine.totals.accepted > accepted and head_engine.totals.accepted - accepted < head_engine.totals.drafted - drafted
    assert chi2_pvalue(counts, exact_joint(hf, prompt, temperature, top_p)) > 1e-3


def _recover_from_p(real):
    """The wrong recovered distribution: after a rejection, sample the target's p itself
    (the drafted token included) instead of norm(max(0, p - q)). Acceptance is untouched."""
    from adaptspec.engine.sampling import sample_from_probs

    def wrong(p, draft_ids, q, num_draft, u_accept, u_sample):
        res = real(p, draft_ids, q, num_draft, u_accept, u_sample)
        n = num_draft.long()
        rows = torch.cumsum(n + 1, 0) - (n + 1) + res.num_accepted  # the row the extra token comes from
        from_p = sample_from_probs(p[rows], u_sample)
        at = res.num_accepted[:, None]
        extra = torch.where(res.num_accepted < n, from_p, res.output_token_ids.gather(1, at).squeeze(1))
        return verifier.VerifyResult(res.output_token_ids.clone().scatter_(1, at, extra[:, None]), res.num_accepted)
    return wrong


@pytest.mark.parametrize("path", ["draft model", "draft head", "ngram"])
def test_negative_control_wrong_recovered_distribution_is_detected(engine, head_engine, hf, monkeypatch, path):
    """Each drafter path's recovery (a model's q, a reduced-vocabulary head's q with zeros
    outside its vocabulary, n-gram's one-hot q) is exercised by its chi-square above: getting
    it wrong is rejected at the threshold those tests pass."""
    monkeypatch.setattr(verifier, "verify_stochastic", _recover_from_p(verifier.verify_stochastic))
    if path == "draft model":
        temperature, top_p, drafter, prompt = CASES[0]
        eng = engine
    elif path == "ngram":
        temperature, top_p, drafter, prompt = CASES[2]
        eng = engine
    else:
        temperature, top_p, drafter, prompt = 1.0, 1.0, "draft", [3, 7, 1]
        eng = head_engine
    counts = sample_joint(eng, prompt, temperature, top_p, drafter)
    assert chi2_pvalue(counts, exact_joint(hf, prompt, temperature, top_p)) < 1e-3
