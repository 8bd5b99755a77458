"""The planner's own score of two plans at the states it saw, against the replica running them.

Plan A: every class on draft:1. Plan B: chat and code edits on draft:1, extraction on ngram:3 (the
planner's choice). Runs the planner fed the true models on ``sim-c4-600s-mix-pooled.yaml`` (seed 0),
keeps every state it planned at, and scores both plans there (tokens per second of the batch as it
is, and the step time that implies); then runs the per-class statics and prints their simulated
mean step and tokens per step. From the repository root:

    python docs/results/2026-12-04-three-rounds/planner_check.py
"""
from pathlib import Path
import numpy as np
import adaptspec.sim.runner as runner
from adaptspec.control.planner import Planner
from adaptspec.sim.closed_loop import run_closed_loop
from adaptspec.sim.scenario import load_scenario

sc, base = load_scenario(Path("docs/results/2026-12-04-three-rounds/sim-c4-600s-mix-pooled.yaml"))
seen = []
orig = Planner.plan
def plan(self, x, cost, current):
    seen.append((self, x, cost))
    return orig(self, x, cost, current)
Planner.plan = plan
spec = [p for p in sc.policies if runner.policy_label(p) == "oracle-planner"]
res = run_closed_loop(sc, base, spec, seed=0)
Planner.plan = orig
print("plans made", len(seen))
self, x, cost = seen[len(seen) // 2]
t = self.table
names = x.classes
print("classes", names, "batch", np.round(x.batch, 2), "in_system", round(x.in_system, 2),
      "prefill share", round(x.prefill_share, 3), "chunk rate", x.chunk_rate)
from adaptspec.control.types import Arm
def row(arms):
    return np.array([t.index(Arm(*a)) for a in arms])
A = row([("draft", 1), ("draft", 1), ("draft", 1)])
B = row([("draft", 1), ("draft", 1), ("ngram", 3)])
order = {n: i for i, n in enumerate(names)}
want = ["chat", "code_edit", "extraction"]
A = A[[want.index(n) for n in names]]
B = B[[want.index(n) for n in names]]
gs = []
for self_, x_, cost_ in seen[len(seen) // 4:]:
    if list(x_.classes) != list(names):
        continue
    s = self_.evaluate(np.stack([A, B]), x_, cost_)
    gs.append(s.goodput)
g = np.array(gs)
print("planner goodput (tokens/s of the batch now) all-draft:1 / extraction-ngram:3: mean",
      np.round(g.mean(axis=0), 2), "ratio A/B", round(float((g[:, 0] / g[:, 1]).mean()), 4), "states", len(g))
for r in res.runs:
    print(r.policy, "req/s %.3f" % r.request_throughput, "steps", r.steps, "sim s %.1f" % r.simulated_s)
# the planner's step time for each plan at the states seen: T_now = (batch x accepted length) / goodput
Ts = []
for self_, x_, cost_ in seen[len(seen) // 4:]:
    if list(x_.classes) != list(names):
        continue
    X = np.stack([A, B])
    s = self_.evaluate(X, x_, cost_)
    nb = np.maximum(x_.batch, 1e-3)
    L = x_.curves.lengths[np.arange(len(names))[None, :], X]
    Ts.append((nb[None, :] * L).sum(axis=1) / s.goodput)
Ts = np.array(Ts)
print("planner step ms, plan A / B:", np.round(1e3 * Ts.mean(axis=0), 2),
      "ratio B/A %.4f" % float((Ts[:, 1] / Ts[:, 0]).mean()))
statics = [p for p in sc.policies if runner.policy_label(p).startswith("static")]
res2 = run_closed_loop(sc, base, statics, seed=0)
for r in res2.runs:
    print(r.policy[:60], "req/s %.3f" % r.request_throughput, "steps", r.steps,
          "mean step ms %.2f" % (1e3 * r.simulated_s / r.steps),
          "tok/step %.2f" % (r.output_token_throughput * r.simulated_s / r.steps))
