"""Batched decisions (``choose_many``, ``plan_many``) are exactly the class-by-class ones.

The simulator and the service decide every class of a step in one pass; the policies are
specified (and the reports were produced) class by class. These tests run the same
simulation twice, once with the batched pass and once with ``choose`` per class, and
require identical runs: every request's finish time, every arm count. The negative control
changes the policy's seed and shows the comparison notices a different run.
"""
from pathlib import Path

import numpy as np
import pytest

from adaptspec.control import ClassTarget, Load
from adaptspec.control.planner import ArmTable, BatchPicture, Planner
from adaptspec.control.types import Arm, GroupOutcome, StepOutcome
from adaptspec.sim.runner import build_policy, class_truths, cost_model
from adaptspec.sim.scenario import ConstantRate, WorkloadSpec, load_scenario
from adaptspec.sim.simulator import RunSetup, simulate
from adaptspec.sim.workload import synthesize

SIM = Path(__file__).resolve().parents[2] / "simulations"


def _run(scenario: str, kind: str, rps: float, *, batched: bool, seed: int = 0):
    sc, base = load_scenario(SIM / scenario)
    truths, cost = class_truths(sc, base), cost_model(sc, base)
    req = synthesize(WorkloadSpec(rate=ConstantRate(kind="constant", rps=rps)), sc.classes, 25.0,
                     np.random.default_rng(3))
    spec = next(s for s in sc.policies if s.kind == kind)
    policy = build_policy(spec, sc, truths, cost, [0.0], seed).policy
    if not batched:  # the reference: one choose per class, in the step's order
        policy.choose_many = lambda classes, load: [policy.choose(c, load) for c in classes]
    out = simulate(RunSetup(cost, truths, req, duration_s=25.0, drain_s=5.0), policy)
    return out.recorder, policy.stats.decisions


def _same(a, b) -> bool:
    return (np.array_equal(a.finish_s, b.finish_s, equal_nan=True)
            and np.array_equal(a.first_token_s, b.first_token_s, equal_nan=True)
            and np.array_equal(a.arm_counts, b.arm_counts))


# the sweep: three TPOT classes near saturation (infeasible steps, the fallback path);
# interactive + batch: one class with a target beside one without (the no-limit rows)
@pytest.mark.parametrize("scenario,kind,rps", [
    ("h100_8b_load_sweep.yaml", "thompson", 22.0),
    ("h100_8b_load_sweep.yaml", "oracle", 22.0),
    ("h100_8b_load_sweep.yaml", "ucb", 14.0),
    ("interactive_batch.yaml", "thompson", 6.0),
])
def test_batched_decisions_reproduce_class_by_class_runs(scenario, kind, rps):
    batched, n_batched = _run(scenario, kind, rps, batched=True)
    single, n_single = _run(scenario, kind, rps, batched=False)
    assert n_batched == n_single > 0  # every class of every step recorded as one decision
    assert _same(batched, single)
    if kind == "thompson":  # negative control: another seed's draws give a different run
        other, _ = _run(scenario, kind, rps, batched=True, seed=1)
        assert not _same(batched, other)


def test_plan_many_rows_equal_plan():
    table = ArmTable.build(("ngram", "draft"), 4)
    targets = {"chat": ClassTarget("chat", tpot_s=0.03), "code": ClassTarget("code", tpot_s=0.05)}
    picture = BatchPicture()
    picture.observe(StepOutcome(12, 64, 200, 9000, 0.004, 0.02, 0.001, 0.025, [
        GroupOutcome("chat", Arm("draft", 3), np.array([1, 2, 2, 1]), 12),
        GroupOutcome("code", Arm("ngram", 4), np.array([0, 1, 1, 1, 1]), 15),
        GroupOutcome("batch", Arm("none", 0), np.array([2]), 2),
    ]))

    class Cost:  # a cost model without the batched protocol: the planner goes row by row
        def predict(self, verify, ctx, draft_other, n_class, k_draft, ngram, mean_ctx):
            assert np.ndim(verify) == 1
            return 0.01 + 2e-5 * verify + 1e-3 * np.maximum(k_draft, np.count_nonzero(draft_other)) + 1e-4 * ngram

    rng = np.random.default_rng(0)
    classes = ["chat", "code", "batch"]
    others = {"chat": 2.0, "code": 2.5, "batch": 1.0}
    for queued in (0, 5):
        for batch in (1, 8, 64, 400):  # from idle to steps no arm keeps within target
            L = 1.0 + np.cumsum(rng.uniform(0, 1, (3, len(table.arms))), axis=1) * (table.k > 0)
            L_t = np.maximum(L - 0.3, 1.0)
            load = Load(batch, queued)
            planner = Planner(table, targets)
            many = planner.plan_many(classes, load, picture, L, others, Cost(), None, L_t)
            one = [planner.plan(c, load, picture, L[i], others, Cost(), None, L_t[i]) for i, c in enumerate(classes)]
            assert many == one
