"""`adaptspec bench`'s acceptance and bound: the per-token acceptance recovers the rate the
bound's formula assumes; accepted / drafted does not (the negative control)."""
import numpy as np
import pytest

from adaptspec.engine.bench import analytic_bound, token_acceptance
from adaptspec.engine.stats import RequestStepStats, StepStats


def _steps(a: float, k: int, n: int, seed: int = 0) -> list[StepStats]:
    rng = np.random.default_rng(seed)
    ok = rng.random((n, k)) < a
    accepted = np.cumprod(ok, axis=1).sum(axis=1)
    out = []
    for i, j in enumerate(accepted.tolist()):
        r = RequestStepStats("r", "chat", "draft", k, k, j, j + 1)
        out.append(StepStats(i, 1, 0, 0, k + 1, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, [r]))
    return out


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.6, 4), (0.8, 8)])
def test_token_acceptance_recovers_the_iid_rate(a, k):
    steps = _steps(a, k, 40_000)
    est = token_acceptance(steps)
    assert est == pytest.approx(a, abs=0.01)
    # the bound's token count then equals the measured mean accepted length
    emitted = np.mean([s.requests[0].emitted for s in steps])
    assert analytic_bound(est, k, 0.0) == pytest.approx(emitted, rel=0.02)
    # negative control: accepted / drafted is not the rate the formula wants
    rate = sum(s.requests[0].accepted for s in steps) / sum(s.requests[0].drafted for s in steps)
    assert abs(rate - a) > 0.05
    assert analytic_bound(rate, k, 0.0) < 0.95 * emitted


def test_token_acceptance_counts_only_judged_candidates():
    r = [RequestStepStats("r", "c", "ngram", 4, 3, 1, 2),  # judged 2 (accept, reject), third never judged
         RequestStepStats("r", "c", "ngram", 4, 0, 0, 1),  # nothing drafted: nothing judged
         RequestStepStats("r", "c", "ngram", 4, 2, 2, 3)]  # all judged and accepted
    st = StepStats(0, 3, 0, 0, 8, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, r)
    assert token_acceptance([st]) == pytest.approx(3 / 4)
    assert token_acceptance([]) == 0.0
    assert analytic_bound(0.5, 2, 0.1) == pytest.approx((1 + 0.5 + 0.25) / 1.2)
