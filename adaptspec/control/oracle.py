"""The oracle: the planner fed with the true acceptance and cost models (the ceiling)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from adaptspec.control.acceptance import accepted_length_curve, tpot_length_curve
from adaptspec.control.base import Clock, Policy, PolicyConfig
from adaptspec.control.costmodel import StepCostModel
from adaptspec.control.planner import Planner
from adaptspec.control.types import Arm, Load

# (request_class, drafter) -> [max_k] true conditional acceptance per position
AcceptanceTruth = Callable[[str, str], np.ndarray]


class OraclePolicy(Policy):
    """Knows the true per-position acceptance of every (class, drafter) and the true step
    cost; sees the batch as every policy does (from the last observed step) and plans with
    the same goodput objective and TPOT constraints as the model-based policy."""

    name = "oracle"

    def __init__(self, acceptance: AcceptanceTruth, cost: StepCostModel, config: PolicyConfig | None = None,
                 *, margin: float = 0.9, spread_z: float = 2.0, short_tokens: float = 64.0,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.truth = acceptance
        self.cost = cost
        self.planner = Planner(self.table, self.targets, margin)
        self.spread_z, self.short_tokens = spread_z, short_tokens
        self._lengths: dict[tuple[str, bool], np.ndarray] = {}
        self._stacked: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}  # lengths of class lists

    def lengths(self, request_class: str, tpot: bool = False) -> np.ndarray:
        """[A] true expected accepted length per arm; ``tpot``: the length its TPOT is
        budgeted with (``acceptance.tpot_length_curve``)."""
        L = self._lengths.get((request_class, tpot))
        if L is None:
            parts = [np.ones(1)]
            for d in self.config.drafters:
                if d != "none":
                    p = np.asarray(self.truth(request_class, d))[: self.config.max_k]
                    curve = tpot_length_curve(p, self.spread_z, self.short_tokens) if tpot else accepted_length_curve(p)
                    parts.append(curve[1:])
            L = self._lengths[(request_class, tpot)] = np.concatenate(parts)
        return L

    def invalidate(self) -> None:
        """Forget cached truths (the simulator calls this when a class's acceptance shifts)."""
        self._lengths.clear()
        self._stacked.clear()

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self._choose_many([request_class], load)[0]

    def _choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        live = [(c, s.arm) for c, s in self.picture.classes.items() if s.share > 0]
        others = {c: float(self.lengths(c)[self.table.index(arm)]) for c, arm in live}
        budget = {c: self.table.budget_length(self.lengths(c, tpot=True), arm) for c, arm in live}
        key = tuple(classes)
        L = self._stacked.get(key)
        if L is None:
            L = self._stacked[key] = (np.stack([self.lengths(c) for c in classes]),
                                      np.stack([self.lengths(c, tpot=True) for c in classes]))
        idx = self.planner.plan_many(classes, load, self.picture, L[0], others, self.cost, budget, L[1])
        return [self.table.arms[i] for i in idx]

    def describe_targets(self) -> str:
        return "as the model-based policy, with the true models"
