"""A policy that keeps a joint plan (an arm per class) and refreshes it every so often.

The plan comes from ``Planner`` (the steady-state goodput of the queue the arms build), fed
by each class's curves: what its arms emit, verify and draft. Subclasses say where the
curves come from (posterior draws: ``ModelBasedThompson``; the truth: ``PlannerOracle``).
Deciding is then a lookup, and planning happens once per ``replan_s`` seconds or
``replan_steps`` observed steps (or when a class appears, or a class's steps stray from
what its arm should emit): the steady state moves with demand, which moves over seconds,
not steps, and a plan costs a few milliseconds.
"""
from __future__ import annotations

import numpy as np

from adaptspec.control.acceptance import arm_curves, tpot_spread
from adaptspec.control.base import Clock, Policy, PolicyConfig
from adaptspec.control.planner import ClassCurves, PlanInputs, Planner
from adaptspec.control.types import Arm, Load, StepOutcome


SURPRISE = 0.25  # relative gap between seen and expected tokens per request-step that triggers a plan
SURPRISE_WEIGHT = 0.2  # smoothing of the seen value (about five steps)


class PlanningPolicy(Policy):
    def __init__(self, config: PolicyConfig | None, *, margin: float, headroom: float, replan_s: float,
                 spread_z: float, short_tokens: float, demand_half_life_s: float, clock: Clock) -> None:
        super().__init__(config, clock=clock)
        if not replan_s > 0:
            raise ValueError(f"replan_s: must be > 0, got {replan_s}")
        if not headroom >= 1.0:
            raise ValueError(f"headroom: must be >= 1, got {headroom}")
        self.planner = Planner(self.table, self.targets, margin, headroom, self.config.max_num_seqs,
                               self.config.max_batched_tokens)
        self.picture.half_life_s = demand_half_life_s
        self.replan_s, self.spread_z, self.short_tokens = replan_s, spread_z, short_tokens
        self.replan_steps = 10**9  # plan at least every this many observed steps (as well as every replan_s)
        self._steps_since = 0
        self.plan: dict[str, Arm] = {}
        self.plans = 0
        self.explore = 0.0  # share of steps that try every class's arm one k up or down
        self._dither = 0  # this step's: 0, +1 or -1
        self.capacity = np.inf  # the plan's capacity / demand seen, at the last plan (see Planner)
        self._busy_s = 0.0  # seconds of observed steps
        self._steps_seen = 0  # observed steps
        self._planned_at = -np.inf
        self._changed_at = -np.inf  # busy seconds when the plan last changed (see ``Planner.calibration``)
        self._backlog = False
        self._drafters = [d for d in self.config.drafters if d != "none"]
        self._tbins = self.table.threshold_bins
        self._expected: dict[str, tuple[Arm, float, float]] = {}  # class -> (arm, expected, seen) emitted per step

    # ---- what subclasses provide ----------------------------------------------------------
    def _acceptance(self, request_class: str, sample: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(r [D, T + 1, K], q [D, T + 1, K] or None, ready [D] bool) for the class: the
        chance each position is drafted-and-accepted / drafted, per threshold row (row 0:
        no threshold, q = 1), and which drafters' threshold rows may be used."""
        raise NotImplementedError

    def _cost(self):
        raise NotImplementedError

    # ---- planning -------------------------------------------------------------------------
    def curves(self, classes: list[str], sample: bool = False) -> ClassCurves:
        """Every class's arms at once (a posterior draw per class when ``sample``)."""
        t = self.table
        acc = [self._acceptance(c, sample) for c in classes]
        r = np.stack([a[0] for a in acc])  # [C, D, T + 1, K]
        q = None if acc[0][1] is None else np.stack([a[1] for a in acc])
        L, m, reach = arm_curves(r, q)  # [C, D, T + 1, K + 1], ..., [C, D, T + 1, K + 1, K]
        Lt = L
        targeted = np.array([c in self.targets for c in classes])
        if self.spread_z > 0 and targeted.any():
            Lt = np.where(targeted[:, None, None, None],
                          np.maximum(L - tpot_spread(r, self.spread_z, self.short_tokens), 1.0), L)
        fill = np.array([[self.picture.classes[c].fill(d) if c in self.picture.classes else 1.0 for d in self._drafters]
                         for c in classes])  # [C, D]
        m = m * fill[:, :, None, None]
        usable = np.ones((len(classes), len(t.arms)), dtype=bool)
        if len(t.thresholds):
            for i, a in enumerate(acc):
                for d, ok in enumerate(a[2]):
                    if not ok:
                        usable[i] &= ~((t.drafter_row == d) & (t.thr_row > 0))
        return ClassCurves(t.per_arm(L, 1.0), t.per_arm(Lt, 1.0), 1.0 + t.per_arm(m, 0.0),
                           t.per_arm(reach, 0.0, trailing=1) * t.is_draft[:, None], usable)

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self._choose_many([request_class], load)[0]

    def _choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        backlog = load.queued > 0
        due = (self._busy_s - self._planned_at >= self.replan_s or self._steps_since >= self.replan_steps
               or backlog != self._backlog or any(c not in self.plan for c in classes))
        if due:
            self._replan(classes, backlog)
        arms = [self.plan[c] for c in classes]
        d = self._dither
        if d:
            arms = [Arm(a.drafter, a.k + d, a.min_confidence) if a.k and 1 <= a.k + d <= self.config.max_k else a
                    for a in arms]
        return arms

    def _replan(self, deciding: list[str], backlog: bool) -> None:
        live = [c for c, s in self.picture.classes.items() if s.tokens > 0 and c not in deciding]
        classes = list(deciding) + live
        x = PlanInputs(classes, self.curves(classes, sample=True),
                       np.array([self.picture.demand(c) for c in classes]), self.picture.prefill_rate,
                       self.picture.prefill_share, self.picture.context_per_request, backlog,
                       self.picture.in_system if all(c in self.plan for c in classes) else 0.0,
                       np.array([self.picture.batch(c) for c in classes]), self.picture.prefill_per_step,
                       self.picture.chunk_rate, self.picture.chunk_tokens,
                       # the batch seen is the plan in force's once it has held for the picture's
                       # half-life; until then capacities keep the last calibration
                       None if self._busy_s - self._changed_at >= self.picture.half_life_s
                       else self.planner.last_scale)
        current = np.array([self.table.index(self.plan.get(c, self.picture.classes[c].arm
                                                           if c in self.picture.classes else self.table.arms[0]))
                            for c in classes])
        cost = self._cost()
        idx = self.planner.plan(x, cost, current)
        self.capacity = self.planner.last_capacity
        if any(self.plan.get(c) != self.table.arms[i] for c, i in zip(classes, idx)):
            self._changed_at = self._busy_s
        self.plan.update((c, self.table.arms[i]) for c, i in zip(classes, idx))
        # what each class's new arm should emit per request-step, by the draw the plan was made with
        for j, (c, i) in enumerate(zip(classes, idx)):
            L = float(x.curves.lengths[j, i])
            self._expected[c] = (self.table.arms[i], L, L)
        self._planned_at = self._busy_s
        self._steps_since = 0
        self._backlog = backlog
        self.plans += 1

    def observe(self, outcome: StepOutcome) -> None:
        self._busy_s += outcome.wall_s
        self._steps_since += 1
        self._steps_seen += 1
        super().observe(outcome)
        # now and then a step with every class one k up (or down) together: the step-cost
        # model learns only the step shapes it sees, and a plan held for many steps shows it
        # one; moving all classes shows it the whole step a joint change would make
        self._dither = 0
        if self.explore > 0 and self.rng.random() < self.explore:
            self._dither = 1 if self.rng.random() < 0.5 else -1
        # a plan rests on what each class's arm was expected to emit: when a class's steps
        # drift well away from it (its acceptance changed), plan again now, not at replan_s
        for g in outcome.groups:
            exp = self._expected.get(g.request_class)
            if exp is None or g.arm != exp[0] or g.num_requests == 0:
                continue
            seen = exp[2] + SURPRISE_WEIGHT * (g.emitted / g.num_requests - exp[2])
            self._expected[g.request_class] = (exp[0], exp[1], seen)
            if abs(seen - exp[1]) > SURPRISE * exp[1]:
                self._planned_at = -np.inf
