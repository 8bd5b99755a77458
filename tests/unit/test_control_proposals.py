"""The model-based policy counts how often a drafter proposes at all.

n-gram lookup proposes nothing when the context has no match. Its acceptance posteriors are
censored (a request that proposed m < k says nothing of position m + 1), so they describe
proposed candidates only; an arm emits what the proposal rate and that acceptance allow
together. Here n-gram lookup matches on 15% of request-steps and then is accepted at 0.6 per
token; the draft model always proposes and is accepted at 0.5. The draft is the better
drafter; read as if every request proposed, n-gram lookup would look far better (0.6 per
token, nearly free). The control turns the proposal rate off and lands on n-gram lookup.
"""
import numpy as np
import pytest

from adaptspec.control import GroupOutcome, Load, ModelBasedThompson, PolicyConfig, StepOutcome
from adaptspec.control import thompson as thompson_mod
from adaptspec.control.gpu_profiles import builtin_profile
from adaptspec.control.thompson import proposal_counts
from adaptspec.control.types import Arm

N, CTX = 8, 1000
COST = builtin_profile("h100-8b-1b")
MATCH, NGRAM_ACC, DRAFT_ACC = 0.15, 0.6, 0.5


def test_proposal_counts_by_hand():
    # H[m, j]: 10 proposed none; 5 proposed 1 and rejected it, 3 kept it; 1 proposed 2 and
    # kept none, 2 kept one, 4 kept both
    H = np.array([[10, 0, 0], [5, 3, 0], [1, 2, 4]], dtype=float)
    g = GroupOutcome("c", Arm("ngram", 2), H.sum(axis=0), 0, drafted_accepted=H)
    there, missing = proposal_counts(g, 8)
    # position 1: all 25 reached it, 10 had nothing there; position 2: the 9 that kept one
    # reached it, of them the 3 that had proposed only one had nothing there
    assert there.tolist() == [15.0, 6.0] and missing.tolist() == [10.0, 3.0]
    # times the censored acceptance (position 2: 4 kept of the 6 proposed) it is the chance of
    # accepting 2 given 1 was accepted: 4 / 9
    assert there[1] / (there[1] + missing[1]) * 4 / 6 == pytest.approx(4 / 9)
    # a larger matrix than the arm's k is read up to k; no matrix: every request proposed k
    big = np.zeros((5, 5))
    big[:3, :3] = H
    assert [x.tolist() for x in proposal_counts(GroupOutcome("c", Arm("ngram", 2), H.sum(axis=0), 0,
                                                             drafted_accepted=big), 8)] == [[15.0, 6.0], [10.0, 3.0]]
    full = proposal_counts(GroupOutcome("c", Arm("draft", 3), np.array([4, 3, 2, 1]), 0), 8)
    assert full[0].tolist() == [10.0, 6.0, 3.0] and full[1].tolist() == [0.0, 0.0, 0.0]


def _truth(arm: Arm) -> float:
    """Expected tokens per second of one class of N requests on this arm."""
    k = arm.k
    if k == 0:
        return N / COST.step(N, N * CTX, np.zeros(8), 0, CTX).wall_s
    acc = NGRAM_ACC if arm.drafter == "ngram" else DRAFT_ACC
    chain = sum(acc ** j for j in range(1, k + 1))
    if arm.drafter == "ngram":
        emitted, tokens, batch, ngram = 1 + MATCH * chain, 1 + MATCH * k, np.zeros(8), N
    else:
        batch = np.zeros(8)
        batch[:k] = N
        emitted, tokens, ngram = 1 + chain, 1 + k, 0
    return N * emitted / COST.step(int(round(N * tokens)), N * CTX, batch, ngram, CTX).wall_s


def _run(policy, steps, seed=0):
    rng = np.random.default_rng(seed)
    arms = []
    for _ in range(steps):
        arm = policy.choose("chat", Load(N, 0, 0, N * CTX))
        H = np.zeros((arm.k + 1, arm.k + 1))
        batch, ngram = np.zeros(8), 0
        if arm.k:
            if arm.drafter == "ngram":
                proposed = np.where(rng.random(N) < MATCH, arm.k, 0)
                acc_rate, ngram = NGRAM_ACC, N
            else:
                proposed, acc_rate = np.full(N, arm.k), DRAFT_ACC
                batch[: arm.k] = N
            kept = np.minimum(np.cumprod(rng.random((N, arm.k)) < acc_rate, axis=1).sum(axis=1), proposed)
            np.add.at(H, (proposed, kept), 1.0)
        else:
            proposed = kept = np.zeros(N, dtype=np.int64)
            H[0, 0] = N
        tokens = int(N + proposed.sum())
        cost = COST.step(tokens, N * CTX, batch, ngram, CTX)
        g = GroupOutcome("chat", arm, np.bincount(kept, minlength=arm.k + 1), int(kept.sum()) + N,
                         drafted_accepted=H if arm.k else None)
        policy.observe(StepOutcome(N, 0, tokens, N * CTX, cost.draft_s, cost.verify_s, cost.other_s, cost.wall_s, [g]))
        arms.append(arm)
    return arms


@pytest.mark.parametrize("count_proposals", [True, False])
def test_a_drafter_that_rarely_proposes_is_not_overrated(count_proposals, monkeypatch):
    policy = ModelBasedThompson(PolicyConfig(("ngram", "draft"), 8, (), seed=3))
    scores = {a: _truth(a) for a in policy.table.arms}
    best = max(scores, key=scores.get)
    assert best.drafter == "draft"  # the setting is what the docstring says
    assert max(v for a, v in scores.items() if a.drafter == "ngram") < 0.95 * scores[best]
    if not count_proposals:  # the control: no proposal evidence, every candidate taken as there
        monkeypatch.setattr(thompson_mod, "proposal_counts",
                            lambda g, max_k: (np.zeros(min(g.arm.k, max_k)), np.zeros(min(g.arm.k, max_k))))
    tail = _run(policy, 400)[-100:]
    drafters = [a.drafter for a in tail]
    if count_proposals:
        value = np.mean([scores[a] for a in tail])
        assert drafters.count("draft") >= 75, f"draft in {drafters.count('draft')} of 100"
        assert value >= 0.95 * scores[best], f"{value:.0f} vs best {scores[best]:.0f}"
    else:
        assert drafters.count("ngram") >= 50, f"the control found the draft anyway: {drafters.count('ngram')}"
