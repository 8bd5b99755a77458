"""The simulator's oracle: joint per-class arms searched against the simulator itself.

The oracle copies the whole run as it stands (queues, running requests, KV, the random
streams, the arrivals still to come: it knows the future) and plays candidate joint
assignments forward with the true acceptance and cost models. Candidates: the plan in
force; the steady-state planner's plan with the true models (``PlannerOracle``); every
static arm and per-class static assignment the scenario compares; and, for each class, the
arms next to its current one (k +- 1, no drafting, the next threshold).

At its first search it plays every candidate to the end of the run and takes the one under
which the most measured requests meet every SLO. Every ``epoch_s`` after that (while the
replica is stressed) it plays them for ``horizon_s`` and, if one beats the plan in force
there, plays that one to the end and switches only if the run then ends better than it will
under the plan in force. The random draws are common to the run and its copies, so the plan
in force plays out exactly as it was played forward when chosen: the run ends at least as
well as its first choice held throughout, which is at least as well as every static arm and
per-class static assignment of the scenario.
"""
from __future__ import annotations

import time

import numpy as np

from adaptspec.control import Arm, Load, PerClassStaticPolicy, Policy, PolicyConfig, StepOutcome
from adaptspec.control.base import Clock
from adaptspec.control.oracle import PlannerOracle
from adaptspec.sim.metrics import SLO
from adaptspec.sim.replica import Recorder


LIGHT = 1.3  # capacity / demand above which the oracle does not search (see _stressed)


class LookaheadOracle(Policy):
    name = "oracle"

    def __init__(self, guide: PlannerOracle, config: PolicyConfig, class_names: list[str], slos: list[SLO], *,
                 statics: list[dict[str, Arm]] = (), epoch_s: float = 5.0, horizon_s: float = 10.0,
                 window: tuple[float, float] = (0.0, np.inf), clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        if not 0 < epoch_s <= horizon_s:
            raise ValueError(f"epoch_s / horizon_s: need 0 < epoch_s <= horizon_s, got {epoch_s} / {horizon_s}")
        self.guide, self.class_names, self.slos = guide, list(class_names), slos
        self.statics = [dict(s) for s in statics]
        self.epoch_s, self.horizon_s = epoch_s, horizon_s
        self.plan: dict[str, Arm] = {}
        self.sim = None
        self._next = 0.0
        self.window = window  # arrivals measured for goodput: [warmup_s, duration_s)
        self._value: float | None = None  # the run's goodput if the plan in force is held to the end
        self._measured = np.zeros(0, dtype=np.int64)
        self.rollouts = 0
        self.searches = 0

    def bind(self, sim) -> None:
        """Called by ``simulate`` before the run: search between steps, from this run's state."""
        self.sim = sim
        sim.after_step = self._between_steps

    def _between_steps(self, sim) -> None:
        if sim.now >= self._next:
            self._next = sim.now + self.epoch_s
            if self._value is None or self._stressed(sim):
                self._search()

    def _stressed(self, sim) -> bool:
        """Worth a search: over a step's worth of prompt tokens waits, or the planner sees
        under ``LIGHT`` x the demand in capacity (under light load every candidate meets every
        SLO, and the planner's arms have the lowest latency)."""
        waiting = any(r.backlog_tokens() > r.max_tokens for r in sim.replicas)  # over a step of prompts waits
        return waiting or self.guide.capacity < LIGHT

    def _choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        missing = [c for c in classes if c not in self.plan]
        if missing:  # before the first search (or a class seen for the first time): the planner's arms
            self.plan.update(zip(missing, self.guide.choose_many(missing, load)))
        return [self.plan[c] for c in classes]

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self._choose_many([request_class], load)[0]

    def _observe(self, outcome: StepOutcome) -> None:
        self.guide.observe(outcome)

    def invalidate(self) -> None:
        self.guide.invalidate()

    # ---- the search -----------------------------------------------------------------------
    def _candidates(self) -> list[dict[str, Arm]]:
        classes = self.class_names
        current = {c: self.plan.get(c, self.table.arms[0]) for c in classes}
        guide = dict(zip(classes, self.guide.choose_many(classes, Load())))
        out = [guide, current]
        for s in self.statics:
            out.append({c: s.get(c, s.get("*", self.table.arms[0])) for c in classes})
        for c in classes:
            for arm in self._neighbours(current[c]):
                out.append({**current, c: arm})
        seen, unique = set(), []
        for cand in out:
            key = tuple(cand[c] for c in classes)
            if key not in seen:
                seen.add(key)
                unique.append(cand)
        return unique

    def _neighbours(self, arm: Arm) -> list[Arm]:
        t = self.table
        out = [t.arms[0]]
        drafters = [d for d in self.config.drafters if d != "none"]
        if arm.k == 0:
            return out + [Arm(d, 1) for d in drafters]
        for k in (arm.k - 1, arm.k + 1):
            if 1 <= k <= self.config.max_k:
                out.append(Arm(arm.drafter, k, arm.min_confidence))
        thr = (0.0,) + t.thresholds
        i = thr.index(arm.min_confidence) if arm.min_confidence in thr else 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(thr):
                out.append(Arm(arm.drafter, arm.k, thr[j]))
        return [a for a in out if a in t.positions or a.k == 0]

    def _rollout(self, cand: dict[str, Arm], until: float):
        sim, rec = self.sim, self.sim.rec
        scratch = Recorder(rec.num_requests, rec.num_classes, rec.arms, 1e9, 1)
        scratch.first_token_s[:] = rec.first_token_s
        scratch.finish_s[:] = rec.finish_s
        scratch.refused[:] = rec.refused
        run = sim.clone(PerClassStaticPolicy(cand, self.config), scratch)
        run.advance(until)
        self.rollouts += 1
        return run

    def _final(self, cand: dict[str, Arm]) -> float:
        """The run's goodput (requests meeting every SLO) if ``cand`` is held to the end."""
        run = self._rollout(cand, np.inf)
        return self._score(run, self._measured, final=True)

    def _search(self) -> None:
        sim = self.sim
        now = sim.now
        cands = self._candidates()  # [0] the planner's plan, [1] the plan in force, then the others
        if self._value is None:  # the first search: every candidate to the end of the run
            req = sim.setup.requests
            self._measured = np.flatnonzero((req.arrival_s >= self.window[0]) & (req.arrival_s < self.window[1]))
            values = [self._final(c) for c in cands]
            best = int(np.argmax(values))
            self.plan.update(cands[best])
            self._value = values[best]
            self.searches += 1
            return
        req, rec = sim.setup.requests, sim.rec
        relevant = (req.arrival_s < now + self.epoch_s) & ~(rec.finish_s < now) & ~rec.refused
        idx = np.flatnonzero(relevant)
        scores = [self._score(self._rollout(c, now + self.horizon_s), idx) for c in cands]
        key = tuple(self.plan.get(c) for c in self.class_names)
        current = next(j for j, c in enumerate(cands) if tuple(c[n] for n in self.class_names) == key)
        best = int(np.argmax(scores))
        if best != current and scores[best] > scores[current] + 1e-9:
            # switch only if holding the better plan to the end beats holding the current one
            # (whose end is known: with the same random draws it plays out as rolled out before)
            value = self._final(cands[best])
            if value > self._value + 1e-9:
                self.plan.update(cands[best])
                self._value = value
        self.searches += 1

    def _score(self, run, idx: np.ndarray, final: bool = False) -> float:
        """Requests of ``idx`` that met, or are on course to meet, every SLO at the end of the
        rollout (a request not started yet but still within its TTFT counts half; at the end
        of the run, ``final``, only those that met them)."""
        req, rec = run.setup.requests, run.rec
        t_end = run.now if run.done else max(run.now, self.sim.now + self.horizon_s)
        arr = req.arrival_s[idx]
        first, fin = rec.first_token_s[idx], rec.finish_s[idx]
        cls = req.class_idx[idx]
        out = req.output_tokens[idx]
        emitted = np.where(np.isnan(fin), 0, out).astype(float)
        # tokens so far of requests still running
        pos = {int(r): i for i, r in enumerate(idx)}
        for rep in run.replicas:
            for s in np.flatnonzero(rep.active):
                i = pos.get(int(rep.rid[s]))
                if i is not None:
                    emitted[i] = out[i] - rep.remaining[s]
        ttft_lim = np.array([s.ttft_s if s.ttft_s is not None else np.inf for s in self.slos])[cls]
        tpot_lim = np.array([s.tpot_s if s.tpot_s is not None else np.inf for s in self.slos])[cls]
        e2e_lim = np.array([s.e2e_s if s.e2e_s is not None else np.inf for s in self.slos])[cls]
        started = ~np.isnan(first)
        finished = ~np.isnan(fin)
        ttft_ok = np.where(started, first - arr <= ttft_lim, t_end - arr <= ttft_lim)
        end = np.where(finished, fin, t_end)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(emitted > 1, (end - first) / np.maximum(emitted - 1, 1), 0.0)
        tpot_ok = ~started | (tpot <= tpot_lim)
        e2e_ok = end - arr <= e2e_lim
        good = ttft_ok & tpot_ok & e2e_ok & ~rec.refused[idx]
        if final:
            good &= finished
        weight = np.where(started, 1.0, 0.5)
        # ties (every candidate meets every SLO: light load) go to the lowest latency: the
        # mean time in the system, scaled below half a request
        latency = float(np.minimum(end - arr, self.horizon_s * 4).sum()) / (max(idx.size, 1) * self.horizon_s * 8)
        return float((good * weight).sum()) - latency
