"""Per-position acceptance: discounted Beta posteriors and expected accepted length.

Position ``i`` (1-based) of a drafted block is accepted with conditional probability
``p_i`` given that positions ``1..i-1`` were accepted. A request that accepted ``j`` of
``k`` drafted tokens contributes a success at positions ``1..j`` and, when ``j < k``, a
failure at position ``j + 1``; deeper positions are unobserved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_clip = np._core.umath.clip if hasattr(np, "_core") else np.core.umath.clip


def arm_curves(p: np.ndarray, q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expected accepted length, drafted tokens and draft reach for k = 0..K.

    p: [..., K] the conditional chance that position j is drafted and accepted given
    1..j-1 were; q: [..., K] the conditional chance that position j is drafted (its
    confidence passes the arm's threshold) given 1..j-1 were (None: always). Returns
    [..., K + 1] accepted length (accepted + 1), [..., K + 1] drafted (verified) tokens, and
    [..., K + 1, K] the chance the draft forward at position j (0-based) runs for an arm of
    that k (positions before j passed the threshold, and j < k).
    """
    K = p.shape[-1]
    L = accepted_length_curve(p)
    if q is None:
        m = np.broadcast_to(np.arange(K + 1, dtype=float), L.shape)
        surv = np.ones(p.shape[:-1] + (K,))
    else:
        reach_tok = np.multiply.accumulate(q, axis=-1)  # [..., R, K] position j drafted
        m = np.concatenate([np.zeros(q.shape[:-1] + (1,)), np.add.accumulate(reach_tok, axis=-1)], axis=-1)
        # the draft forward at position j runs when positions before it passed
        surv = np.concatenate([np.ones(q.shape[:-1] + (1,)), reach_tok[..., :-1]], axis=-1)
    below = np.arange(K)[None, :] < np.arange(K + 1)[:, None]  # [K + 1, K] position j < k
    reach = surv[..., None, :] * below
    return L, m, reach


def accepted_length_curve(p: np.ndarray) -> np.ndarray:
    """Expected accepted length (accepted + 1) for k = 0..K, from per-position probs.

    p: [..., K] conditional acceptance per position -> returns [..., K + 1].
    With a constant rate a this is (1 - a^(k+1)) / (1 - a).
    """
    out = np.ones(p.shape[:-1] + (p.shape[-1] + 1,))
    # the ufuncs' accumulate is np.cumsum / np.cumprod without their ~2 us wrappers
    out[..., 1:] += np.add.accumulate(np.multiply.accumulate(p, axis=-1), axis=-1)
    return out


def tpot_length_curve(p: np.ndarray, z: float, short_tokens: float) -> np.ndarray:
    """Accepted length to budget a TPOT target with, for k = 0..K: the mean less ``z``
    standard errors of a short request's mean accepted length (see ``tpot_spread``)."""
    mean = accepted_length_curve(p)
    return np.maximum(mean - tpot_spread(p, z, short_tokens), 1.0)


def tpot_spread(p: np.ndarray, z: float, short_tokens: float) -> np.ndarray:
    """``z`` standard errors of a short request's mean accepted length, for k = 0..K.

    A request's TPOT is its decode time over its tokens, so a short request (``short_tokens``
    tokens, about ``short_tokens / E[L]`` steps) with unlucky acceptance sees a lower mean
    accepted length than its class: the standard error is sd(L) / sqrt(steps). With
    S_j = P(L >= j + 1) = p_1 ... p_j, E[L] = 1 + sum_j S_j and E[L^2] = 1 + sum_j (2j + 1) S_j.
    Any leading dimensions of ``p`` are kept (several classes and drafters at once).
    """
    if z <= 0:
        return np.zeros(p.shape[:-1] + (p.shape[-1] + 1,))
    mean = accepted_length_curve(p)
    surv = np.multiply.accumulate(p, axis=-1)
    second = np.ones_like(mean)
    second[..., 1:] += np.add.accumulate(surv * _odd(p.shape[-1]), axis=-1)
    sd = np.sqrt(np.maximum(second - mean * mean, 0.0))
    return z * sd * np.sqrt(mean / short_tokens)


_ODD: dict[int, np.ndarray] = {}


def _odd(k: int) -> np.ndarray:
    """[k] 2j + 1 for j = 1..k (the weights of E[L^2])."""
    w = _ODD.get(k)
    if w is None:
        w = _ODD[k] = 2.0 * np.arange(1, k + 1) + 1.0
    return w


def successes_failures(accepted_hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position successes and failures from a histogram of accepted counts.

    accepted_hist: [k + 1] number of requests that accepted exactly j -> ([k], [k]).
    """
    k = accepted_hist.size - 1
    # requests with accepted >= i succeed at position i
    tail = np.cumsum(accepted_hist[::-1])[::-1]  # tail[j] = #(accepted >= j)
    succ = tail[1:].astype(float)
    fail = accepted_hist[:k].astype(float)  # accepted == i - 1 failed at position i
    return succ, fail


@dataclass(slots=True)
class DiscountedBeta:
    """Beta(alpha, beta) per (row, position), discounted toward the prior at every update.

    A row is one drafter of one request class; positions are 1..max_k. An update discounts
    the row of the drafter that ran. ``fade`` decays every row toward the prior by elapsed
    time, so a drafter the policy stopped using (or a class that runs without speculation)
    regains uncertainty and is tried again after a while: without it, a drafter that lost once
    is never tried again if its acceptance rises later. (Fading every row by the per-step
    discount was tried and reverted on 2026-12-01: at ~20 steps a second that halves the
    evidence every 7 s, too much exploration where speculation barely pays; see
    simulations/REPORT.md.)
    """

    max_k: int
    rows: int = 1
    discount: float = 0.995
    prior_a: float = 1.0
    prior_b: float = 1.0
    # positions 2..max_k: a prior of this many pseudo-counts at the posterior mean of the
    # position before, in place of Beta(prior_a, prior_b) (0: that fixed prior at every
    # position). A deep position is reached only through the ones before it, so where the first
    # rarely accepts it stays near its prior for good; at Beta(1, 1) that is 0.5, every draw of
    # a long k looked half-accepted at depth, and no amount of running it taught otherwise
    carry: float = 0.0
    a: np.ndarray = field(init=False)  # [rows, max_k]
    b: np.ndarray = field(init=False)  # [rows, max_k]
    updates: int = field(init=False, default=0)
    _ab: np.ndarray = field(init=False, repr=False)
    _prior: np.ndarray = field(init=False, repr=False)
    _prior_ab: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # a and b are views of one [2, rows, max_k] array: one decay touches both
        self._ab = np.empty((2, self.rows, self.max_k))
        self.a, self.b = self._ab
        self.a[:] = self.prior_a
        self.b[:] = self.prior_b
        self._prior_ab = np.array([self.prior_a, self.prior_b])[:, None]
        self._prior = self._prior_ab * (1 - self.discount)

    def update(self, accepted_hist: np.ndarray, row: int = 0, drafted_accepted: np.ndarray | None = None) -> None:
        """``drafted_accepted`` [k + 1, k + 1] (requests that proposed m and kept j, see
        ``GroupOutcome``): a request that proposed m < k and kept all m is censored at m (no
        failure at m + 1); without it every request is taken to have proposed all k."""
        h = accepted_hist[: self.max_k + 1]
        n = h.size - 1
        successes = np.add.accumulate(h[::-1])[-2::-1]  # at position i: accepted >= i
        if drafted_accepted is None:
            failures = h[:n]  # at position i: accepted == i - 1
        else:
            # failures at position i: accepted == i - 1 among requests that proposed >= i
            H = drafted_accepted[: n + 1, : n + 1]
            tail = np.add.accumulate(H[::-1], axis=0)[::-1]  # tail[m, j]: proposed >= m, kept j
            failures = np.diagonal(tail, offset=-1)[:n]
        self.update_counts(successes, failures, row)

    def update_counts(self, successes: np.ndarray, failures: np.ndarray, row: int = 0) -> None:
        """Discount ``row`` and add per-position counts (the first ``len`` positions)."""
        n = min(successes.size, self.max_k)
        # decay the evidence (not the prior) so an old regime is forgotten
        ab = self._ab[:, row]
        ab *= self.discount
        ab += self._prior
        self.a[row, :n] += successes[:n]
        self.b[row, :n] += failures[:n]
        self.updates += 1

    def fade(self, factor: float) -> None:
        """Keep ``factor`` (in (0, 1]) of every row's evidence beyond the prior."""
        if factor < 1.0:
            ab = self._ab.reshape(2, -1)  # a view: rows and positions flattened
            ab -= self._prior_ab
            ab *= factor
            ab += self._prior_ab

    def mean(self) -> np.ndarray:
        return self.a / (self.a + self.b)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation, each [rows, max_k]."""
        n = self.a + self.b
        if self.carry <= 0:
            m = self.a / n
            return m, np.sqrt(m * (1.0 - m) / (n + 1.0))
        # positions 2..K: the evidence beyond the fixed prior plus ``carry`` pseudo-counts at the
        # mean of the position before, (s_j + c m_{j-1}) / (n_j + c), a recursion over positions
        n[:, 1:] += self.carry - (self.prior_a + self.prior_b)
        m = self.a / n
        m[:, 1:] -= self.prior_a / n[:, 1:]
        w = self.carry / n[:, 1:]
        for j in range(1, self.max_k):
            m[:, j] += w[:, j - 1] * m[:, j - 1]
        return m, np.sqrt(m * (1.0 - m) / (n + 1.0))

    def sample(self, z: np.ndarray, moments: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """A posterior draw from standard normals z [rows, max_k].

        Moment-matched normal approximation of each Beta, clipped to (0, 1): exact Beta
        draws cost ~20 us per call in numpy, more than the whole decision budget.
        """
        return self.sample_from(moments if moments is not None else self.moments(), z)

    @staticmethod
    def sample_from(moments: tuple[np.ndarray, np.ndarray], z: np.ndarray) -> np.ndarray:
        """``sample`` from given moments; any leading dimensions (several posteriors at once)."""
        m, sd = moments
        x = sd * z
        x += m
        return _clip(x, 1e-4, 1.0 - 1e-4, out=x)  # the ufunc: np.clip's wrapper costs more than the clip
