"""The calibration fit recovers a known cost model from (synthetic) measured steps."""
import numpy as np
import pytest

from adaptspec.sim.calibrate import StepSample, fit_profile
from adaptspec.sim.costs import ProfileCostModel


def test_fit_profile_recovers_verify_context_draft_and_overhead():
    rng = np.random.default_rng(0)
    samples = []
    for b in (1, 2, 4, 8):
        for drafter, k in (("none", 0), ("ngram", 2), ("draft", 2), ("draft", 4)):
            for _ in range(3):
                tokens = b * (k + 1)
                ctx = int(b * rng.integers(100, 400))
                verify = 0.03 + 0.002 * tokens + 1e-6 * ctx  # the truth
                draft = {"none": 0.0, "ngram": 2e-4 * b, "draft": k * (0.004 + 0.0005 * b)}[drafter]
                samples.append(StepSample(b, drafter, k, tokens, ctx, verify, draft, 0.002))
    prof = fit_profile(samples, name="synthetic", max_num_seqs=8, kv_capacity_tokens=10_000, max_batched_tokens=512)
    m = ProfileCostModel(prof)
    assert prof.calibrated
    assert prof.verify_context_s_per_token == pytest.approx(1e-6, rel=1e-3)
    for tokens in (1, 6, 40):
        assert m.verify_s(tokens, 0) == pytest.approx(0.03 + 0.002 * tokens, rel=1e-3)
    assert prof.draft_batch == [1.0, 2.0, 4.0, 8.0]
    assert prof.draft_s == pytest.approx([0.004 + 0.0005 * b for b in (1, 2, 4, 8)])
    assert prof.ngram_s_per_request == pytest.approx(2e-4)
    assert prof.step_overhead_s == pytest.approx(0.002)


def test_fit_profile_needs_steps():
    with pytest.raises(ValueError, match="no steps"):
        fit_profile([], name="x", max_num_seqs=1, kv_capacity_tokens=1, max_batched_tokens=1)


def test_fit_profile_falls_back_to_tokens_alone_when_context_is_confounded():
    # context grows exactly with tokens and the times carry noise: the joint fit is unusable
    samples = [StepSample(b, "none", 0, b, 100 * b, 0.04 + 0.001 * b + (0.003 if b % 2 else -0.003), 0.0, 0.001)
               for b in (1, 2, 3, 4, 5, 6)]
    prof = fit_profile(samples, name="x", max_num_seqs=6, kv_capacity_tokens=100, max_batched_tokens=64)
    assert prof.verify_context_s_per_token >= 0.0
    assert all(0.03 < v < 0.06 for v in prof.verify_s)
