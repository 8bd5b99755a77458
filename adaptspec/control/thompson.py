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
from adaptspec.control.types import GroupOutcome, StepOutcome


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
    # only the per-step discount of the drafter that ran (a drafter that lost is never retried).
    # One plan's try of a drafter at a large batch holds a hundred or more request-steps of
    # evidence, and a draw makes it look good again only once that has faded to a handful, about
    # log2(100 / 5) half-lives later: the half-life sets how long a drafter that turned good waits
    # (simulations/draft_recovers.yaml). The service config and the scenario schema repeat these
    # two defaults without importing this module (tests/unit/test_serve_config.py keeps them equal)
    fade_half_life_s: float | None = 30.0
    # ... but never faster than half per this many observed steps: where a step takes seconds
    # (a CPU replica, a loaded one) 30 s is a few dozen steps, the posteriors never hold more
    # than that, and every plan's draw scatters the classes over arms that differ by noise
    fade_min_steps: int = 500
    headroom: float = 1.25  # capacity sought beyond today's demand (see planner)
    replan_s: float = 0.5  # seconds of steps between plans (each one posterior draw)
    # ... or this many steps, whichever comes first: a plan is one posterior draw, and
    # exploring a drafter nobody tried yet takes a good draw, so draws must not be rare
    replan_steps: int = 16
    demand_half_life_s: float = 4.0  # how fast the picture of each class's demand forgets
    explore: float = 0.05  # share of steps that try every class one k up or down (cost-model coverage)
    # acceptance at a position not yet reached: this many pseudo-counts at the mean of the position
    # before (see DiscountedBeta.carry); 0: Beta(1, 1) at every position, where a class whose first
    # position rarely accepts kept drawing long k as half-accepted at depth
    carry: float = 4.0


def proposal_counts(g: GroupOutcome, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position i = 1..k (the arm's k, at most ``max_k``), of the group's request-steps
    that reached it (kept the i - 1 before it): those that proposed a candidate there, and
    those that had proposed no more (``H[i-1, i-1]``; none when the group reports no
    ``drafted_accepted``: every request proposed all k).

    Conditional on reaching i, not on proposing i - 1: an n-gram match that is being accepted
    tends to run on, so the rate among requests that got this far is higher than among all
    that proposed i - 1; times the censored acceptance of a proposed candidate it gives the
    chance of accepting i given i - 1 was accepted.
    """
    k = min(g.arm.k, max_k)
    if g.drafted_accepted is None:
        h = g.accepted_hist[: k + 1].astype(float)
        reached = np.add.accumulate(h[::-1])[::-1][:k]  # accepted >= i - 1, for i = 1..k
        return reached, np.zeros(k)
    H = g.drafted_accepted[: k + 1, : k + 1]  # a group's matrix may be sized for a larger k
    # kept_ge[m, i]: requests that proposed m and kept >= i; reaching i + 1 is kept >= i
    kept_ge = np.add.accumulate(H[:, ::-1], axis=1)[:, ::-1]
    fail = np.diagonal(H)[:k].astype(float)  # proposed exactly i - 1 and kept all of them
    reached = kept_ge[:, :k].sum(axis=0).astype(float)
    return reached - fail, fail


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
        if not ts.carry >= 0:
            raise ValueError(f"carry: must be >= 0, got {ts.carry}")
        if ts.replan_steps < 1:
            raise ValueError(f"replan_steps: must be >= 1, got {ts.replan_steps}")
        self.replan_steps = ts.replan_steps
        self.cost = OnlineStepCost(discount=self.ts.cost_discount)
        if prior_cost is not None:
            self.cost.seed_from(prior_cost, max_k=self.config.max_k)
        self.posteriors: dict[str, DiscountedBeta] = {}
        # per class, per (drafter, position): the chance a candidate is proposed there given
        # the request got there (n-gram lookup proposes nothing when the context has no match).
        # The acceptance posteriors are of proposed candidates (a request that proposed m < k
        # is censored at m), so an arm emits what both allow. Prior Beta(1, 0): every
        # candidate is there until a step says otherwise (a drafter that always proposes, or a
        # source that reports no proposal counts, keeps a factor of exactly 1)
        self.proposal: dict[str, DiscountedBeta] = {}
        self.confidence: dict[str, ConfidenceModel] = {}
        self._row = {d: i for i, d in enumerate(self._drafters)}
        if self.ts.fade_half_life_s is not None and not self.ts.fade_half_life_s > 0:
            raise ValueError(f"fade_half_life_s: must be > 0 (or None: no fading), got {self.ts.fade_half_life_s}")
        if not self.ts.fade_min_steps >= 1:
            raise ValueError(f"fade_min_steps: must be >= 1, got {self.ts.fade_min_steps}")
        # per class: (_busy_s, _steps_seen) its posterior was last faded to
        self._faded_at: dict[str, tuple[float, int]] = {}

    def _posterior(self, request_class: str) -> DiscountedBeta:
        post = self.posteriors.get(request_class)
        if post is None:
            post = self.posteriors[request_class] = DiscountedBeta(
                self.config.max_k, len(self._drafters), self.ts.discount, carry=self.ts.carry)
            if self.table.thresholds:
                self.confidence[request_class] = ConfidenceModel(self.config.max_k, len(self._drafters), self.ts.discount)
            self.proposal[request_class] = DiscountedBeta(self.config.max_k, len(self._drafters), self.ts.discount,
                                                          prior_a=1.0, prior_b=0.0)
            self._faded_at[request_class] = (self._busy_s, self._steps_seen)
        elif self.ts.fade_half_life_s is not None:  # lazily: on the class's next update or read
            t0, n0 = self._faded_at[request_class]
            dt, dn = self._busy_s - t0, self._steps_seen - n0
            if dt > 0 and dn > 0:
                f = 0.5 ** min(dt / self.ts.fade_half_life_s, dn / self.ts.fade_min_steps)
                post.fade(f)
                self.proposal[request_class].fade(f)
                conf = self.confidence.get(request_class)
                if conf is not None:
                    conf.fade(f)
                self._faded_at[request_class] = (self._busy_s, self._steps_seen)
        return post

    def learned_acceptance(self, request_class: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per drafter, what the policy believes of a class (for diagnostics, read as it stands,
        without fading): [max_k] the chance each position's candidate is proposed and accepted
        given the ones before (posterior mean x proposal rate), and [max_k] the evidence behind it
        (the posterior's pseudo-counts). Empty for a class not seen yet."""
        post, prop = self.posteriors.get(request_class), self.proposal.get(request_class)
        if post is None:
            return {}
        out = {}
        mean = post.moments()[0]
        for d, row in self._row.items():
            acc = mean[row]
            if prop is not None:
                acc = acc * prop.a[row] / (prop.a[row] + prop.b[row])
            out[d] = (acc, post.a[row] + post.b[row])
        return out

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
        # proposed-and-accepted: the proposal rate's mean (not a draw: it is measured on every
        # request-step of the drafter, far tighter than acceptance, which is censored)
        p = p * self.proposal[request_class].mean()
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
                # a confidence threshold's stops are the confidence model's (its q), not missing
                # proposals: only arms without one teach the proposal rate
                if not g.arm.min_confidence:
                    self.proposal[g.request_class].update_counts(*proposal_counts(g, self.config.max_k), row)
                if g.confidence is not None and g.request_class in self.confidence:
                    self.confidence[g.request_class].update(g.confidence, row)
        n_dec = sum(g.num_requests for g in outcome.groups)
        batch, ngram = draft_positions(outcome, self.config.max_k)
        self.cost.observe(outcome, batch, ngram, outcome.context_tokens / max(n_dec, 1))

    def describe_targets(self) -> str:
        return ("plans every class's arm jointly for the steady state the arms reach (the queue they build): a "
                f"capacity of {self.ts.headroom:g} x the demand seen, TPOT within {self.ts.margin:g} x target for "
                "every TPOT class, then the fewest requests in the system; capacity alone while requests queue")
