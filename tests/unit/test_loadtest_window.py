"""The load test measures inside its window: tokens that arrived in it, requests that
finished in it; a request cut at the window's end counts its tokens, not its latency."""
import pytest

from adaptspec.serve.loadtest import LoadSpec, RequestRecord, Window, summarize

SPEC = LoadSpec(["chat"], max_tokens=4, slo_ttft_s=1.0, slo_tpot_s=0.5)


def _rec(start, ttft, token_times, cut=False, error="", cls="chat"):
    chunks = [(t, 1) for t in token_times]
    e2e = (token_times[-1] if token_times else start) - start
    return RequestRecord(cls, ttft, e2e, len(chunks), {"none:0": len(chunks)}, error, start, chunks, cut)


def test_only_the_window_counts():
    w = Window(10.0, 20.0)
    recs = [
        _rec(9.0, 0.5, [9.5, 9.8, 10.1, 10.4]),  # sent in the warm-up, finishing inside: 2 tokens in
        _rec(12.0, 0.5, [12.5, 13.0, 13.5, 14.0]),  # all inside, meets both SLOs
        _rec(15.0, 2.0, [17.0, 17.5, 18.0, 18.5]),  # inside, misses the TTFT SLO
        _rec(19.0, 0.5, [19.5, 20.0], cut=True),  # cut at the end: its 2 tokens count, its latency not
        _rec(5.0, 0.5, [5.5, 6.0, 6.5, 7.0]),  # warm-up only: nothing counts
    ]
    s = summarize("p", 1, recs, w, SPEC)
    assert s.duration_s == 10.0
    assert s.throughput_tokens_per_s == (2 + 4 + 4 + 2) / 10.0
    assert s.requests == 3  # finished inside the window, not cut
    assert s.goodput_requests_per_s == 2 / 10.0
    assert s.ttft_p50_s == 0.5


def test_rounds_add_their_windows_and_errors_count_once():
    w1, w2 = Window(0.0, 5.0), Window(100.0, 105.0)
    recs = [_rec(1.0, 0.1, [1.1, 1.2]), _rec(101.0, 0.1, [101.1, 101.2, 101.3]),
            _rec(50.0, 0.1, [50.1, 50.2]),  # between the windows (another policy's run): ignored
            RequestRecord("chat", 0.0, 0.01, 0, error="StatusCode.RESOURCE_EXHAUSTED", start_s=102.0)]
    s = summarize("p", 1, recs, [w1, w2], SPEC)
    assert s.duration_s == 10.0 and s.throughput_tokens_per_s == 5 / 10.0
    assert s.requests == 2 and s.errors == 1


def test_adaptive_vs_static_does_not_round_a_miss_into_the_goal():
    from types import SimpleNamespace as NS

    from adaptspec.serve.cli import adaptive_vs_static

    rows = [NS(concurrency=4, policy="thompson", throughput_tokens_per_s=51.13),
            NS(concurrency=4, policy="static:ngram:2", throughput_tokens_per_s=54.08),
            NS(concurrency=4, policy="static:none:0", throughput_tokens_per_s=41.8),
            NS(concurrency=16, policy="thompson", throughput_tokens_per_s=96.0),
            NS(concurrency=16, policy="static:none:0", throughput_tokens_per_s=95.0)]
    assert adaptive_vs_static(rows) == ["c=4: thompson / best static (static:ngram:2) = 0.945 (< 0.95)",
                                        "c=16: thompson / best static (static:none:0) = 1.011 (>= 0.95)"]


def test_adaptive_vs_static_pairs_the_rounds():
    """With per-round throughputs the line also gives the ratio round by round (the first
    round's 0.8 and the third's 1.2 average out in the pooled ratio: only the rounds show it);
    rounds of unequal count, or none, add nothing."""
    from types import SimpleNamespace as NS

    from adaptspec.serve.cli import adaptive_vs_static

    rows = [NS(concurrency=4, policy="thompson", throughput_tokens_per_s=50.0, round_tokens_per_s=[40.0, 50.0, 60.0]),
            NS(concurrency=4, policy="static:none:0", throughput_tokens_per_s=50.0,
               round_tokens_per_s=[50.0, 50.0, 50.0])]
    assert adaptive_vs_static(rows) == ["c=4: thompson / best static (static:none:0) = 1.000 (>= 0.95); "
                                        "round by round 0.800 1.000 1.200"]
    assert adaptive_vs_static(rows, rounds=None) == ["c=4: thompson / best static (static:none:0) = 1.000 (>= 0.95)"]
    rows[1].round_tokens_per_s = [50.0, 50.0]
    assert adaptive_vs_static(rows) == ["c=4: thompson / best static (static:none:0) = 1.000 (>= 0.95)"]


def test_interleaved_levels_keep_each_rounds_throughput():
    """Each (level, policy) summary pools its rounds and keeps each round's throughput in the
    order the rounds ran; the policies alternate order round by round."""
    from rich.console import Console

    from adaptspec.serve.cli import _interleaved_levels

    state = {"policy": "a", "t": 0.0}
    ran = []

    def run_one(n):  # one run: policy "a" emits 2 tokens a second in round r + 1 ... "b" 3
        t0 = state["t"]
        state["t"] += 10.0
        r = sum(1 for p, _ in ran if p == state["policy"])
        ran.append((state["policy"], n))
        per_s = (2 if state["policy"] == "a" else 3) * (r + 1)
        recs = [_rec(t0, 0.1, [t0 + (i + 0.5) / per_s for i in range(per_s * 5)])]
        return recs, Window(t0, t0 + 5.0)

    out = _interleaved_levels([1], ["a", "b"], 2, False, SPEC, Console(file=None, quiet=True),
                              current=lambda: state["policy"], switch=lambda p, reset: state.update(policy=p),
                              run_one=run_one)
    assert [p for p, _ in ran] == ["a", "b", "b", "a"]
    a, b = out
    assert (a.policy, b.policy) == ("a", "b")
    assert a.round_tokens_per_s == [2.0, 4.0] and b.round_tokens_per_s == [3.0, 6.0]
    assert a.throughput_tokens_per_s == 3.0 and b.throughput_tokens_per_s == 4.5
    assert len(a.round_arms) == 2 and a.round_cost_check == []  # no cost check read (no usage)
    one = _interleaved_levels([1], ["a"], 1, False, SPEC, Console(file=None, quiet=True),
                              current=lambda: state["policy"], switch=lambda p, reset: state.update(policy=p),
                              run_one=run_one)
    assert one[0].round_tokens_per_s == []


def test_interleaved_levels_charge_the_controllers_cpu_to_the_policy_that_ran(monkeypatch):
    """The controller's CPU seconds read around each run go to the policy of that run, as a share
    of a core over its runs' wall time; a process reading of None leaves the process share out."""
    from rich.console import Console

    from adaptspec.serve import cli

    clock = {"t": 0.0}
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock["t"])
    state = {"policy": "a", "cpu": [0.0, 0.0]}

    def run_one(n):  # each run lasts 10 s; "a" costs 1 policy CPU second and 2 of the process, "b" none
        clock["t"] += 10.0
        if state["policy"] == "a":
            state["cpu"][0] += 1.0
            state["cpu"][1] += 2.0
        return [_rec(clock["t"] - 10.0, 0.1, [clock["t"] - 9.0])], Window(clock["t"] - 10.0, clock["t"])

    kw = dict(current=lambda: state["policy"], switch=lambda p, reset: state.update(policy=p), run_one=run_one)
    a, b = cli._interleaved_levels([4], ["a", "b"], 2, False, SPEC, Console(file=None, quiet=True),
                                   usage=lambda: (*state["cpu"], {}), **kw)
    assert (a.policy_cpu_share, a.controller_cpu_share) == (0.1, 0.2)
    assert a.cost_check == [] and a.round_cost_check == []  # no rows: no model-based policy
    assert (b.policy_cpu_share, b.controller_cpu_share) == (0.0, 0.0)
    a, _ = cli._interleaved_levels([4], ["a", "b"], 1, False, SPEC, Console(file=None, quiet=True),
                                   usage=lambda: (state["cpu"][0], None, {}), **kw)
    assert (a.policy_cpu_share, a.controller_cpu_share) == (0.1, None)
    a, _ = cli._interleaved_levels([4], ["a", "b"], 1, False, SPEC, Console(file=None, quiet=True), **kw)
    assert (a.policy_cpu_share, a.controller_cpu_share) == (None, None)  # not measured


def test_interleaved_levels_keep_the_cost_check_of_each_policys_runs_and_rounds():
    """The cost check's counters read around each run: the rows' differences go to the policy
    that ran, pooled over its rounds and round by round (plain and drafted apart)."""
    from rich.console import Console

    from adaptspec.serve import cli

    state = {"policy": "a", "rows": {}}

    def run_one(n):  # "a" runs two plain steps predicted at 9 ms that took 10, then one drafted at 20 / 25
        if state["policy"] == "a":
            plain = state["rows"].get((0, False), (0.0, 0.0, 0.0))
            drafted = state["rows"].get((8, True), (0.0, 0.0, 0.0))
            state["rows"] = {(0, False): (plain[0] + 2, plain[1] + 0.018, plain[2] + 0.020),
                             (8, True): (drafted[0] + 1, drafted[1] + 0.020, drafted[2] + 0.025)}
        return [_rec(0.0, 0.1, [1.0])], Window(0.0, 5.0)

    a, b = cli._interleaved_levels([4], ["a", "b"], 2, False, SPEC, Console(file=None, quiet=True),
                                   current=lambda: state["policy"], switch=lambda p, reset: state.update(policy=p),
                                   run_one=run_one, usage=lambda: (0.0, None, dict(state["rows"])))
    rows = {(r["verify_tokens"], r["drafted"]): r for r in a.cost_check}
    assert rows[("0-7", False)]["steps"] == 4 and rows[("0-7", False)]["predicted_ms"] == pytest.approx(9.0)
    assert rows[("8-15", True)]["measured_ms"] == pytest.approx(25.0)
    assert a.round_cost_check == [[[pytest.approx(0.9), 2], [pytest.approx(0.8), 1]]] * 2
    assert b.cost_check == [] and b.round_cost_check == []
    assert cli.cost_check_line(a.cost_check) == ("predicted / measured step time: plain steps 0.900 (4), "
                                                 "steps with drafted rows 0.800 (2)")


def test_each_level_is_warmed_unmeasured_under_the_first_static_policy_before_its_first_round():
    """The first run at a new load ran slow whatever its policy (0.88 of its later rounds, live);
    ``warm_one`` runs first at every level, under the first static policy listed, and its run is
    not counted."""
    from rich.console import Console

    from adaptspec.serve.cli import _interleaved_levels

    state = {"policy": "thompson"}
    ran = []

    def run_one(n):
        ran.append(("run", state["policy"], n))
        return [_rec(0.0, 0.1, [1.0])], Window(0.0, 5.0)

    out = _interleaved_levels([1, 4], ["thompson", "static:none:0"], 1, False, SPEC, Console(file=None, quiet=True),
                              current=lambda: state["policy"], switch=lambda p, reset: state.update(policy=p),
                              run_one=run_one, warm_one=lambda n: ran.append(("warm", state["policy"], n)))
    assert ran == [("warm", "static:none:0", 1), ("run", "thompson", 1), ("run", "static:none:0", 1),
                   ("warm", "static:none:0", 4), ("run", "thompson", 4), ("run", "static:none:0", 4)]
    assert [s.requests for s in out] == [1, 1, 1, 1]  # the warm-ups' requests are nobody's
