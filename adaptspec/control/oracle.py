"""The planner fed with the true acceptance and cost models (``PlannerOracle``).

It sees demand and the batch as every policy does (from the observed steps) and plans with
the same objective as the model-based policy, so it is the ceiling of what that policy's
models can reach, not an upper bound on what any policy can: the simulator's ``oracle``
(``adaptspec.sim.lookahead``) searches joint arms against the simulator itself.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from adaptspec.control.base import Clock, PolicyConfig
from adaptspec.control.costmodel import StepCostModel
from adaptspec.control.planning import PlanningPolicy

# (request_class, drafter) -> [max_k] true conditional acceptance per position
AcceptanceTruth = Callable[[str, str], np.ndarray]
# (request_class, drafter, threshold bins [T + 1]) -> (r, q) [T + 1, max_k], or None: no
# confidences (see adaptspec.control.confidence for r and q)
ConfidenceTruth = Callable[[str, str, np.ndarray], "tuple[np.ndarray, np.ndarray] | None"]


class PlannerOracle(PlanningPolicy):
    name = "oracle-planner"

    def __init__(self, acceptance: AcceptanceTruth, cost: StepCostModel, config: PolicyConfig | None = None,
                 *, confidence: ConfidenceTruth | None = None, margin: float = 0.9, headroom: float = 1.25,
                 replan_s: float = 0.5, spread_z: float = 1.0, short_tokens: float = 64.0,
                 demand_half_life_s: float = 4.0, clock: Clock = time.perf_counter) -> None:
        super().__init__(config, margin=margin, headroom=headroom, replan_s=replan_s, spread_z=spread_z,
                         short_tokens=short_tokens, demand_half_life_s=demand_half_life_s, clock=clock)
        self.truth, self.conf_truth, self.cost = acceptance, confidence, cost
        self._cache: dict[str, tuple] = {}

    def invalidate(self) -> None:
        """Forget cached truths (the simulator calls this when a class's acceptance shifts)."""
        self._cache.clear()
        self._planned_at = -np.inf

    def _acceptance(self, request_class: str, sample: bool):
        out = self._cache.get(request_class)
        if out is None:
            K, T = self.config.max_k, len(self.table.thresholds) + 1
            rs, qs, ready = [], [], []
            for d in self._drafters:
                p = np.asarray(self.truth(request_class, d), dtype=float)[:K]
                rq = self.conf_truth(request_class, d, self._tbins) if self.conf_truth is not None and T > 1 else None
                if rq is None:
                    rs.append(np.repeat(p[None, :], T, axis=0))
                    qs.append(np.ones((T, K)))
                    ready.append(False)
                else:
                    rs.append(np.asarray(rq[0])[:, :K])
                    qs.append(np.asarray(rq[1])[:, :K])
                    ready.append(True)
            out = self._cache[request_class] = (np.stack(rs), np.stack(qs) if T > 1 else None, np.array(ready))
        return out

    def _cost(self):
        return self.cost

    def describe_targets(self) -> str:
        return "the model-based policy's planner fed the true acceptance and cost models"
