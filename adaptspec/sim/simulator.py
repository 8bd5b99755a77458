"""The discrete-event loop: arrivals, a router, N replicas, one shared policy."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from adaptspec.control import Policy
from adaptspec.sim.costs import ProfileCostModel
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


@dataclass(slots=True)
class RunOutput:
    recorder: Recorder
    end_s: float  # simulated time at the end of the run
    steps: int
    wall_s: float  # real seconds the run took


def simulate(setup: RunSetup, policy: Policy, *, on_shift: Callable[[], None] | None = None,
             progress: Callable[[float], None] | None = None) -> RunOutput:
    """Run ``policy`` on ``setup``; deterministic for a given seed."""
    t_wall = time.perf_counter()
    rng = np.random.default_rng(setup.seed)
    req = setup.requests
    horizon = setup.duration_s + setup.drain_s
    num_bins = int(np.ceil(horizon / setup.bin_s)) + 1
    rec = Recorder(len(req), len(setup.classes), policy.table.arms, setup.bin_s, num_bins)
    replicas = [Replica(setup.cost, policy, setup.classes, req, rec, np.random.default_rng([setup.seed, i]),
                        setup.max_k) for i in range(setup.replicas)]
    shifts = sorted({c.shift_at_s for c in setup.classes if c.shift_at_s is not None})
    arrivals = req.arrival_s
    n = len(req)
    i = 0
    rr = 0
    steps = 0
    now = 0.0
    next_report = 0.0
    while True:
        ta = arrivals[i] if i < n else np.inf
        r = min(replicas, key=lambda x: x.busy_until) if len(replicas) > 1 else replicas[0]
        tr = r.busy_until
        if ta == np.inf and tr == np.inf:
            break
        if ta <= tr:
            now = ta
            if setup.router == "round_robin":
                target = replicas[rr % len(replicas)]
                rr += 1
            elif setup.router == "random":
                target = replicas[int(rng.integers(len(replicas)))]
            else:
                target = min(replicas, key=lambda x: x.load)
            target.enqueue(i, ta)
            i += 1
            continue
        now = tr
        if now > horizon:
            break
        while shifts and now >= shifts[0]:
            shifts.pop(0)
            if on_shift is not None:
                on_shift()
        r.step(now)
        steps += 1
        if progress is not None and now >= next_report:
            progress(min(now / horizon, 1.0))
            next_report = now + horizon / 200
    return RunOutput(rec, now, steps, time.perf_counter() - t_wall)
