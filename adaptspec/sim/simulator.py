"""The discrete-event loop: arrivals, a router, N replicas, one shared policy."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from adaptspec.control import Policy
from adaptspec.control.admission import SloAdmission
from adaptspec.control.pacing import PrefillPacer
from adaptspec.control.costs import ProfileCostModel
from adaptspec.sim.replica import ClassTruth, Recorder, Replica
from adaptspec.sim.workload import Requests


@dataclass(slots=True)
class RunSetup:
    cost: ProfileCostModel
    classes: list[ClassTruth]
    requests: Requests
    replicas: int = 1
    router: str = "least_loaded"
    max_k: int = 8
    duration_s: float = 60.0
    drain_s: float = 120.0
    bin_s: float = 10.0
    seed: int = 0
    drafters: tuple[str, ...] = ("ngram", "draft")
    admission: SloAdmission | None = None  # one per replica (copied)
    pacer: PrefillPacer | None = None  # TPOT-paced prefill, one per replica (copied); None: off
    host_gap: tuple[float, float] = (0.0, 0.0)  # host seconds between steps: a + b per request (``Replica``)
    record_shapes: bool = False  # keep every step's shape (``Recorder.step_shapes``)


@dataclass(slots=True)
class RunOutput:
    recorder: Recorder
    end_s: float  # simulated time at the end of the run
    steps: int
    wall_s: float  # real seconds the run took


class Simulation:
    """The state of one run; ``advance`` moves it forward, ``clone`` copies it (rollouts)."""

    def __init__(self, setup: RunSetup, policy: Policy, recorder: Recorder | None = None) -> None:
        self.setup, self.policy = setup, policy
        req = setup.requests
        self.horizon = setup.duration_s + setup.drain_s
        if recorder is None:
            num_bins = int(np.ceil(self.horizon / setup.bin_s)) + 1
            recorder = Recorder(len(req), len(setup.classes), policy.table.arms, setup.bin_s, num_bins,
                                step_shapes=[] if setup.record_shapes else None,
                                request_arms={} if setup.record_shapes else None)
        self.rec = recorder
        self.rng = np.random.default_rng(setup.seed)
        self.replicas = [Replica(setup.cost, policy, setup.classes, req, recorder, np.random.default_rng([setup.seed, i]),
                                 setup.max_k, drafters=setup.drafters, admission=copy.deepcopy(setup.admission),
                                 host_gap=setup.host_gap, pacer=copy.deepcopy(setup.pacer))
                         for i in range(setup.replicas)]
        self.shifts = sorted({c.shift_at_s for c in setup.classes if c.shift_at_s is not None})
        self.i = 0  # next arrival
        self.rr = 0
        self.steps = 0
        self.now = 0.0
        self.done = False
        self.after_step: Callable[["Simulation"], None] | None = None  # a policy's hook between steps


    def clone(self, policy: Policy, recorder: Recorder) -> "Simulation":
        other = copy.copy(self)
        other.policy, other.rec = policy, recorder
        other.rng = copy.deepcopy(self.rng)
        other.replicas = [r.clone(policy, recorder, copy.deepcopy(r.rng)) for r in self.replicas]
        other.shifts = list(self.shifts)
        other.after_step = None
        return other

    def advance(self, until: float, *, on_shift: Callable[[], None] | None = None,
                on_step: Callable[["Simulation"], None] | None = None) -> None:
        """Process events up to simulated time ``until`` (or the end of the run)."""
        setup, req = self.setup, self.setup.requests
        arrivals = req.arrival_s
        n = len(req)
        replicas = self.replicas
        until = min(until, self.horizon)
        while not self.done:
            ta = arrivals[self.i] if self.i < n else np.inf
            r = min(replicas, key=lambda x: x.busy_until) if len(replicas) > 1 else replicas[0]
            tr = r.busy_until
            if ta == np.inf and tr == np.inf:
                self.done = True
                break
            t_next = min(ta, tr)
            if t_next > until:
                break
            if ta <= tr:
                self.now = ta
                if setup.router == "round_robin":
                    target = replicas[self.rr % len(replicas)]
                    self.rr += 1
                elif setup.router == "random":
                    target = replicas[int(self.rng.integers(len(replicas)))]
                else:
                    target = min(replicas, key=lambda x: x.load)
                target.enqueue(self.i, ta)
                self.i += 1
                continue
            self.now = tr
            if self.now > self.horizon:
                self.done = True
                break
            while self.shifts and self.now >= self.shifts[0]:
                self.shifts.pop(0)
                if on_shift is not None:
                    on_shift()
            r.step(self.now)
            self.steps += 1
            if self.after_step is not None:
                self.after_step(self)
            if on_step is not None:
                on_step(self)
        if until >= self.horizon:
            self.done = True


def simulate(setup: RunSetup, policy: Policy, *, on_shift: Callable[[], None] | None = None,
             progress: Callable[[float], None] | None = None) -> RunOutput:
    """Run ``policy`` on ``setup``; deterministic for a given seed. A policy with a
    ``bind(simulation)`` method (the lookahead oracle) is given the run before it starts."""
    t_wall = time.perf_counter()
    sim = Simulation(setup, policy)
    if hasattr(policy, "bind"):
        policy.bind(sim)
    state = {"next": 0.0}

    def on_step(s: Simulation) -> None:
        if progress is not None and s.now >= state["next"]:
            progress(min(s.now / s.horizon, 1.0))
            state["next"] = s.now + s.horizon / 200

    sim.advance(np.inf, on_shift=on_shift, on_step=on_step if progress is not None else None)
    return RunOutput(sim.rec, sim.now, sim.steps, time.perf_counter() - t_wall)
