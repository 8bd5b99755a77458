"""Model-based discounted Thompson sampling with an online step-cost model."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from adaptspec.control.acceptance import DiscountedBeta
from adaptspec.control.base import Clock, PolicyConfig, draft_positions
from adaptspec.control.confidence import ConfidenceModel
from adaptspec.control.costmodel import OnlineStepCost, StepCostModel
from adaptspec.control.planning import PlanningPolicy
from adaptspec.control.types import StepOutcome


POSITION_CORRELATION = 0.8  # of a posterior draw across a drafter's positions (see _acceptance)


@dataclass(slots=True)
class ThompsonConfig:
    discount: float = 0.995  # acceptance posteriors: per observed step of the drafter that ran it
    cost_discount: float = 0.998  # per observed step, the step-cost regression
    margin: float = 0.9  # keep predicted TPOT within margin * target
    # budget TPOT with the accepted length a short request (short_tokens) reaches at z
    # standard errors below the mean (see acceptance.tpot_length_curve); 0: the mean
    spread_z: float = 1.0
    short_tokens: float = 64.0
    # every class's acceptance evidence (every drafter's) keeps half its weight beyond the
    # prior per this many seconds of steps (the steps' own durations: simulated time in the
    # simulator, busy time live), so a drafter that lost is tried again after a while; None:
    # only the per-step discount of the drafter that ran (a drafter that lost is never retried)
    fade_half_life_s: float | None = 60.0
    headroom: float = 1.25  # capacity sought beyond today's demand (see planner)
    replan_s: float = 0.5  # seconds of steps between plans (each one posterior draw)
    # ... or this many steps, whichever comes first: a plan is one posterior draw, and
    # exploring a drafter nobody tried yet takes a good draw, so draws must not be rare
    replan_steps: int = 16
    demand_half_life_s: float = 4.0  # how fast the picture of each class's demand forgets
    explore: float = 0.05  # share of steps that try every class one k up or down (cost-model coverage)


class ModelBasedThompson(PlanningPolicy):
    """Per (class, drafter): discounted Beta posteriors of per-position acceptance (and, with
    confidence thresholds, the calibration of draft confidences).

    Every ``replan_s`` seconds of steps it draws once from every class's posteriors, turns
    the draws into what each arm emits and verifies, and plans every class's arm jointly
    with the online step-cost model for the steady-state goodput (see ``Planner``); between
    plans a decision is a lookup.
    """

    name = "thompson"

    def __init__(
        self,
        config: PolicyConfig | None = None,
        ts: ThompsonConfig | None = None,
        *,
        prior_cost: StepCostModel | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        ts = ts or ThompsonConfig()
        super().__init__(config, margin=ts.margin, headroom=ts.headroom, replan_s=ts.replan_s, spread_z=ts.spread_z,
                         short_tokens=ts.short_tokens, demand_half_life_s=ts.demand_half_life_s, clock=clock)
        self.ts = ts
        if not 0.0 <= ts.explore < 1.0:
            raise ValueError(f"explore: must be in [0, 1), got {ts.explore}")
        self.explore = ts.explore
        if ts.replan_steps < 1:
            raise ValueError(f"replan_steps: must be >= 1, got {ts.replan_steps}")
        self.replan_steps = ts.replan_steps
        self.cost = OnlineStepCost(discount=self.ts.cost_discount)
        if prior_cost is not None:
            self.cost.seed_from(prior_cost, max_k=self.config.max_k)
        self.posteriors: dict[str, DiscountedBeta] = {}
        self.confidence: dict[str, ConfidenceModel] = {}
        self._row = {d: i for i, d in enumerate(self._drafters)}
        if self.ts.fade_half_life_s is not None and not self.ts.fade_half_life_s > 0:
            raise ValueError(f"fade_half_life_s: must be > 0 (or None: no fading), got {self.ts.fade_half_life_s}")
        self._faded_at: dict[str, float] = {}  # per class: _busy_s its posterior was last faded to

    def _posterior(self, request_class: str) -> DiscountedBeta:
        post = self.posteriors.get(request_class)
        if post is None:
            post = self.posteriors[request_class] = DiscountedBeta(
                self.config.max_k, len(self._drafters), self.ts.discount)
            if self.table.thresholds:
                self.confidence[request_class] = ConfidenceModel(self.config.max_k, len(self._drafters), self.ts.discount)
            self._faded_at[request_class] = self._busy_s
        elif self.ts.fade_half_life_s is not None:  # lazily: on the class's next update or read
            dt = self._busy_s - self._faded_at[request_class]
            if dt > 0:
                f = 0.5 ** (dt / self.ts.fade_half_life_s)
                post.fade(f)
                conf = self.confidence.get(request_class)
                if conf is not None:
                    conf.fade(f)
                self._faded_at[request_class] = self._busy_s
        return post

    def _acceptance(self, request_class: str, sample: bool):
        post = self._posterior(request_class)
        D, K = len(self._drafters), self.config.max_k
        m, sd = post.moments()
        if sample:
            # one draw per drafter shared by its positions, plus a part of each position's own:
            # a drafter's positions rise and fall together (a good draft is good at every
            # position), and independent draws almost never make an untried or faded drafter
            # look good at all of them at once, so it would hardly ever be explored
            z = POSITION_CORRELATION * self.rng.standard_normal((D, 1)) + \
                np.sqrt(1 - POSITION_CORRELATION ** 2) * self.rng.standard_normal((D, K))
            p = np.clip(m + sd * z, 1e-4, 1 - 1e-4)
        else:
            p = m
        T = len(self.table.thresholds) + 1
        conf = self.confidence.get(request_class)
        if conf is None:
            return p[:, None, :].repeat(T, axis=1), None, np.zeros(D, dtype=bool)
        g = conf.calibration(self.rng.standard_normal(conf.acc.shape) if sample else None)
        r, q = conf.curves(p, self._tbins, g)
        r[:, 0], q[:, 0] = p, 1.0
        return r, q, conf.ready()

    def _cost(self):
        return self.cost

    def _observe(self, outcome: StepOutcome) -> None:
        for g in outcome.groups:
            if g.arm.k > 0 and g.arm.drafter in self._row:
                row = self._row[g.arm.drafter]
                self._posterior(g.request_class).update(g.accepted_hist, row, g.drafted_accepted)
                if g.confidence is not None and g.request_class in self.confidence:
                    self.confidence[g.request_class].update(g.confidence, row)
        n_dec = sum(g.num_requests for g in outcome.groups)
        batch, ngram = draft_positions(outcome, self.config.max_k)
        self.cost.observe(outcome, batch, ngram, outcome.context_tokens / max(n_dec, 1))

    def describe_targets(self) -> str:
        return ("plans every class's arm jointly for the steady state the arms reach (the queue they build): a "
                f"capacity of {self.ts.headroom:g} x the demand seen, TPOT within {self.ts.margin:g} x target for "
                "every TPOT class, then the fewest requests in the system; capacity alone while requests queue")
