"""The simulator reproduces the accepted-length law and its acceptance models behave."""
import numpy as np
import pytest

from adaptspec.sim.acceptance import BernoulliAcceptance, PositionAcceptance, ReplayAcceptance, mean_accepted_length
from adaptspec.sim.runner import run_scenario
from adaptspec.sim.scenario import parse_scenario


def scenario(a, k, **kw):
    data = {
        "name": "bernoulli", "seed": 11, "duration_s": 60, "warmup_s": 0, "drain_s": 30,
        "hardware": {"profile": "h100-8b-1b"}, "drafters": ["draft"], "max_k": 16,
        "classes": [{"name": "c", "prompt_tokens": {"dist": "fixed", "value": 64},
                     "output_tokens": {"dist": "fixed", "value": 2000},
                     "acceptance": {"draft": {"bernoulli": a}}}],
        "workload": {"rate": {"kind": "constant", "rps": 1.0}},
        "policies": [{"kind": "static", "drafter": "draft", "k": k}],
    }
    data.update(kw)
    return parse_scenario(data)


@pytest.mark.parametrize("a,k", [(0.5, 2), (0.7, 4), (0.8, 8), (0.9, 5), (0.3, 12)])
def test_simulated_mean_accepted_length_matches_closed_form(a, k):
    res = run_scenario(scenario(a, k), base=None)
    L = res.runs[0].mean_accepted_length
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert L == pytest.approx(expected, rel=0.01)
    # the control: the same tolerance tells this law from one whose acceptance is 0.03 off
    for off in (a - 0.03, a + 0.03):
        assert L != pytest.approx((1 - off ** (k + 1)) / (1 - off), rel=0.01)


def test_position_model_sampling_matches_its_probs():
    m = PositionAcceptance(np.array([0.9, 0.5, 0.2]))
    rng = np.random.default_rng(0)
    acc = m.sample(5, 200_000, rng)
    # P(accepted >= 1) = 0.9, >= 2 = 0.45, >= 3 = 0.09, >= 4 = 0.018 (last prob repeats)
    for j, p in enumerate([0.9, 0.45, 0.09, 0.018], start=1):
        assert (acc >= j).mean() == pytest.approx(p, abs=0.005)
    # the control: i.i.d. acceptance at the first position's 0.9 would put 0.81 at >= 2
    assert (acc >= 2).mean() != pytest.approx(0.81, abs=0.005)
    assert mean_accepted_length(m, 5) == pytest.approx(1 + 0.9 + 0.45 + 0.09 + 0.018 + 0.0036)


def test_replay_resamples_and_extends_censored_records():
    # recorded at k = 2: lengths 1 (0 accepted), 2 (1 accepted), 3 (both accepted, censored)
    m = ReplayAcceptance(np.array([0, 1, 2, 2]), recorded_k=2)
    rng = np.random.default_rng(1)
    assert set(np.unique(m.sample(1, 1000, rng))) == {0, 1}
    p = m.position_probs(4)
    assert p[:2].tolist() == [0.75, 2 / 3]
    assert p[2] == p[1]  # the deepest recorded rate continues
    deep = m.sample(4, 20_000, rng)
    assert deep.max() <= 4 and (deep > 2).any()


def test_bernoulli_validation():
    with pytest.raises(ValueError, match="rate"):
        BernoulliAcceptance(1.0)


def _lengths_mc(p, k, n, rng):
    """Accepted length (accepted + 1) of n steps drafting k with per-position probs p."""
    ok = rng.random((n, k)) < np.asarray(p)[:k]
    return 1 + np.cumprod(ok, axis=1).sum(axis=1)


@pytest.mark.parametrize("p", [[0.45] * 6, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
def test_tpot_spread_is_the_standard_error_of_a_short_requests_mean(p):
    from adaptspec.control.acceptance import accepted_length_curve, tpot_length_curve, tpot_spread

    rng = np.random.default_rng(3)
    p = np.array(p)
    spread = tpot_spread(p, 1.0, 64.0)
    mean = accepted_length_curve(p)
    assert spread[0] == 0.0  # no drafting: one token per step, no spread
    for k in (1, 3, 6):
        L = _lengths_mc(p, k, 200_000, rng)
        assert L.mean() == pytest.approx(mean[k], rel=0.01)
        # z standard errors of the mean over the ~64 / E[L] steps of a 64-token request
        assert spread[k] == pytest.approx(L.std() / np.sqrt(64.0 / L.mean()), rel=0.02)
    assert np.all(tpot_spread(p, 2.0, 64.0) == pytest.approx(2 * spread))
    assert np.all(tpot_spread(p, 1.0, 256.0) < spread + 1e-12)  # longer requests: less spread
    assert np.all(tpot_spread(p, 0.0, 64.0) == 0.0)
    assert np.all(tpot_length_curve(p, 2.0, 64.0) >= 1.0)
    assert np.all(tpot_length_curve(p, 2.0, 64.0) <= mean)
