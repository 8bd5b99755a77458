"""Speculative sampling reproduces the target's distribution exactly (chi-square).

A tiny random target/draft pair (vocabulary 16) keeps the exact distribution computable by
enumeration. Each request's first output token comes from the prefill (plain target
sampling); the next two come from a speculative step with k = 2, so their joint law
exercises acceptance at both draft positions, the recovered token and the bonus token.
The negative control swaps in a wrong acceptance rule and must be rejected by the same test.
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


def exact_joint(hf, prompt, temperature, top_p):
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), with the same processing."""
    def dist(ctx):
        with torch.no_grad():
            logits = hf(torch.tensor([ctx])).logits[0, -1:]
        return logits_to_probs(logits, torch.tensor([temperature]), torch.tensor([0]),
                               torch.tensor([top_p]))[0].double()
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
    (1.3, 1.0, "ngram", [3, 7, 3, 7, 3]),  # repetitive: the n-gram drafter proposes 7, 3, ...
]


@pytest.mark.parametrize("temperature,top_p,drafter,prompt", CASES)
def test_speculative_joint_matches_target(engine, hf, temperature, top_p, drafter, prompt):
    counts = sample_joint(engine, prompt, temperature, top_p, drafter)
    assert engine.totals.drafted > 0 and engine.totals.accepted > 0
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
    counts = sample_joint(head_engine, prompt, temperature, top_p, "draft")
    assert head_engine.totals.accepted > 0
    assert chi2_pvalue(counts, exact_joint(hf, prompt, temperature, top_p)) > 1e-3
