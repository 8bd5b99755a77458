"""TPOT-paced prefill: the rule (fit, cap, deadlines), the engine's scheduler honouring it
with outputs unchanged, the service config, and the interactive class's tail in the
simulator (with pacing off as the negative control)."""
from pathlib import Path

import pytest

from adaptspec.control.pacing import PrefillPacer

SIM = Path(__file__).resolve().parents[2] / "simulations"


def _taught(**kw) -> PrefillPacer:
    """A pacer that has seen steps costing 10 ms + 1 ms a decode token + 0.1 ms a prompt token,
    and interactive requests emitting 2 tokens a step."""
    p = PrefillPacer({"interactive": 0.035}, {"interactive": 2.0, "batch": 10.0}, **kw)
    for d, q in [(10, 0), (20, 0), (30, 500), (10, 1000), (40, 200), (25, 0), (15, 800)] * 4:
        p.observe(0.010 + 0.001 * d + 0.0001 * q, d, q, {"interactive": (6, 3), "batch": (5, 5)})
    return p


def test_the_step_fit_and_the_tokens_per_step_are_measured():
    p = _taught()
    a, b, c = p.fit()
    assert (a, b, c) == pytest.approx((0.010, 0.001, 0.0001), rel=1e-4)
    assert p.tokens_per_step("interactive") == pytest.approx(2.0)
    assert p.tokens_per_step("batch") == 1.0  # no TPOT target: not tracked
    assert p.step_budget_s(["batch", "interactive"]) == pytest.approx(0.9 * 0.035 * 2.0)
    assert p.step_budget_s(["batch"]) is None


def test_prompt_chunks_get_what_the_tpot_class_leaves_of_its_step():
    p = _taught(rate_floor=0.0)
    # budget 63 ms; decode rows of 20 tokens cost 30 ms: 33 ms left at 0.1 ms a token
    assert p.prompt_budget(["interactive"] * 10, 20, [("batch", 5000, 0.1)], 8000) == pytest.approx(330, abs=1)
    assert p.paced_steps == 1
    # no TPOT class decoding, or a budget already smaller: the scheduler's budget
    assert p.prompt_budget(["batch"] * 10, 20, [("batch", 5000, 0.1)], 8000) == 8000
    assert p.prompt_budget(["interactive"] * 10, 20, [("batch", 5000, 0.1)], 200) == 200
    # decode rows alone over the budget: the minimum chunk still moves the backlog
    assert p.prompt_budget(["interactive"] * 60, 70, [("batch", 5000, 0.1)], 8000) == 64


def test_deadlines_raise_the_cap_and_release_it_at_the_edge():
    p = _taught(rate_floor=0.0)
    # 5000 tokens with 1 s left of 0.8 x 10 s: 5000 tok/s over a 63 ms step = 315 (+1): the cap is larger
    assert p.prompt_budget(["interactive"], 20, [("batch", 5000, 7.0)], 8000) == pytest.approx(330, abs=1)
    # 20000 tokens with 1 s left: 20000 tok/s x 63 ms = 1260 (+1)
    assert p.prompt_budget(["interactive"], 20, [("batch", 20000, 7.0)], 8000) == pytest.approx(1261, abs=1)
    # a request behind another counts the tokens ahead of it
    assert p.prompt_budget(["interactive"], 20, [("batch", 15000, 0.0), ("interactive", 5000, 0.6)],
                           8000) == pytest.approx(1261, abs=1)
    # within one step of its deadline: the tokens through it all go now
    assert p.prompt_budget(["interactive"], 20, [("batch", 3000, 7.95), ("batch", 9000, 0.0)], 8000) == 3000
    # requests wait for a free slot: no cap
    assert p.prompt_budget(["interactive"], 20, [("batch", 5000, 0.1)], 8000, blocked=True) == 8000
    # earliest deadline first: a tight TTFT target before a loose one that arrived earlier
    assert p.deadline("interactive", 5.0) == pytest.approx(6.6)
    assert p.deadline("batch", 0.0) == pytest.approx(8.0)
    assert p.deadline("other", 0.0) > p.deadline("batch", 100.0)  # no TTFT target: after every class with one


def test_never_below_the_rate_the_replica_has_been_prefilling():
    p = _taught()  # its steps prefilled 2500 prompt tokens in 0.400 s: 6250 tokens a second
    rate = 2500 * 4 / sum(0.010 + 0.001 * d + 0.0001 * q for d, q in [(10, 0), (20, 0), (30, 500), (10, 1000),
                                                                       (40, 200), (25, 0), (15, 800)] * 4)
    want = int(1.1 * rate * 0.9 * 0.035 * 2.0) + 1
    assert want > 330  # above the TPOT cap: the backlog must not grow
    assert p.prompt_budget(["interactive"] * 10, 20, [("batch", 5000, 0.1)], 8000) == pytest.approx(want, rel=0.02)


def test_no_cap_before_the_fit_and_clear_errors():
    p = PrefillPacer({"interactive": 0.035}, {})
    p.observe(0.02, 10, 0, {"interactive": (2, 1)})  # no step with a prompt chunk yet
    assert p.fit() is None
    assert p.prompt_budget(["interactive"], 10, [("batch", 5000, 0.0)], 8000) == 8000
    for bad, field in [({"margin": 0}, "margin"), ({"slack": -1}, "slack"), ({"min_chunk": -1}, "min_chunk"),
                       ({"half_life_steps": 0}, "half_life_steps"), ({"rate_floor": -1}, "rate_floor")]:
        with pytest.raises(ValueError, match=field):
            PrefillPacer({"interactive": 0.035}, {}, **bad)
    with pytest.raises(ValueError, match="tpot_s"):
        PrefillPacer({"interactive": 0.0}, {})
    with pytest.raises(ValueError, match="ttft_s"):
        PrefillPacer({"interactive": 0.035}, {"batch": -2.0})


class _FixedFit(PrefillPacer):
    """The rule with a fixed step-time fit: a tiny model's step times are too noisy to fit
    in a test (the fit is tested above)."""

    def fit(self):
        return (0.0, 0.001, 0.001)


def test_the_engine_caps_prompt_chunks_and_every_token_is_unchanged(tiny_dir):
    from adaptspec import Engine, SamplingParams, SpecConfig

    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[3 + i % 11 for i in range(8)], [2 + i % 13 for i in range(300)], [5 + i % 7 for i in range(9)]]
    classes = ["interactive", "batch", "interactive"]
    specs = [SpecConfig("ngram", 3), SpecConfig("draft", 2), SpecConfig("draft", 2)]
    ref = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_batched_tokens=512)
    want = [o.token_ids for o in ref.generate(prompts, greedy, specs, request_class=classes)]
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_batched_tokens=512)
    # a step budget of 0.9 x 0.05 x (tokens per step) s at 1 ms a token leaves few prompt tokens
    # (no rate floor: a tiny model prefills so fast that the floor alone would lift every cap)
    eng.pacer = _FixedFit({"interactive": 0.05}, {"batch": 60.0}, min_chunk=16, rate_floor=0.0)
    steps = []
    eng.step_listeners.append(steps.append)
    rid = [eng.add_request(p, greedy, s, request_class=c) for p, s, c in zip(prompts[:1], specs, classes)]
    eng.step()  # the interactive request is decoding before the long prompt arrives
    rid += [eng.add_request(p, greedy, s, request_class=c) for p, s, c in zip(prompts[1:], specs[1:], classes[1:])]
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    assert [got[r] for r in rid] == want  # pacing moves prompt work between steps, nothing else
    assert eng.pacer.paced_steps > 0
    held = [s for s in steps if s.prompts_held]
    assert held and all(s.backlog == 0 for s in held)  # held by choice: no queue for the controller
    chunks = [s.prefill_tokens for s in steps if s.prefill_tokens and s.batch_size]
    assert len(chunks) > 3 and max(chunks) < 300  # the 300-token prompt was spread over steps
    # the control: without the pacer the same prompt goes in whole
    ref2 = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_batched_tokens=512)
    seen = []
    ref2.step_listeners.append(seen.append)
    ref2.add_request(prompts[0], greedy, specs[0], request_class="interactive")
    ref2.step()
    ref2.add_request(prompts[1], greedy, specs[1], request_class="batch")
    while ref2.has_unfinished():
        ref2.step()
    assert max(s.prefill_tokens for s in seen) == 300


def test_the_service_builds_the_pacer_from_the_classes_targets():
    from adaptspec.serve.config import ServiceConfig
    from adaptspec.serve.engine_proc import prefill_pacer

    assert prefill_pacer(ServiceConfig()) is None  # off by default
    cfg = ServiceConfig.model_validate({"pacing": {"enabled": True, "margin": 0.8},
                                        "classes": [{"name": "chat", "tpot_s": 0.05, "ttft_s": 1.0},
                                                    {"name": "batch", "ttft_s": 20.0}]})
    p = prefill_pacer(cfg)
    assert p.tpot_s == {"chat": 0.05} and p.ttft_s == {"chat": 1.0, "batch": 20.0} and p.margin == 0.8
    # enabled, but no class has a TPOT target: nothing to pace for
    assert prefill_pacer(ServiceConfig.model_validate({"pacing": {"enabled": True}})) is None
    with pytest.raises(ValueError, match="margin"):
        ServiceConfig.model_validate({"pacing": {"margin": 0}})


def test_pacing_keeps_the_interactive_class_within_its_target_through_batch_bursts():
    from adaptspec.sim.runner import run_scenario
    from adaptspec.sim.scenario import load_scenario

    sc, base = load_scenario(SIM / "interactive_batch_high.yaml")
    assert sc.pacing is not None
    keep = [p for p in sc.policies if p.kind == "static_per_class" and p.arms == {"interactive": "draft:2",
                                                                                   "batch": "none"}]
    assert {p.pacing for p in keep} == {None, False}  # with the scenario's pacing, and without
    one = sc.model_copy(update={"policies": keep, "sweep": sc.sweep.model_copy(update={"rps": [6.5]})})
    runs = {r.policy: r for r in run_scenario(one, base, seed=0).runs}
    on, off = runs["static-interactive=draft:2,batch=none"], runs["static-interactive=draft:2,batch=none-no-pacing"]

    def cls(r, name):
        return next(c for c in r.classes if c.name == name)

    miss_on = 1.0 - cls(on, "interactive").tpot_token_attainment
    miss_off = 1.0 - cls(off, "interactive").tpot_token_attainment
    assert miss_off > 0.005  # the control: without pacing, batch bursts push interactive tokens past 35 ms
    assert miss_on < 0.5 * miss_off
    assert cls(on, "batch").slo_attainment >= cls(off, "batch").slo_attainment - 0.01  # the batch class keeps its TTFT


def test_the_replica_counts_paced_steps():
    from adaptspec.engine.stats import StepStats
    from adaptspec.serve.metrics import ServiceMetrics

    m = ServiceMetrics()
    seen = []
    m.paced_steps.inc = lambda n=1.0, tags=None: seen.append(n)  # Ray's metrics backend is not under test
    steps = [StepStats(i, 2, 1, 64, 6, 100, 3, 0.0, 0.0, 0.01, 0.0, 0.01, prompts_held=held)
             for i, held in enumerate([True, False, True])]
    m.observe_steps(steps)
    assert seen == [2]
    assert [s.backlog for s in steps] == [0, 3, 0]
