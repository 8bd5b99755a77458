"""Acceptance models of the simulator: how many drafted tokens the verifier accepts.

Each model gives ``position_probs(K)`` (the truth the oracle plans with) and
``sample(k, n, rng)``: accepted drafted tokens for ``n`` requests that drafted ``k``.
"""
from __future__ import annotations

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


def mean_accepted_length(model: AcceptanceModel, k: int) -> float:
    """Expected accepted length (accepted + 1) at ``k`` from the model's position probs."""
    if k == 0:
        return 1.0
    return float(1.0 + np.cumprod(model.position_probs(k)).sum())
