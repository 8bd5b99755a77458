"""Thompson carried from one closed-loop level to the next, as a live load test's first round at a level runs.

Why: in the live loadtest (`adaptspec loadtest --rounds 3`) thompson's first round at each level
ran at 0.90-0.94 of its later rounds where the static arms' first rounds did not: the first round
is the first after the load changed, and thompson carries what it saw at the last level. This
runs a scenario's thompson for ``--before`` seconds at one client count, then on at the next, and
prints the tokens per second of the seconds the live test measures after the change (``--skip``
to ``--window``; its warm-up, then its window), for:

- carried: the same policy, on (what the service does);
- reset: the same policy with its batch picture started afresh at the change (what a picture that
  forgets the old load at once would give);
- warm: a policy that ran ``--before`` seconds at the new level already (the later rounds);
- static-none: no speculation.

    .venv/bin/python simulations/level_switch.py docs/results/2026-12-06-live-goal-zen3/mirror.yaml --seeds 0,1,2,3

Closed-loop scenarios only; the scenario's own sweep and policies are ignored (its thompson spec is used).
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np


def main() -> None:
    import adaptspec.sim.runner as runner
    from adaptspec.control.planner import BatchPicture
    from adaptspec.sim.closed_loop import Requests, request_source, simulate_closed_loop
    from adaptspec.sim.scenario import load_scenario
    from adaptspec.sim.simulator import RunSetup

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--levels", default="1,4,16", help="client counts, in the order the load test runs them")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--before", type=float, default=60.0, help="seconds at the level before the change")
    ap.add_argument("--skip", type=float, default=5.0, help="seconds after the change not measured (warm-up)")
    ap.add_argument("--window", type=float, default=15.0, help="seconds after the change the window ends at")
    a = ap.parse_args()
    sc, base = load_scenario(a.scenario)
    loop = sc.workload.closed_loop
    if loop is None:
        raise SystemExit(f"error: {a.scenario}: workload.closed_loop: this runs closed-loop scenarios")
    truths, cost = runner.class_truths(sc, base), runner.cost_model(sc, base)
    ts = next((s for s in sc.policies if s.kind == "thompson"), None)
    none = next((s for s in sc.policies if s.kind == "static" and s.k == 0), None)
    if ts is None or none is None:
        raise SystemExit(f"error: {a.scenario}: policies: needs a thompson and a static none:0 policy")
    empty = Requests(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def phase(pol, clients: int, seconds: float, seed: int, stream: int) -> np.ndarray:
        """Tokens emitted per simulated second."""
        setup = RunSetup(cost, truths, empty, sc.hardware.replicas, sc.hardware.router, sc.max_k, seconds, 0.0, 1.0,
                         seed)
        src = request_source(sc.workload, sc.classes, base, np.random.default_rng([stream, 1]))
        out, _ = simulate_closed_loop(setup, pol, clients, loop.think_time, src)
        return out.recorder.accepted_sum.sum(axis=0)

    def measured(per_s: np.ndarray) -> float:
        return float(per_s[int(a.skip):int(a.window)].sum() / (a.window - a.skip))

    levels = [int(x) for x in a.levels.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    for before, after in zip(levels, levels[1:]):
        got: dict[str, list[float]] = {"carried": [], "reset": [], "warm": [], "static-none": []}
        for seed in seeds:
            pol = runner.build_policy(ts, sc, truths, cost, [0.0], seed).policy
            phase(pol, before, a.before, seed, seed)
            fresh = copy.deepcopy(pol)
            got["carried"].append(measured(phase(pol, after, a.window, seed, seed + 100)))
            fresh.picture = BatchPicture(half_life_s=fresh.picture.half_life_s, shift_ratio=fresh.picture.shift_ratio)
            fresh._planned_at = -np.inf
            got["reset"].append(measured(phase(fresh, after, a.window, seed, seed + 100)))
            warm = runner.build_policy(ts, sc, truths, cost, [0.0], seed).policy
            phase(warm, after, a.before, seed, seed)
            got["warm"].append(measured(phase(warm, after, a.window, seed, seed + 100)))
            static = runner.build_policy(none, sc, truths, cost, [0.0], seed).policy
            got["static-none"].append(measured(phase(static, after, a.window, seed, seed + 100)))
        print(f"{before} -> {after} clients: tokens/s {a.skip:g}-{a.window:g} s after the change, seeds {a.seeds}")
        for name, v in got.items():
            print(f"  {name:<12} {np.mean(v):7.1f}  ({', '.join(f'{x:.1f}' for x in v)})"
                  + (f"  {np.mean(v) / np.mean(got['warm']):.3f} of warm" if name != "warm" else ""))


if __name__ == "__main__":
    main()
