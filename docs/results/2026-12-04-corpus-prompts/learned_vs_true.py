"""What thompson learned at 16 clients on the corpus-prompt mirror, against the simulator's truth.

Runs thompson alone on ``sim-c16-600s.yaml`` (seed 0), then prints its online step-cost model
against the profile for the step compositions it chooses among, and per class and drafter its
acceptance posterior (per proposed candidate, times the chance a candidate is proposed at all)
against the recorded acceptance the simulator replays. Run from the repository root:

    python docs/results/2026-12-04-corpus-prompts/learned_vs_true.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import adaptspec.sim.runner as runner
from adaptspec.sim.closed_loop import run_closed_loop
from adaptspec.sim.scenario import load_scenario

HERE = Path(__file__).parent


def main() -> None:
    sc, base = load_scenario(HERE / "sim-c16-600s.yaml")
    caught = {}
    build = runner.build_policy

    def keep(spec, *a, **kw):  # the closed loop builds its policies itself: keep thompson's
        run = build(spec, *a, **kw)
        caught[runner.policy_label(spec)] = run.policy
        return run

    runner.build_policy = keep
    try:
        run_closed_loop(sc, base, [p for p in sc.policies if runner.policy_label(p) == "thompson"], seed=0)
    finally:
        runner.build_policy = build
    p, truth, K = caught["thompson"], runner.cost_model(sc, base), sc.max_k
    print("step of 16 decoding requests, mean context 250 tokens: learned / true ms")
    for name, verify, on_draft, depth, ngram in [("none", 16, 0, 0, 0), ("5 on draft:1", 21, 5, 1, 0),
                                                 ("16 on draft:1", 32, 16, 1, 0), ("16 on draft:2", 48, 16, 2, 0),
                                                 ("5 on ngram:2", 26, 0, 0, 5), ("16 on ngram:1", 32, 0, 0, 16)]:
        D = np.zeros(K)
        D[:depth] = on_draft
        args = (np.array(verify, float), np.array(16 * 250.0), D, np.array(ngram, float), 250.0)
        print(f"  {name:14s} {float(p.cost.step_time(*args)) * 1e3:7.1f} / {float(truth.step_time(*args)) * 1e3:7.1f}")
    print("first three positions, accepted given the ones before (learned: posterior mean x proposed), "
          "steps seen / true")
    truths = {t.name: t for t in runner.class_truths(sc, base)}
    for cls in (c.name for c in sc.classes):
        for d, (acc, seen) in p.learned_acceptance(cls).items():
            true = truths[cls].at(0.0)[d].position_probs(K)
            print(f"  {cls:10s} {d:5s} {np.round(acc[:3], 3)} ({np.round(seen[:3]).astype(int)}) / "
                  f"{np.round(true[:3], 3)}")


if __name__ == "__main__":
    main()
