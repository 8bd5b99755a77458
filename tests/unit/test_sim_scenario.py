"""Scenario validation names the bad key; runs are deterministic for a seed."""
from pathlib import Path

import pytest

from adaptspec.sim.runner import run_scenario
from adaptspec.sim.scenario import load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]


def base(**over):
    data = {
        "name": "t", "duration_s": 30, "warmup_s": 5, "drain_s": 20,
        "hardware": {"profile": "h100-8b-1b"},
        "classes": [
            {"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 200},
             "output_tokens": {"dist": "uniform", "low": 50, "high": 150},
             "acceptance": {"draft": {"bernoulli": 0.7}, "ngram": {"positions": [0.5, 0.3]}}},
            {"name": "code", "weight": 0.5, "prompt_tokens": {"dist": "lognormal", "median": 500, "sigma": 0.5},
             "output_tokens": {"dist": "zipf", "a": 2.0, "scale": 20, "max": 400},
             "acceptance": {"draft": {"positions": [0.9, 0.8]}, "ngram": {"bernoulli": 0.6}}},
        ],
        "workload": {"rate": {"kind": "constant", "rps": 4}},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        "policies": [{"kind": "thompson"}, {"kind": "static", "drafter": "draft", "k": 3}, {"kind": "ucb"}],
    }
    data.update(over)
    return data


@pytest.mark.parametrize("mutate,key", [
    (lambda d: d["classes"][0]["acceptance"]["draft"].update(bernoulli=1.5), "classes.0.acceptance.draft.bernoulli"),
    (lambda d: d["classes"][1].update(prompt_tokens={"dist": "poisson", "value": 3}), "classes.1.prompt_tokens"),
    (lambda d: d["hardware"].update(replicas=0), "hardware.replicas"),
    (lambda d: d.update(duration_s=-1), "duration_s"),
    (lambda d: d["policies"].append({"kind": "static", "drafter": "draft", "k": 99}), "policies.3.static.k"),
    (lambda d: d.update(colour="blue"), "colour"),
    (lambda d: d["workload"].update(trace={"path": "x.csv"}), "workload"),
    (lambda d: d["classes"][0]["acceptance"].pop("ngram"), "classes.0.acceptance"),
    (lambda d: d["classes"][0]["output_tokens"].update(low=500), "classes.0.output_tokens.uniform"),
])
def test_validation_errors_name_the_bad_key(mutate, key):
    d = base()
    mutate(d)
    with pytest.raises(ValueError) as e:
        parse_scenario(d, "s.yaml")
    assert key in str(e.value)
    assert str(e.value).startswith("s.yaml: ")


def test_unknown_profile_and_missing_files_are_named():
    with pytest.raises(ValueError, match="hardware.profile"):
        run_scenario(parse_scenario(base(hardware={"profile": "tpu-v9"})), ROOT)
    with pytest.raises(ValueError, match="hardware.profile_file"):
        run_scenario(parse_scenario(base(hardware={"profile_file": "missing.json"})), ROOT)


def test_yaml_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_scenario(p)
    p.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_scenario(p)


def test_shipped_scenarios_validate():
    paths = sorted((ROOT / "simulations").glob("*.yaml"))
    assert len(paths) >= 6
    for p in paths:
        load_scenario(p)


def _summary(res):
    return [(r.policy, r.goodput_rps, r.output_token_throughput, r.mean_accepted_length, r.steps, r.ttft.p99,
             [c.arm_share for c in r.classes]) for r in res.runs]


def test_runs_are_deterministic_for_a_seed():
    sc = parse_scenario(base())
    a = _summary(run_scenario(sc, ROOT, seed=5))
    b = _summary(run_scenario(sc, ROOT, seed=5))
    c = _summary(run_scenario(sc, ROOT, seed=6))
    assert a == b
    assert a != c


def test_only_runs_the_named_policies():
    res = run_scenario(parse_scenario(base()), ROOT, only=["static-draft:3"])
    assert [r.policy for r in res.runs] == ["static-draft:3"]
    with pytest.raises(ValueError, match="--policy"):
        run_scenario(parse_scenario(base()), ROOT, only=["nope"])
