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
    # shortened (the draws, not the scenario's length, are under test): four runs of it
    one = sc.model_copy(update={"sweep": sc.sweep.model_copy(update={"rps": [7.0]}), "duration_s": 120.0,
                                  "warmup_s": 20.0, "drain_s": 20.0,
                                  "policies": [p for p in sc.policies if p.kind == "thompson" and p.label is None]})
    run = run_scenario(one, base, seed=1).runs[0]
    stored = run.goodput_rps
    stored_tokens = next(c.tpot_token_attainment for c in run.classes if c.name == "interactive")
    seen, shares = [], {}
    out = _mod().run_cells(one, base, "thompson", [(1, 7.0)], 3, progress=seen.append,
                           tpot_class="interactive", tpot_tokens=shares)
    g = out["1:7"]
    assert len(g) == 3 and g[0] == stored
    assert len(set(g)) > 1  # the posterior draws move the result (a policy seed that did nothing would not)
    assert seen and "mean" in seen[0] and "interactive tokens within TPOT" in seen[0]
    assert len(shares["1:7"]) == 3 and shares["1:7"][0] == stored_tokens


def test_cells_and_the_tpot_class_are_checked():
    from adaptspec.sim.scenario import load_scenario

    mod = _mod()
    sc, base = load_scenario(ROOT / "simulations/interactive_batch_high.yaml")
    with pytest.raises(SystemExit, match="--tpot-class: 'chat' not in"):
        mod.run_cells(sc, base, "thompson", [(0, 7.0)], 1, tpot_class="chat")
    one = sc.model_copy(update={"sweep": sc.sweep.model_copy(update={"rps": [5.0]}), "duration_s": 60.0,
                                  "warmup_s": 10.0, "drain_s": 10.0})
    with pytest.raises(SystemExit, match="'batch' has no TPOT target"):
        mod.run_cells(one, base, "static-draft:2", [(0, 5.0)], 1, tpot_class="batch")
    assert mod.parse_cells("0:7,2:-") == [(0, 7.0), (2, None)]
    with pytest.raises(SystemExit, match="--cells"):
        mod.parse_cells("0:seven")
