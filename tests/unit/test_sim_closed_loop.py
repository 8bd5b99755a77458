"""Closed-loop workloads and prompt sets in the simulator (the mirror of ``adaptspec loadtest``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adaptspec.control import Arm, PolicyConfig, StaticPolicy
from adaptspec.sim.closed_loop import PromptSet, RequestSource, open_loop_requests, simulate_closed_loop
from adaptspec.control.costs import ProfileCostModel, ProfileFile
from adaptspec.sim.replica import ClassTruth
from adaptspec.sim.acceptance import BernoulliAcceptance
from adaptspec.sim.scenario import ClassSpec, ThinkTimeSpec, WorkloadSpec, parse_scenario
from adaptspec.sim.simulator import RunSetup
from adaptspec.sim.workload import Requests, arrival_times


def _profile(per_token_s: float = 0.0) -> ProfileCostModel:
    # 10 ms a step plus per_token_s per token in the pass: with per_token_s > 0 a bigger batch
    # takes longer, so response times depend on the load
    return ProfileCostModel(ProfileFile(name="test", verify_tokens=[1.0, 1001.0],
                                        verify_s=[0.01, 0.01 + 1000 * per_token_s], max_num_seqs=64,
                                        max_batched_tokens=4096))


def _classes(prompt: int = 16, output: int = 10) -> list[ClassSpec]:
    return [ClassSpec(name="chat", prompt_tokens={"dist": "fixed", "value": prompt},
                      output_tokens={"dist": "fixed", "value": output}, acceptance={"ngram": {"bernoulli": 0.5}})]


def _run(clients: int, think: ThinkTimeSpec, *, duration: float, cost=None, classes=None, seed: int = 0,
         arm: Arm = Arm("none", 0)):
    classes = classes or _classes()
    truths = [ClassTruth(c.name, {"ngram": BernoulliAcceptance(0.5)}) for c in classes]
    empty = Requests(np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    setup = RunSetup(cost or _profile(), truths, empty, max_k=4, duration_s=duration, drain_s=60.0, bin_s=1.0,
                     seed=seed)
    policy = StaticPolicy(arm, PolicyConfig(("ngram",), 4))
    source = RequestSource(classes, None, "random", np.random.default_rng([seed, 1]))
    out, req = simulate_closed_loop(setup, policy, clients, think, source)
    return out, req


def test_one_client_sends_its_next_request_when_the_last_one_finishes():
    """Hand-timed: a 16-token prompt is prefilled in one 10 ms step that also samples the first
    token; the other 9 of 10 tokens take a 10 ms step each, so a request lasts 100 ms and the
    lone client (no think time) sends at 0, 0.1, ..., 0.9 s: 10 requests in 0.95 s."""
    out, req = _run(1, ThinkTimeSpec(), duration=0.95)
    assert len(req) == 10
    np.testing.assert_allclose(req.arrival_s, np.arange(10) * 0.1, atol=1e-9)
    np.testing.assert_allclose(out.recorder.finish_s - req.arrival_s, 0.1, atol=1e-9)
    np.testing.assert_allclose(out.recorder.first_token_s - req.arrival_s, 0.01, atol=1e-9)


def test_host_time_between_steps_delays_the_next_step_while_work_is_left():
    """The host's 2 ms + 1 ms per request between steps: after the prefill step (10 ms) and
    each of the 8 decode steps that leave work, 3 ms pass before the next step; none after the
    step that finishes the request (the client's next request starts the next step at once).
    Control: no host time, 100 ms a request."""
    classes = _classes()
    truths = [ClassTruth("chat", {"ngram": BernoulliAcceptance(0.5)})]
    empty = Requests(np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    for gap, want in (((0.002, 0.001), 0.1 + 9 * 0.003), ((0.0, 0.0), 0.1)):
        setup = RunSetup(_profile(), truths, empty, max_k=4, duration_s=0.5, drain_s=60.0, bin_s=1.0, host_gap=gap)
        source = RequestSource(classes, None, "random", np.random.default_rng([0, 1]))
        out, req = simulate_closed_loop(setup, StaticPolicy(Arm("none", 0), PolicyConfig(("ngram",), 4)), 1,
                                        ThinkTimeSpec(), source)
        np.testing.assert_allclose(out.recorder.finish_s - req.arrival_s, want, atol=1e-9)
        np.testing.assert_allclose(np.diff(req.arrival_s), want, atol=1e-9)


def test_think_time_delays_the_next_request():
    # fixed 0.2 s pause: a cycle is 0.1 s of service + 0.2 s of thinking
    _, req = _run(1, ThinkTimeSpec(dist="fixed", mean_s=0.2), duration=1.0)
    np.testing.assert_allclose(req.arrival_s, [0.0, 0.3, 0.6, 0.9], atol=1e-9)


def test_a_service_paths_round_trip_delays_the_next_request_on_top_of_the_think_time():
    """The reply's way back and the next request's way in (50 ms) come after the think time
    (0.2 s): a cycle of 0.35 s at the engine; the request's own time there does not change.
    Control: without the round trip the cycle is 0.3 s."""
    classes = _classes()
    truths = [ClassTruth("chat", {"ngram": BernoulliAcceptance(0.5)})]
    empty = Requests(np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    for trip, cycle in ((0.05, 0.35), (0.0, 0.3)):
        setup = RunSetup(_profile(), truths, empty, max_k=4, duration_s=1.0, drain_s=60.0, bin_s=1.0)
        source = RequestSource(classes, None, "random", np.random.default_rng([0, 1]))
        out, req = simulate_closed_loop(setup, StaticPolicy(Arm("none", 0), PolicyConfig(("ngram",), 4)), 1,
                                        ThinkTimeSpec(dist="fixed", mean_s=0.2), source, round_trip_s=trip)
        np.testing.assert_allclose(np.diff(req.arrival_s), cycle, atol=1e-9)
        np.testing.assert_allclose(out.recorder.finish_s - req.arrival_s, 0.1, atol=1e-9)


def _law(out, req, clients: int, think_s: float, warmup: float, end: float) -> float:
    """N_est = X (R + Z) over requests finishing in [warmup, end): the interactive response-time law."""
    fin = out.recorder.finish_s
    m = (fin >= warmup) & (fin < end)
    x = m.sum() / (end - warmup)
    r = float(np.mean(fin[m] - req.arrival_s[m]))
    return x * (r + think_s) / clients


@pytest.mark.parametrize("clients", [2, 8])
def test_closed_loop_obeys_the_response_time_law_with_a_negative_control(clients):
    """A closed loop of N clients with mean think time Z has throughput X = N / (R + Z) (the
    interactive response-time law, Little's law on the whole loop). Batch-dependent step
    cost, random output lengths, speculation: the law holds within 1 % (a fixed think time,
    so the check does not also carry the sampling error of exponential ones, ~3 % here).
    Negative control: a run whose clients do not think checked against Z = 0.5 s fails by
    far, so the check would catch a loop that ignores the think time."""
    cost = _profile(per_token_s=2e-4)
    classes = [ClassSpec(name="chat", prompt_tokens={"dist": "uniform", "low": 8, "high": 64},
                         output_tokens={"dist": "uniform", "low": 5, "high": 40},
                         acceptance={"ngram": {"bernoulli": 0.5}})]
    think = ThinkTimeSpec(dist="fixed", mean_s=0.5)
    out, req = _run(clients, think, duration=200.0, cost=cost, classes=classes, arm=Arm("ngram", 3))
    assert abs(_law(out, req, clients, 0.5, 20.0, 200.0) - 1) < 0.01
    out0, req0 = _run(clients, ThinkTimeSpec(), duration=200.0, cost=cost, classes=classes, arm=Arm("ngram", 3))
    assert abs(_law(out0, req0, clients, 0.0, 20.0, 200.0) - 1) < 0.01  # right Z: holds
    assert _law(out0, req0, clients, 0.5, 20.0, 200.0) > 1.5  # wrong Z: fails


def test_throughput_grows_with_clients_and_saturates():
    cost = _profile(per_token_s=2e-4)
    xs = []
    for n in (1, 4, 16, 64):
        out, req = _run(n, ThinkTimeSpec(), duration=30.0, cost=cost)
        fin = out.recorder.finish_s
        xs.append(np.sum((fin >= 5) & (fin < 30)) / 25)
    assert xs[0] < xs[1] < xs[2] < xs[3]
    assert xs[3] / xs[2] < 2.0 < xs[1] / xs[0]  # quadrupling clients pays less and less


def _prompt_set() -> PromptSet:
    return PromptSet([np.array([10, 11, 12]), np.array([20, 21]), np.array([30])],
                     [np.array([1, 2, 3]), np.array([4, 5]), np.array([6])])


def test_round_robin_prompt_set_sends_what_the_in_process_load_test_sends():
    classes = [ClassSpec(name=n, acceptance={"ngram": {"bernoulli": 0.1}}) for n in ("a", "b", "c")]
    src = RequestSource(classes, _prompt_set(), "round_robin", np.random.default_rng(0))
    cls, p, o, pick, cached = src.take(4)
    cls2, p2, o2, pick2, _ = src.take(5)  # continues the sequence
    assert cached.tolist() == [0, 0, 0, 0]  # a set without cached tokens
    pools = {0: [10, 11, 12], 1: [20, 21], 2: [30]}
    # InProcessService.run_level: class = classes[n % C], prompt = pool[(n // C) % len(pool)]
    want = [(n % 3, pools[n % 3][(n // 3) % len(pools[n % 3])]) for n in range(9)]
    assert list(zip(np.concatenate([cls, cls2]).tolist(), np.concatenate([p, p2]).tolist())) == want
    assert o.tolist() == [1, 4, 6, 2]
    # which prompt of its class's pool each request is (acceptance replays per prompt)
    assert np.concatenate([pick, pick2]).tolist() == [(n // 3) % len(pools[n % 3]) for n in range(9)]


def test_a_pool_holding_prompts_more_than_once_names_each_entrys_prompt():
    """``prompt_ids``: a pool of two copies of two prompts sends entries 0-3 in turn and names
    them prompts 0, 1, 0, 1; control: without ids, the entry's index."""
    classes = [ClassSpec(name="a", acceptance={"ngram": {"bernoulli": 0.1}})]
    pool = PromptSet([np.array([10, 11, 12, 13])], [np.array([1, 2, 3, 4])], [np.array([0, 1, 0, 1])])
    _, p, _, ids, _ = RequestSource(classes, pool, "round_robin", np.random.default_rng(0)).take(5)
    assert p.tolist() == [10, 11, 12, 13, 10] and ids.tolist() == [0, 1, 0, 1, 0]
    plain = PromptSet(pool.prompt_tokens, pool.output_tokens)
    assert RequestSource(classes, plain, "round_robin", np.random.default_rng(0)).take(5)[3].tolist() == [0, 1, 2, 3, 0]


def test_a_class_with_weight_zero_is_skipped_and_random_order_follows_weights():
    classes = [ClassSpec(name="a", weight=1, acceptance={"ngram": {"bernoulli": 0.1}}),
               ClassSpec(name="b", weight=0, acceptance={"ngram": {"bernoulli": 0.1}}),
               ClassSpec(name="c", weight=3, acceptance={"ngram": {"bernoulli": 0.1}})]
    cls, *_ = RequestSource(classes, _prompt_set(), "round_robin", np.random.default_rng(0)).take(4)
    assert cls.tolist() == [0, 2, 0, 2]
    cls, p, _, pick, _ = RequestSource(classes, _prompt_set(), "random", np.random.default_rng(0)).take(4000)
    assert 1 not in cls and abs((cls == 2).mean() - 0.75) < 0.03
    assert set(p[cls == 0].tolist()) == {10, 11, 12}
    assert (p[cls == 0] == np.array([10, 11, 12])[pick[cls == 0]]).all()


def test_open_loop_with_a_prompt_set_keeps_the_arrival_times_of_the_seed(tmp_path):
    wl = WorkloadSpec(rate={"kind": "constant", "rps": 5}, arrival={"process": "gamma", "burstiness": 0.5},
                      prompt_set={"path": "ps.csv"})
    (tmp_path / "ps.csv").write_text("request_class,num_prefill_tokens,num_decode_tokens\nchat,7,3\nchat,9,4\n")
    classes = [ClassSpec(name="chat", acceptance={"ngram": {"bernoulli": 0.1}})]
    req = open_loop_requests(wl, classes, 30.0, tmp_path, np.random.default_rng([3, 1]))
    np.testing.assert_array_equal(req.arrival_s, arrival_times(wl, 30.0, np.random.default_rng([3, 1])))
    assert req.prompt_tokens[:4].tolist() == [7, 9, 7, 9] and req.output_tokens[:2].tolist() == [3, 4]


BASE = {
    "name": "t", "duration_s": 30, "warmup_s": 5, "drain_s": 30,
    "hardware": {"profile": "cpu-smollm2-135m-fp32", "max_num_seqs": 16},
    "drafters": ["ngram"],
    "classes": [{"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 32},
                 "output_tokens": {"dist": "fixed", "value": 16}, "acceptance": {"ngram": {"bernoulli": 0.4}}}],
    "workload": {"closed_loop": {"clients": 2}},
    "policies": [{"kind": "static", "drafter": "none", "k": 0}, {"kind": "thompson"}],
}


def _scenario(**over):
    d = {**BASE, **over}
    return parse_scenario(d)


@pytest.mark.parametrize("over, needle", [
    ({"workload": {"closed_loop": {"clients": 2}, "rate": {"kind": "constant", "rps": 1}}}, "exactly one of rate"),
    ({"workload": {"rate": {"kind": "constant", "rps": 1}}, "sweep": {"clients": [1, 2]}}, "sweep.clients"),
    ({"sweep": {"rps": [1.0]}}, "sweep.rps"),
    ({"sweep": {"rps": [1.0], "clients": [2]}}, "exactly one of rps or clients"),
    ({"workload": {"closed_loop": {"clients": 0}}}, "workload.closed_loop.clients"),
    ({"workload": {"closed_loop": {"clients": 2, "think_time": {"dist": "gamma"}}}}, "think_time.dist"),
    ({"workload": {"trace": {"path": "x.csv"}, "prompt_set": {"path": "p.csv"}}}, "workload.prompt_set"),
])
def test_bad_closed_loop_scenarios_name_the_field(over, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        _scenario(**over)


def test_prompt_set_replaces_the_length_distributions(tmp_path):
    classes = [{"name": "chat", "acceptance": {"ngram": {"bernoulli": 0.4}}}]
    _scenario(classes=classes, workload={"closed_loop": {"clients": 2}, "prompt_set": {"path": "p.csv"}})
    with pytest.raises(ValueError, match=r"classes\.0\.prompt_tokens"):
        _scenario(classes=classes)


def test_run_scenario_sweeps_clients(tmp_path):
    from adaptspec.sim.runner import run_scenario

    (tmp_path / "p.csv").write_text("request_class,num_prefill_tokens,num_decode_tokens\nchat,40,12\nchat,80,20\n")
    sc = _scenario(classes=[{"name": "chat", "acceptance": {"ngram": {"bernoulli": 0.4}}}],
                   workload={"closed_loop": {"clients": 2, "think_time": {"mean_s": 0.1}},
                             "prompt_set": {"path": "p.csv"}},
                   sweep={"clients": [1, 4]})
    res = run_scenario(sc, Path(tmp_path))
    assert [(r.policy, r.clients) for r in res.runs] == [("static-none", 1), ("thompson", 1), ("static-none", 4),
                                                         ("thompson", 4)]
    for r in res.runs:
        assert r.rate_rps is None and r.completed > 0 and r.output_token_throughput > 0
    by = {(r.policy, r.clients): r for r in res.runs}
    assert by[("static-none", 4)].request_throughput > by[("static-none", 1)].request_throughput
    with pytest.raises(ValueError, match=r"workload\.prompt_set\.path"):
        run_scenario(_scenario(classes=[{"name": "chat", "acceptance": {"ngram": {"bernoulli": 0.4}}}],
                               workload={"closed_loop": {"clients": 2}, "prompt_set": {"path": "missing.csv"}}),
                     Path(tmp_path))


def test_a_prompt_sets_cached_tokens_are_not_prefilled(tmp_path):
    from adaptspec.sim.closed_loop import read_prompt_set
    from adaptspec.sim.scenario import PromptSetSpec

    (tmp_path / "p.csv").write_text("request_class,num_prefill_tokens,num_decode_tokens,num_cached_tokens\n"
                                    "chat,40,5,32\nchat,40,5,40\nchat,7,2,\n")
    ps = read_prompt_set(PromptSetSpec(path="p.csv"), tmp_path, _classes())
    assert ps.prompt_tokens[0].tolist() == [8, 1, 7] and ps.output_tokens[0].tolist() == [5, 5, 2]
    (tmp_path / "p.csv").write_text("request_class,num_prefill_tokens,num_decode_tokens\nchat,x,5\n")
    with pytest.raises(ValueError, match=r"workload\.prompt_set\.path: .* line 2"):
        read_prompt_set(PromptSetSpec(path="p.csv"), tmp_path, _classes())
