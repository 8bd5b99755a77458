"""Measure the cost of a decision for each adaptive policy.

    .venv/bin/python simulations/bench_decision.py

Each policy first runs 30 simulated seconds of the load sweep's three-class workload at 14
requests/s (so its posteriors, cost model and batch picture are warm), then, under the load
of the last step, many times:
- ``choose`` for one class at a time (a decision on its own);
- ``choose_many`` for the three classes (a step's snapshot: how the simulator and the
  service decide), reported per class decision;
- for the planning policies (thompson, oracle-planner), a plan of every class's arm: what
  runs every ``replan_s`` seconds or ``replan_steps`` steps (a decision between plans is a
  lookup), so its cost per step is the plan's over those steps.
Prints p50 / mean / p99 in microseconds of wall time, and the process CPU time per decision
(less sensitive to other processes sharing the cores). A benchmark that prints numbers, not
a test; the machine's speed moves them by tens of percent from day to day.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from adaptspec.control import Load
from adaptspec.sim.runner import build_policy, class_truths, cost_model
from adaptspec.sim.scenario import ConstantRate, WorkloadSpec, load_scenario
from adaptspec.sim.simulator import RunSetup, simulate
from adaptspec.sim.workload import synthesize

HERE = Path(__file__).resolve().parent


def main() -> None:
    sc, base = load_scenario(HERE / "h100_8b_load_sweep.yaml")
    truths, cost = class_truths(sc, base), cost_model(sc, base)
    wl = WorkloadSpec(rate=ConstantRate(kind="constant", rps=14.0))
    req = synthesize(wl, sc.classes, 30.0, np.random.default_rng(0))
    names = [c.name for c in sc.classes]
    for spec in sc.policies:
        if spec.kind not in ("thompson", "ucb", "oracle_planner"):
            continue
        run = build_policy(spec, sc, truths, cost, [0.0], 0)
        p = run.policy
        simulate(RunSetup(cost, truths, req, duration_s=30.0, drain_s=0.0), p)
        load = Load(120, 3, 400, 120 * 900)
        single = _timed(lambda i: p.choose(names[i % 3], load), 3000)
        snapshot = _timed(lambda i: p.choose_many(names, load), 1000, per=len(names))
        rows = [("choose", single), (f"choose_many x{len(names)}", snapshot)]
        if hasattr(p, "plan"):
            rows.append(("plan", _timed(lambda i: p._replan(names, False), 200)))
        for label, (us, cpu_us) in rows:
            print(f"{spec.kind:14s} {label:15s} per call: p50 {np.percentile(us, 50):7.1f} us  "
                  f"mean {us.mean():7.1f} us  p99 {np.percentile(us, 99):7.1f} us; "
                  f"CPU time {cpu_us:7.1f} us  ({us.size} calls)")


def _timed(call, n: int, per: int = 1) -> tuple[np.ndarray, float]:
    """Wall microseconds per decision of each of ``n`` calls, and mean CPU microseconds."""
    samples = []
    cpu0 = time.process_time()
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - t0)
    cpu_us = (time.process_time() - cpu0) / (n * per) * 1e6
    return np.array(samples) * 1e6 / per, cpu_us


if __name__ == "__main__":
    main()
