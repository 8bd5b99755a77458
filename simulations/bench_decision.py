"""Measure the cost of one decision (``policy.choose``) for each adaptive policy.

    .venv/bin/python simulations/bench_decision.py

Each policy first runs 30 simulated seconds of the load sweep's three-class workload at 14
requests/s (so its posteriors, cost model and batch picture are warm), then ``choose`` is
timed for every class under the load of the last step, many times; prints p50 / mean / p99
in microseconds of wall time, and the process CPU time per decision (less sensitive to other
processes sharing the cores). A benchmark that prints numbers, not a test.
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
        if spec.kind not in ("thompson", "ucb", "oracle"):
            continue
        run = build_policy(spec, sc, truths, cost, [0.0], 0)
        p = run.policy
        simulate(RunSetup(cost, truths, req, duration_s=30.0, drain_s=0.0), p)
        load = Load(120, 3, 400, 120 * 900)
        samples = []
        cpu0 = time.process_time()
        for i in range(3000):
            c = names[i % 3]
            t0 = time.perf_counter()
            p.choose(c, load)
            samples.append(time.perf_counter() - t0)
        cpu_us = (time.process_time() - cpu0) / len(samples) * 1e6
        us = np.array(samples) * 1e6
        print(f"{spec.kind:9s} decision wall: p50 {np.percentile(us, 50):6.1f} us  mean {us.mean():6.1f} us  "
              f"p99 {np.percentile(us, 99):6.1f} us; CPU time per decision {cpu_us:6.1f} us  ({us.size} decisions)")


if __name__ == "__main__":
    main()
