"""Simulator fixes: invalid arms are errors, every token of a step counts against its token
budget, class weights that change over time, per-class static arms, arms outside a policy's
table recorded as themselves, and per-token draft stopping in the replica."""
from pathlib import Path

import numpy as np
import pytest

from adaptspec.control import Arm, Load, PerClassStaticPolicy, PolicyConfig, StaticPolicy
from adaptspec.sim.runner import class_truths, cost_model, run_scenario
from adaptspec.sim.scenario import parse_scenario
from adaptspec.sim.simulator import RunSetup, simulate
from adaptspec.sim.workload import class_weights_at, synthesize

ROOT = Path(__file__).resolve().parents[2]


def base(**over):
    data = {
        "name": "t", "duration_s": 20, "warmup_s": 2, "drain_s": 20,
        "hardware": {"profile": "h100-8b-1b"},
        "classes": [
            {"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 200},
             "output_tokens": {"dist": "fixed", "value": 100},
             "acceptance": {"draft": {"bernoulli": 0.7}, "ngram": {"bernoulli": 0.3}}},
            {"name": "code", "prompt_tokens": {"dist": "fixed", "value": 400},
             "output_tokens": {"dist": "fixed", "value": 100},
             "acceptance": {"draft": {"bernoulli": 0.8}, "ngram": {"bernoulli": 0.6}}},
        ],
        "workload": {"rate": {"kind": "constant", "rps": 4}},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        "policies": [{"kind": "static", "drafter": "draft", "k": 3}],
    }
    data.update(over)
    return data


@pytest.mark.parametrize("over,key", [
    ({"policies": [{"kind": "static", "drafter": "draft", "k": 12}]}, "policies.0.k: 12 exceeds max_k 8"),
    ({"drafters": ["ngram"], "policies": [{"kind": "static", "drafter": "draft", "k": 2}]},
     "policies.0.drafter: 'draft' is not deployed"),
    ({"policies": [{"kind": "vllm_schedule", "drafter": "draft", "schedule": [[1, 8, 4], [9, 64, 10]]}]},
     "policies.0.schedule.1: k 10 exceeds max_k 8"),
    ({"policies": [{"kind": "ema", "drafter": "draft", "start_k": 9}]}, "policies.0.start_k"),
    ({"policies": [{"kind": "static_per_class", "arms": {"chat": "draft:2", "nope": "none"}}]}, "policies.0.arms.nope"),
    ({"policies": [{"kind": "static_per_class", "arms": {"chat": "draft:9"}}]}, "policies.0.arms.chat.k"),
    ({"policies": [{"kind": "vllm_adaptive", "drafter": "draft"}]}, "policies.0.drafter: vllm_adaptive"),
    ({"thresholds": [0.25]}, "thresholds"),
    ({"policies": [{"kind": "thompson", "thresholds": [0.35]}]}, "policies.0.thresholds"),
])
def test_invalid_arms_are_errors_naming_the_key(over, key):
    d = base(**over)
    if over.get("drafters") == ["ngram"]:
        for c in d["classes"]:
            c["acceptance"].pop("draft")
    with pytest.raises(ValueError) as e:
        parse_scenario(d, "s.yaml")
    assert key in str(e.value)


def _setup(sc, rps=4.0):
    truths, cost = class_truths(sc, ROOT), cost_model(sc, ROOT)
    req = synthesize(sc.workload.model_copy(update={"rate": sc.workload.rate.model_copy(update={"rps": rps})}),
                     sc.classes, sc.duration_s, np.random.default_rng(0))
    return RunSetup(cost, truths, req, duration_s=sc.duration_s, drain_s=sc.drain_s, drafters=tuple(sc.drafters),
                    max_k=sc.max_k)


def test_a_policy_choosing_an_arm_the_replica_cannot_run_is_an_error():
    sc = parse_scenario(base(drafters=["ngram"], policies=[{"kind": "static", "drafter": "ngram", "k": 2}], classes=[
        {"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 200}, "output_tokens": {"dist": "fixed", "value": 50},
         "acceptance": {"ngram": {"bernoulli": 0.3}}}]))
    setup = _setup(sc)
    with pytest.raises(ValueError, match="not deployed"):
        simulate(setup, StaticPolicy(Arm("draft", 2), PolicyConfig(("ngram", "draft"), 8)))
    with pytest.raises(ValueError, match="above max_k=8"):
        simulate(setup, StaticPolicy(Arm("ngram", 12), PolicyConfig(("ngram",), 16)))


def test_every_token_of_a_step_counts_against_its_budget():
    # short prompts, long answers: dozens of requests decode at once, drafting 8 each (9
    # tokens a request) against a budget of 128 tokens a step
    sc = parse_scenario(base(hardware={"profile": "h100-8b-1b", "max_batched_tokens": 128}, classes=[
        {"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 20}, "output_tokens": {"dist": "fixed", "value": 600},
         "acceptance": {"draft": {"bernoulli": 0.7}, "ngram": {"bernoulli": 0.3}}}]))
    setup = _setup(sc, rps=20.0)
    policy = StaticPolicy(Arm("draft", 8), PolicyConfig(("ngram", "draft"), 8))
    seen = []
    orig = policy.observe

    def observe(outcome):  # verify tokens, requests that ran, tokens they verified
        ran = sum(g.num_requests for g in outcome.groups)
        seen.append((outcome.verify_tokens, ran, ran + sum(g.drafted for g in outcome.groups)))
        orig(outcome)

    policy.observe = observe
    out = simulate(setup, policy)
    assert max(v for v, _, _ in seen) <= 128
    # the control: steps whose decoding requests wanted more than the budget (9 tokens each),
    # so it was enforced: their drafts were cut or some requests waited for the next step
    wanted = 9 * np.asarray(out.recorder.step_decoding)
    assert (wanted > 128).any()
    cut = [got < 9 * ran for _, ran, got in seen]
    assert sum(cut) >= (wanted > 128).sum() - 1


def test_class_weights_can_change_over_time():
    sc = parse_scenario(base(duration_s=200, classes=[
        {"name": "chat", "weight": 1.0, "weight_schedule": [[100, 0.0]], "prompt_tokens": {"dist": "fixed", "value": 10},
         "output_tokens": {"dist": "fixed", "value": 10}, "acceptance": {"draft": {"bernoulli": 0.5}, "ngram": {"bernoulli": 0.5}}},
        {"name": "code", "weight": 0.0, "weight_schedule": [[100, 1.0]], "prompt_tokens": {"dist": "fixed", "value": 10},
         "output_tokens": {"dist": "fixed", "value": 10}, "acceptance": {"draft": {"bernoulli": 0.5}, "ngram": {"bernoulli": 0.5}}},
    ], workload={"rate": {"kind": "constant", "rps": 5}}))
    assert class_weights_at(sc.classes, np.array([50.0, 150.0])).tolist() == [[1.0, 0.0], [0.0, 1.0]]
    req = synthesize(sc.workload, sc.classes, sc.duration_s, np.random.default_rng(1))
    before, after = req.class_idx[req.arrival_s < 100], req.class_idx[req.arrival_s >= 100]
    assert before.size > 300 and after.size > 300
    assert (before == 0).all() and (after == 1).all()
    with pytest.raises(ValueError, match="weight_schedule"):
        parse_scenario(base(classes=[dict(sc.classes[0].model_dump(exclude_none=True), weight_schedule=[[1, -1]])]))


def test_per_class_static_arms_and_arms_outside_the_table_are_recorded_as_themselves():
    sc = parse_scenario(base(policies=[{"kind": "static_per_class", "arms": {"chat": "draft:2", "*": "ngram:3"}},
                                       {"kind": "static", "drafter": "draft", "k": 8, "min_confidence": 0.5}]))
    res = run_scenario(sc, ROOT)
    per = next(r for r in res.runs if r.policy.startswith("static-chat"))
    assert per.policy == "static-chat=draft:2,*=ngram:3"
    arms = {c.name: c.arm_share[0][0] for c in per.classes}
    assert arms == {"chat": "draft:2", "code": "ngram:3"}
    # a threshold arm is not in the plain arm table (no thresholds in the scenario): still its own column
    thr = next(r for r in res.runs if r.policy == "static-draft:8@0.50")
    assert all(c.arm_share[0][0] == "draft:8@0.50" for c in thr.classes)


def test_a_confidence_threshold_stops_drafts_early_in_the_replica():
    conf = {"draft": {"bernoulli": 0.6, "confidence": {"concentration": 1.0}}, "ngram": {"bernoulli": 0.3}}
    sc = parse_scenario(base(classes=[{"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 100},
                                       "output_tokens": {"dist": "fixed", "value": 200}, "acceptance": conf}]))
    out = {}
    for t in (0.0, 0.6):
        policy = StaticPolicy(Arm("draft", 8, t), PolicyConfig(("ngram", "draft"), 8))
        groups = []
        orig = policy.observe
        policy.observe = lambda o, orig=orig, groups=groups: (groups.extend(o.groups), orig(o))
        simulate(_setup(sc, rps=2.0), policy)
        n = sum(g.num_requests for g in groups)
        out[t] = (sum(g.drafted for g in groups) / n, sum(g.accepted for g in groups) / max(sum(g.drafted for g in groups), 1),
                  sum(g.confidence.rejected.sum() + g.confidence.accepted.sum() for g in groups))
    # no threshold: every request drafts all 8 (but in an answer's last steps, which ask for no
    # more candidates than tokens left, as the engine does)
    assert 7.8 < out[0.0][0] <= 8.0
    assert out[0.6][0] < 3.0  # with one, drafts stop at the first unlikely token
    assert out[0.6][1] > out[0.0][1] + 0.2  # and what is verified is accepted far more often
    assert out[0.6][2] > 0  # the replica reports confidences and their fate, as the engine does
    # a threshold outside 0..1 is no arm
    with pytest.raises(ValueError, match="min_confidence"):
        PerClassStaticPolicy({"x": Arm("draft", 2, 1.5)})
    assert Load().queued == 0
