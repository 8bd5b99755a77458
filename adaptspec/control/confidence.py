"""Per-token draft stopping: what a drafted token's confidence says about its acceptance.

A drafter reports its confidence in each drafted token (the draft head's probability, the
n-gram match's frequency). An arm with ``min_confidence`` stops a request's draft at the
first token below it. To price such arms the controller learns, per request class and
drafter, from live steps only (no offline profile):

- the calibration g(b) = P(accepted | confidence in bin b), a discounted Beta per bin,
  from verified tokens whose fate is known (up to each request's first rejection);
- the confidence distribution f_j(b) at each position j, from drafts run without a
  threshold (a threshold hides what lies below it).

For a threshold t (a bin edge) it turns these into the two per-position chances the
planner needs (``acceptance.arm_curves``): q_j(t) = P(confidence at j >= t) and
r_j(t) = P(confidence at j >= t and accepted), the latter scaled so that t = 0 gives the
acceptance posterior's own p_j (the calibration only says how acceptance splits across
confidences; the per-position posterior stays the one source of the level).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptspec.control.types import CONF_BINS, ConfidenceCounts

# confidence evidence a drafter needs (tokens seen without a threshold) before its threshold
# arms are considered: with less the distribution below a threshold is a guess
MIN_SEEN = 200.0
CENTRES = (np.arange(CONF_BINS) + 0.5) / CONF_BINS
PRIOR_WEIGHT = 2.0  # pseudo-tokens per bin of "calibrated" (g = bin centre) the calibration starts from


@dataclass(slots=True)
class ConfidenceModel:
    """Calibration and confidence distribution of one class's drafters (rows)."""

    max_k: int
    rows: int = 1
    discount: float = 0.995
    acc: np.ndarray = field(init=False)  # [rows, B]
    rej: np.ndarray = field(init=False)  # [rows, B]
    seen: np.ndarray = field(init=False)  # [rows, K, B]

    def __post_init__(self) -> None:
        self.acc = np.tile(PRIOR_WEIGHT * CENTRES, (self.rows, 1))
        self.rej = np.tile(PRIOR_WEIGHT * (1.0 - CENTRES), (self.rows, 1))
        self.seen = np.zeros((self.rows, self.max_k, CONF_BINS))

    def update(self, counts: ConfidenceCounts, row: int = 0) -> None:
        g = self.discount
        k = min(counts.seen.shape[0], self.max_k)
        self.acc[row] = g * self.acc[row] + (1 - g) * PRIOR_WEIGHT * CENTRES + counts.accepted
        self.rej[row] = g * self.rej[row] + (1 - g) * PRIOR_WEIGHT * (1.0 - CENTRES) + counts.rejected
        if counts.seen.any():
            self.seen[row] *= g
            self.seen[row, :k] += counts.seen[:k]

    def fade(self, factor: float) -> None:
        """Keep ``factor`` of the evidence beyond the prior (time-based forgetting)."""
        if factor < 1.0:
            pa, pr = PRIOR_WEIGHT * CENTRES, PRIOR_WEIGHT * (1.0 - CENTRES)
            self.acc[:] = pa + factor * (self.acc - pa)
            self.rej[:] = pr + factor * (self.rej - pr)
            self.seen *= factor

    def ready(self) -> np.ndarray:
        """[rows] bool: enough confidences seen to price threshold arms."""
        return self.seen.sum(axis=(1, 2)) >= MIN_SEEN

    def calibration(self, z: np.ndarray | None = None) -> np.ndarray:
        """[rows, B] P(accepted | bin): the posterior mean, or a draw from standard normals z."""
        n = self.acc + self.rej
        m = self.acc / n
        if z is None:
            return m
        return np.clip(m + z * np.sqrt(m * (1 - m) / (n + 1.0)), 1e-4, 1 - 1e-4)

    def distribution(self) -> np.ndarray:
        """[rows, K, B] confidence distribution per position (positions never seen borrow
        the pooled one, and an unseen drafter is uniform)."""
        pooled = self.seen.sum(axis=1, keepdims=True) + 1e-3
        pooled = pooled / pooled.sum(axis=-1, keepdims=True)
        f = self.seen + 5.0 * pooled  # a few pseudo-tokens of the pooled shape per position
        return f / f.sum(axis=-1, keepdims=True)

    def curves(self, p: np.ndarray, thresholds: np.ndarray, g: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """p: [rows, K] acceptance per position (the posterior's); thresholds: [T] bin-edge
        indices (0 = no threshold). Returns r, q: [rows, T, K] (see the module docstring)."""
        g = self.calibration() if g is None else g
        f = self.distribution()  # [rows, K, B]
        K = p.shape[-1]
        f = f[:, :K]
        above = np.arange(CONF_BINS)[None, :] >= np.asarray(thresholds)[:, None]  # [T, B]
        mass = np.einsum("rkb,tb->rtk", f, above.astype(float))  # q
        fg = f * g[:, None, :]
        hit = np.einsum("rkb,tb->rtk", fg, above.astype(float))
        scale = p[:, None, :] / np.maximum(hit[:, :1, :], 1e-9)
        r = np.clip(hit * scale, 0.0, 1.0)
        return r, np.clip(mass, 0.0, 1.0)
