"""``simulations/policy_seeds.py``: a policy's runs of one cell with its own draws varied."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mod():
    spec = importlib.util.spec_from_file_location("policy_seeds", ROOT / "simulations/policy_seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_first_draw_reproduces_the_scenario_run_and_the_others_differ_only_in_the_policy():
    from adaptspec.sim.runner import run_scenario
    from adaptspec.sim.scenario import load_scenario

    sc, base = load_scenario(ROOT / "simulations/interactive_batch_high.yaml")
    one = sc.model_copy(update={"sweep": sc.sweep.model_copy(update={"rps": [7.0]}),
                                  "policies": [p for p in sc.policies if p.kind == "thompson" and p.label is None]})
    stored = run_scenario(one, base, seed=1).runs[0].goodput_rps
    seen = []
    out = _mod().run_cells(one, base, "thompson", [(1, 7.0)], 3, progress=seen.append)
    g = out["1:7"]
    assert len(g) == 3 and g[0] == stored
    assert len(set(g)) > 1  # the posterior draws move the result (a policy seed that did nothing would not)
    assert seen and "mean" in seen[0]


def test_cells_are_checked():
    mod = _mod()
    assert mod.parse_cells("0:7,2:-") == [(0, 7.0), (2, None)]
    with pytest.raises(SystemExit, match="--cells"):
        mod.parse_cells("0:seven")
