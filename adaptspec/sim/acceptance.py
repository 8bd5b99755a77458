"""Acceptance models of the simulator: how many drafted tokens the verifier accepts.

Each model gives ``position_probs(K)`` (the truth the oracle plans with) and
``sample(k, n, rng)``: accepted drafted tokens for ``n`` requests that drafted ``k``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class BernoulliAcceptance:
    """Every drafted token is accepted with the same probability ``rate``."""

    rate: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"rate: must be in [0, 1), got {self.rate}")

    def position_probs(self, K: int) -> np.ndarray:
        return np.full(K, self.rate)

    def sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        # accepted before the first rejection is geometric; capped at k
        return np.minimum(rng.geometric(1.0 - self.rate, n) - 1, k)


@dataclass(slots=True)
class PositionAcceptance:
    """Position i is accepted with probability probs[i] given 1..i-1 were (last one repeats)."""

    probs: np.ndarray

    def __post_init__(self) -> None:
        self.probs = np.asarray(self.probs, dtype=float)
        if self.probs.size == 0 or np.any((self.probs < 0) | (self.probs > 1)):
            raise ValueError("probs: need at least one probability, each within [0, 1]")

    def position_probs(self, K: int) -> np.ndarray:
        p = self.probs
        return p[:K] if p.size >= K else np.concatenate([p, np.full(K - p.size, p[-1])])

    def sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        p = self.position_probs(k)
        ok = rng.random((n, k)) < p
        return np.cumprod(ok, axis=1).sum(axis=1)


@dataclass(slots=True)
class ReplayAcceptance:
    """Resample accepted counts recorded from the live engine at ``recorded_k``.

    A record equal to ``recorded_k`` is censored (all accepted); when asked for a larger k
    the run continues with the conditional acceptance of the deepest recorded position.
    """

    accepted: np.ndarray  # accepted drafted tokens per recorded request-step (0..recorded_k)
    recorded_k: int

    def __post_init__(self) -> None:
        self.accepted = np.asarray(self.accepted, dtype=np.int64)
        if self.accepted.size == 0:
            raise ValueError("accepted_lengths: empty replay")
        if self.accepted.min() < 0 or self.accepted.max() > self.recorded_k:
            raise ValueError(f"accepted_lengths: each must be within 1..{self.recorded_k + 1}")

    def position_probs(self, K: int) -> np.ndarray:
        tail = np.array([(self.accepted >= i).sum() for i in range(self.recorded_k + 1)], dtype=float)
        p = np.divide(tail[1:], tail[:-1], out=np.zeros(self.recorded_k), where=tail[:-1] > 0)
        last = p[-1] if p.size else 0.0
        return p[:K] if p.size >= K else np.concatenate([p, np.full(K - p.size, last)])

    def sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        acc = self.accepted[rng.integers(0, self.accepted.size, n)]
        if k <= self.recorded_k:
            return np.minimum(acc, k)
        last = self.position_probs(self.recorded_k)[-1]
        full = acc == self.recorded_k
        extra = np.minimum(rng.geometric(1.0 - min(last, 1 - 1e-9), n) - 1, k - self.recorded_k)
        return np.where(full, acc + extra, acc)


AcceptanceModel = BernoulliAcceptance | PositionAcceptance | ReplayAcceptance

_EDGES = np.linspace(0.0, 1.0, 401)  # cells of [0, 1] the calibration is integrated over
_V = (np.arange(512) + 0.5) / 512  # quadrature points of the CDF's substituted integral


def _beta_cdf(t: np.ndarray, a: float, b: float) -> np.ndarray:
    """P(c < t) for c ~ Beta(a, b), t in [0, 1]. With c = t v^(1/a) the density's
    singularity at 0 goes away: P = t^a / (a B(a, b)) * int_0^1 (1 - t v^(1/a))^(b - 1) dv,
    bounded for t < 1 (numpy has no incomplete beta; a grid over c itself misses the mass
    piled at 0 or 1 when a or b is below 1)."""
    t = np.asarray(t, dtype=float)
    inner = np.clip(t, 0.0, 1.0 - 1e-12)
    log_b = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    integral = ((1.0 - inner[..., None] * _V ** (1.0 / a)) ** (b - 1.0)).mean(axis=-1)
    out = np.exp(a * np.log(np.maximum(inner, 1e-300)) - math.log(a) - log_b) * integral
    return np.where(t >= 1.0, 1.0, np.clip(out, 0.0, 1.0))


def _cell_masses(mean: float, concentration: float) -> np.ndarray:
    """[cells] Beta(mean c, (1 - mean) c) probability of each cell of _EDGES."""
    m = min(max(float(mean), 1e-4), 1 - 1e-4)
    return np.diff(_beta_cdf(_EDGES, m * concentration, (1 - m) * concentration))


@dataclass(slots=True)
class ConfidenceAcceptance:
    """A drafter that reports a confidence per drafted token.

    At position j the confidence is c ~ Beta(p_j * concentration, (1 - p_j) * concentration),
    independent across positions, with p_j the base model's acceptance there; the token is
    accepted with probability g(c), the calibration (``None``: g(c) = c, a calibrated
    drafter, and the base model's acceptance is kept exactly). A low concentration makes
    confidences informative (near 0 or 1), a high one says little beyond p_j. ``calibration``
    gives g at the centres of equal bins of [0, 1], linearly interpolated."""

    base: AcceptanceModel
    concentration: float
    calibration: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.concentration > 0:
            raise ValueError(f"concentration: must be > 0, got {self.concentration}")
        if self.calibration is not None:
            self.calibration = np.asarray(self.calibration, dtype=float)
            if self.calibration.size < 2 or np.any((self.calibration < 0) | (self.calibration > 1)):
                raise ValueError("calibration: need at least two probabilities, each within [0, 1]")

    def g(self, c: np.ndarray) -> np.ndarray:
        if self.calibration is None:
            return c
        n = self.calibration.size
        return np.interp(c, (np.arange(n) + 0.5) / n, self.calibration)

    def position_probs(self, K: int) -> np.ndarray:
        p = self.base.position_probs(K)
        if self.calibration is None:
            return p
        mid = (_EDGES[1:] + _EDGES[:-1]) / 2
        return np.array([float(_cell_masses(q, self.concentration) @ self.g(mid)) for q in p])

    def sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        _, ok = self.sample_confidence(k, n, rng)
        return np.cumprod(ok, axis=1).sum(axis=1)

    def sample_confidence(self, k: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """[n, k] confidences and [n, k] whether each token would be accepted (given that
        the ones before it were: the verifier stops at the first rejection)."""
        p = np.clip(self.base.position_probs(k), 1e-4, 1 - 1e-4)
        c = rng.beta(p * self.concentration, (1 - p) * self.concentration, size=(n, k))
        return c, rng.random((n, k)) < self.g(c)

    def threshold_curves(self, K: int, bins: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
        """(r, q) [T, K] for thresholds at ``bins / num_bins``: q = P(c >= t) and
        r = P(c >= t and accepted) per position (see ``adaptspec.control.confidence``)."""
        mid = (_EDGES[1:] + _EDGES[:-1]) / 2
        cut = np.asarray(bins, dtype=float) / num_bins  # thresholds lie on cell edges (multiples of 1/400)
        above = (mid[None, :] >= cut[:, None]).astype(float)  # [T, cells]
        masses = np.stack([_cell_masses(q, self.concentration) for q in self.base.position_probs(K)])  # [K, cells]
        return (above * self.g(mid)[None, :]) @ masses.T, above @ masses.T


def inner(model) -> AcceptanceModel:
    """The acceptance model under a confidence wrapper (itself otherwise)."""
    return model.base if isinstance(model, ConfidenceAcceptance) else model


def mean_accepted_length(model: AcceptanceModel, k: int) -> float:
    """Expected accepted length (accepted + 1) at ``k`` from the model's position probs."""
    if k == 0:
        return 1.0
    return float(1.0 + np.cumprod(model.position_probs(k)).sum())
