"""Per-token draft stopping: arms with a confidence threshold, what the engine reports, the
controller's calibration of confidences, the simulator's confidence model, and the vLLM
adaptive-verification baseline."""
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

from adaptspec.control import AdaptiveVerificationPolicy, Arm, PolicyConfig, StepOutcome
from adaptspec.control.acceptance import DiscountedBeta, arm_curves
from adaptspec.control.confidence import ConfidenceModel
from adaptspec.control.types import CONF_BINS, ConfidenceCounts
from adaptspec.sim.acceptance import BernoulliAcceptance, ConfidenceAcceptance, PositionAcceptance

SIM = Path(__file__).resolve().parents[2] / "simulations"


def test_arms_carry_a_threshold():
    assert str(Arm("draft", 8, 0.3)) == "draft:8@0.30" and Arm.parse("draft:8@0.30") == Arm("draft", 8, 0.3)
    assert Arm.parse("none") == Arm() and Arm.parse("ngram:2") == Arm("ngram", 2)
    assert Arm("draft", 0, 0.5) == Arm()  # no drafting has no threshold
    with pytest.raises(ValueError, match="min_confidence"):
        Arm("draft", 4, 1.0)
    with pytest.raises(ValueError, match="arm"):
        Arm.parse("draft")


def test_the_engine_adapter_counts_confidences_and_censors_short_drafts():
    # two requests of one class on draft:4 with threshold 0.5 (the engine stopped early):
    # a: drafted 2 (0.9, 0.7), kept both: accepted in bins 9 and 7, no failure at position 3
    # b: drafted 3 (0.8, 0.6, 0.55), kept 1: bin 8 accepted, bin 6 rejected, bin 5 unknown
    reqs = [NS(request_id="a", request_class="x", drafter="draft", k=4, drafted=2, accepted=2, emitted=3,
               draft_confidence=[0.9, 0.7], min_confidence=0.5),
            NS(request_id="b", request_class="x", drafter="draft", k=4, drafted=3, accepted=1, emitted=2,
               draft_confidence=[0.8, 0.6, 0.55], min_confidence=0.5)]
    st = NS(batch_size=2, prefill_tokens=0, verify_tokens=7, context_tokens=100, draft_s=0.001, verify_s=0.01,
            other_s=0.001, prefill_s=0.0, wall_s=0.012, num_waiting=0, requests=reqs)
    (g,) = StepOutcome.from_step_stats(st).groups
    assert g.arm == Arm("draft", 4, 0.5) and g.drafted == 5
    assert g.confidence.accepted.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert g.confidence.rejected.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert not g.confidence.seen.any()  # a threshold hides what lies below it: no distribution evidence
    # the posterior: position 3 saw one failure (b), not two; position 2: one success (a), one failure (b)
    post = DiscountedBeta(4, discount=1.0)
    post.update(g.accepted_hist, 0, g.drafted_accepted)
    assert post.a[0].tolist() == [3, 2, 1, 1] and post.b[0].tolist() == [1, 2, 1, 1]
    # the control: read as if both had drafted all 4, request a also "failed" at position 3
    plain = DiscountedBeta(4, discount=1.0)
    plain.update(g.accepted_hist, 0)
    assert plain.b[0, 2] == 2


def test_the_simulated_drafter_keeps_its_acceptance_and_its_confidences_sort_tokens():
    rng = np.random.default_rng(0)
    base = PositionAcceptance(np.array([0.9, 0.7, 0.5, 0.5]))
    model = ConfidenceAcceptance(base, 2.0)
    c, ok = model.sample_confidence(4, 40_000, rng)
    # calibrated: the acceptance at each position is the base model's (given the ones before)
    lead = np.cumprod(ok, axis=1)
    cond = lead[:, 1:].sum(axis=0) / lead[:, :-1].sum(axis=0)
    assert ok[:, 0].mean() == pytest.approx(0.9, abs=0.01) and cond == pytest.approx([0.7, 0.5, 0.5], abs=0.015)
    # and tokens with high confidence are accepted more often than tokens with low
    assert ok[c > 0.8].mean() > 0.9 > 0.3 > ok[c < 0.2].mean()
    # the truth the oracle plans with matches the draws: q = P(c >= t), r = P(c >= t, accepted)
    r, q = model.threshold_curves(4, np.array([0, 5]), CONF_BINS)
    assert q[1] == pytest.approx((c >= 0.5).mean(axis=0), abs=0.01)
    assert r[1] == pytest.approx(((c >= 0.5) & ok).mean(axis=0), abs=0.01)
    assert r[0] == pytest.approx([0.9, 0.7, 0.5, 0.5], abs=1e-3)  # no threshold: the base acceptance


def _learn(concentration: float, n: int = 4000, seed: int = 0) -> tuple[ConfidenceModel, np.ndarray]:
    """Counts a live engine would report, drafting 4 at threshold 0, fed to the model."""
    rng = np.random.default_rng(seed)
    truth = ConfidenceAcceptance(BernoulliAcceptance(0.6), concentration)
    model = ConfidenceModel(4, 1, discount=1.0)
    for _ in range(n // 50):
        c, ok = truth.sample_confidence(4, 50, rng)
        acc = np.cumprod(ok, axis=1).sum(axis=1)
        cc = ConfidenceCounts.empty(4)
        for ci, a in zip(c, acc):
            cc.add_request(ci, 4, int(a), 0.0)
        model.update(cc)
    return model, truth.threshold_curves(4, np.array([0, 3, 6]), CONF_BINS)[0]


def test_the_controller_learns_the_calibration_from_live_counts():
    model, r_true = _learn(2.0)
    assert model.ready().all()
    r, q = model.curves(np.full((1, 4), 0.6), np.array([0, 3, 6]))
    assert r[0] == pytest.approx(r_true, abs=0.04)
    # a threshold keeps fewer tokens, but those it keeps are accepted more often
    assert q[0, 2, 0] < q[0, 1, 0] < 1.0
    assert (r[0, 2] / q[0, 2]).min() > (r[0, 1] / q[0, 1]).max() > 0.6
    # the control: confidences that say nothing (all near 0.6) give a threshold nothing
    flat, _ = _learn(500.0)
    rf, qf = flat.curves(np.full((1, 4), 0.6), np.array([0, 3, 6]))
    kept = qf[0, 1] > 0.05
    assert (rf[0, 1][kept] / qf[0, 1][kept]) == pytest.approx(0.6, abs=0.05)


def test_a_threshold_saves_drafted_tokens_in_the_arm_curves():
    # positions accepted with 0.8 each; a threshold passes 70% and keeps its tokens' acceptance at 0.95
    p = np.full(4, 0.8)
    q = np.full(4, 0.7)
    r = q * 0.95
    L0, m0, reach0 = arm_curves(p)
    L1, m1, reach1 = arm_curves(r, q)
    assert m0[4] == 4 and m1[4] == pytest.approx(0.7 + 0.49 + 0.343 + 0.2401)
    assert reach1[4].tolist() == pytest.approx([1.0, 0.7, 0.49, 0.343])  # the forward at j runs if 1..j passed
    assert (L1[4] - 1) / m1[4] > (L0[4] - 1) / m0[4]  # more accepted per verified token


def test_vllm_adaptive_verification_verifies_the_likeliest_tokens_up_to_what_pays():
    pol = AdaptiveVerificationPolicy("draft", lambda tokens, ctx: 0.010 + 1e-5 * np.asarray(tokens, dtype=float),
                                     PolicyConfig(("draft",), 4))
    assert pol.choose("x", None) == Arm("draft", 4)
    conf = np.array([[0.9, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9], [0.6, 0.6, 0.1, 0.9]])
    # a cheap verification pass (memory-bound, 10 us a token): even the last token of request
    # 2 (0.6 x 0.6 x 0.1 x 0.9 = 3% to be kept) adds more than the step's ~750 tokens/s rate
    m = pol.select(conf, 3, 0.0, 0.002)
    assert m.tolist() == [4, 4, 4]
    # an expensive one: only the likeliest prefixes (request 0's 0.9, 0.81, ... first)
    steep = AdaptiveVerificationPolicy("draft", lambda tokens, ctx: 0.010 + 4e-3 * np.asarray(tokens, dtype=float),
                                       PolicyConfig(("draft",), 4))
    m2 = steep.select(conf, 3, 0.0, 0.002)
    assert m2[0] >= 1 and m2[1] == 0 and m2.sum() < m.sum()
    assert (m2 <= m).all()
