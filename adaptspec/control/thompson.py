"""Model-based discounted Thompson sampling with an online step-cost model."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptspec.control.acceptance import DiscountedBeta, tpot_spread
from adaptspec.control.base import Clock, Policy, PolicyConfig, draft_positions
from adaptspec.control.costmodel import OnlineStepCost, StepCostModel
from adaptspec.control.planner import Planner
from adaptspec.control.types import Arm, Load, StepOutcome

import time


@dataclass(slots=True)
class ThompsonConfig:
    discount: float = 0.995  # acceptance posteriors: per observed step of the drafter that ran it
    cost_discount: float = 0.998  # per observed step, the step-cost regression
    margin: float = 0.9  # keep predicted TPOT within margin * target
    # budget TPOT with the accepted length a short request (short_tokens) reaches at z
    # standard errors below the mean (see acceptance.tpot_length_curve); 0: the mean
    spread_z: float = 2.0
    short_tokens: float = 64.0
    # every class's acceptance evidence (every drafter's) keeps half its weight beyond the
    # prior per this many seconds of steps (the steps' own durations: simulated time in the
    # simulator, busy time live), so a drafter that lost is tried again after a while; None:
    # only the per-step discount of the drafter that ran (a drafter that lost is never retried)
    fade_half_life_s: float | None = 60.0


class ModelBasedThompson(Policy):
    """Per (class, drafter): discounted Beta posteriors of per-position acceptance.

    Each decision samples the posteriors, turns them into the expected accepted length of
    every arm, predicts every arm's step time with the online cost model (the class's arm
    changes the whole batch's step), and takes the arm with the highest sampled goodput that
    keeps every latency class within its TPOT target (see ``Planner``).
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
        super().__init__(config, clock=clock)
        self.ts = ts or ThompsonConfig()
        self.cost = OnlineStepCost(discount=self.ts.cost_discount)
        if prior_cost is not None:
            self.cost.seed_from(prior_cost, max_k=self.config.max_k)
        self.planner = Planner(self.table, self.targets, self.ts.margin)
        self.posteriors: dict[str, DiscountedBeta] = {}
        self._drafters = [d for d in self.config.drafters if d != "none"]
        self._row = {d: i for i, d in enumerate(self._drafters)}
        self._moments: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._observed = 0
        self._mean_curves: dict[str, np.ndarray] = {}  # posterior-mean lengths, per observed step
        self._spreads: dict[str, np.ndarray] = {}  # TPOT spreads (see _spread), refreshed with them
        self._others: dict[str, float] = {}
        self._others_budget: dict[str, float] = {}
        self._others_version = -(10**9)
        self._z = np.zeros(0)
        self._zpos = 0
        self._stacked: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}  # moments of class lists
        self._stacked_spreads: dict[tuple[str, ...], np.ndarray | None] = {}
        self._no_spread = np.zeros(len(self.table.arms))
        self._len_buf: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        if self.ts.fade_half_life_s is not None and not self.ts.fade_half_life_s > 0:
            raise ValueError(f"fade_half_life_s: must be > 0 (or None: no fading), got {self.ts.fade_half_life_s}")
        self._busy_s = 0.0  # seconds of observed steps
        self._faded_at: dict[str, float] = {}  # per class: _busy_s its posterior was last faded to

    def _posterior(self, request_class: str) -> DiscountedBeta:
        post = self.posteriors.get(request_class)
        if post is None:
            post = self.posteriors[request_class] = DiscountedBeta(
                self.config.max_k, len(self._drafters), self.ts.discount)
            self._faded_at[request_class] = self._busy_s
        elif self.ts.fade_half_life_s is not None:  # lazily: on the class's next update or read
            dt = self._busy_s - self._faded_at[request_class]
            if dt > 0:
                post.fade(0.5 ** (dt / self.ts.fade_half_life_s))
                self._faded_at[request_class] = self._busy_s
        return post

    def _moments_of(self, request_class: str) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and sd [drafters, max_k], refreshed with the other caches."""
        mom = self._moments.get(request_class)
        if mom is None:
            mom = self._moments[request_class] = self._posterior(request_class).moments()
        return mom

    def _lengths(self, request_class: str, sample: bool) -> np.ndarray:
        """[A] expected accepted length of every arm in the table (rows follow the table):
        from a posterior draw, or from the posterior mean."""
        if sample:
            return self._sampled_lengths([request_class])[0]
        return self._table_lengths(self._moments_of(request_class)[0])

    def _table_lengths(self, p: np.ndarray) -> np.ndarray:
        """[..., drafters, max_k] per-position acceptance -> [..., A] accepted length per arm."""
        buf = self._len_buf.get(p.shape)
        if buf is None:  # column 0 (no speculation) stays 0; the rest is overwritten every call
            acc = np.zeros(p.shape[:-2] + (len(self.table.arms),))
            buf = self._len_buf[p.shape] = (acc, acc[..., 1:].reshape(p.shape))
        # the ufuncs' accumulate, not np.cumsum / np.cumprod: the same loops without ~2 us of wrapper each
        np.add.accumulate(np.multiply.accumulate(p, axis=-1), axis=-1, out=buf[1])
        return buf[0] + 1.0

    def _sampled_lengths(self, classes: list[str]) -> np.ndarray:
        """[C, A] accepted lengths from one posterior draw per class (normals drawn class by
        class from the seeded stream, so a class's draw does not depend on who else decides)."""
        R, K = len(self._drafters), self.config.max_k
        key = tuple(classes)
        mom = self._stacked.get(key)
        if mom is None:
            m = [self._moments_of(c) for c in classes]
            mom = self._stacked[key] = (np.stack([x[0] for x in m]), np.stack([x[1] for x in m]))
        n, C = R * K, len(classes)
        if self._zpos + C * n <= self._z.size:  # the same normals as C draws of n, as one view
            self._zpos += C * n
            z = self._z[self._zpos - C * n: self._zpos].reshape(C, R, K)
        else:
            z = np.empty((C, R, K))
            for i in range(C):
                z[i] = self._normals(n).reshape(R, K)
        return self._table_lengths(DiscountedBeta.sample_from(mom, z))

    def _spread(self, request_class: str) -> np.ndarray:
        """[A] how far below an arm's accepted length its TPOT budget is taken (z standard
        errors of a short request's mean, ``acceptance.tpot_spread``), from the posterior
        mean; refreshed with the moments."""
        sp = self._spreads.get(request_class)
        return sp if sp is not None else self._compute_spreads([request_class])[0]

    def _compute_spreads(self, classes: list[str]) -> list[np.ndarray]:
        """``_spread`` of several classes in one pass over their stacked posterior means."""
        sp = tpot_spread(np.stack([self._moments_of(c)[0] for c in classes]), self.ts.spread_z, self.ts.short_tokens)
        out = []
        for c, row in zip(classes, sp):
            arr = np.zeros(len(self.table.arms))
            arr[1:] = row[:, 1:].reshape(-1)
            out.append(self._spreads.setdefault(c, arr))
        return out

    def _stacked_spread(self, classes: list[str]) -> np.ndarray | None:
        """[C, A] ``_spread`` of each class (None when no class has a target or z is 0); rows
        of classes without a target are never read (the planner has no TPOT to budget)."""
        key = tuple(classes)
        if key not in self._stacked_spreads:
            sp = None
            if self.ts.spread_z > 0 and any(c in self.targets for c in classes):
                missing = [c for c in classes if c in self.targets and c not in self._spreads]
                if missing:
                    self._compute_spreads(missing)
                sp = np.stack([self._spreads[c] if c in self.targets else self._no_spread for c in classes])
            self._stacked_spreads[key] = sp
        return self._stacked_spreads[key]

    def _normals(self, n: int) -> np.ndarray:
        """Standard normals drawn in blocks from the seeded generator (cheap per decision)."""
        if self._zpos + n > self._z.size:
            self._z = self.rng.standard_normal(8192)
            self._zpos = 0
        self._zpos += n
        return self._z[self._zpos - n: self._zpos]

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self._choose_many([request_class], load)[0]

    def _choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        L = self._sampled_lengths(classes)
        sp = self._stacked_spread(classes)
        L_t = None if sp is None else np.maximum(L - sp, 1.0)
        if self.picture.version - self._others_version >= 8:  # refreshed every 8 observed steps
            live = [(c, s.arm) for c, s in self.picture.classes.items() if s.share > 0]
            self._others = {c: self._mean_length(c, arm) for c, arm in live}
            self._others_budget = {c: self.table.budget_length(self._budget_curve(c), arm) for c, arm in live}
            self._others_version = self.picture.version
        idx = self.planner.plan_many(classes, load, self.picture, L, self._others, self.cost, self._others_budget, L_t)
        return [self.table.arms[i] for i in idx]

    def _budget_curve(self, request_class: str) -> np.ndarray:
        """[A] posterior-mean accepted lengths a class's TPOT budget on the others uses."""
        if self.ts.spread_z <= 0 or request_class not in self.targets:
            return self._mean_curve(request_class)
        return np.maximum(self._mean_curve(request_class) - self._spread(request_class), 1.0)

    def _mean_curve(self, request_class: str) -> np.ndarray:
        curve = self._mean_curves.get(request_class)
        if curve is None:
            curve = self._mean_curves[request_class] = self._lengths(request_class, sample=False)
        return curve

    def _mean_length(self, request_class: str, arm: Arm) -> float:
        return float(self._mean_curve(request_class)[self.table.index(arm)])

    def _observe(self, outcome: StepOutcome) -> None:
        self._observed += 1
        self._busy_s += outcome.wall_s
        if self._observed % 4 == 0:  # posterior moments move slowly: refresh every 4 steps
            self._mean_curves.clear()
            self._moments.clear()
            self._stacked.clear()
            self._spreads.clear()
            self._stacked_spreads.clear()
        for g in outcome.groups:
            if g.arm.k > 0 and g.arm.drafter in self._row:
                self._posterior(g.request_class).update(g.accepted_hist, self._row[g.arm.drafter])
        n_dec = sum(g.num_requests for g in outcome.groups)
        batch, ngram = draft_positions(outcome, self.config.max_k)
        self.cost.observe(outcome, batch, ngram, outcome.context_tokens / max(n_dec, 1))

    def describe_targets(self) -> str:
        return ("predicts each arm's TPOT (step time / accepted length) from its models and keeps every "
                f"TPOT class within {self.ts.margin:g} x target; the rest of the step goes to throughput; "
                "when no arm can, takes the arm closest to the targets unless requests wait for admission")
