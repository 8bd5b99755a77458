"""Simulator fidelity: acceptance replay, the report's error math and goals, open-loop
arrivals in the load test, and a tiny end-to-end ``adaptspec fidelity`` run."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import yaml

from adaptspec.sim.acceptance_replay import AcceptanceFile, AcceptanceRecorder, RecordedAcceptance
from adaptspec.sim.fidelity import ALL, Row, Run, goals, make_cell, side_metrics, tokens_in_window


# ---- acceptance recording and replay ---------------------------------------------------------
def test_recorder_counts_proposed_and_kept_per_class_drafter_and_k():
    rec = AcceptanceRecorder()
    step = NS(requests=[
        NS(request_class="chat", drafter="ngram", k=4, drafted=0, accepted=0),  # lookup miss
        NS(request_class="chat", drafter="ngram", k=4, drafted=3, accepted=2),
        NS(request_class="chat", drafter="ngram", k=4, drafted=3, accepted=2),
        NS(request_class="chat", drafter="none", k=0, drafted=0, accepted=0),  # no drafting: not a sample
        NS(request_class="code", drafter="draft", k=2, drafted=2, accepted=1,
           draft_confidence=[0.95, 0.15]),
    ])
    rec.observe_step(step)
    f = rec.to_file("test")
    h = np.array(f.classes["chat"]["ngram"].joint[4])
    assert h.shape == (5, 5) and h.sum() == 3 and h[0, 0] == 1 and h[3, 2] == 2
    conf = f.classes["code"]["draft"].confidence
    assert conf.seen == [[0] * 9 + [1], [0, 1] + [0] * 8]  # position 1 in bin 9, position 2 in bin 1
    assert conf.accepted[9] == 1 and conf.rejected[1] == 1 and sum(conf.accepted) + sum(conf.rejected) == 2
    assert f.classes["chat"]["ngram"].confidence is None  # n-gram gave no confidences here


def _record(avail: float, keep: float, k: int, n: int, seed: int = 0) -> RecordedAcceptance:
    """n request-steps of a drafter whose candidate at each position is there with chance
    ``avail`` (given the ones before were) and accepted with chance ``keep`` (given the ones
    before were): n-gram-like, proposing fewer than k when the match runs out."""
    rng = np.random.default_rng(seed)
    rec = AcceptanceRecorder()
    m = np.cumprod(rng.random((n, k)) < avail, axis=1).sum(axis=1)
    j = np.minimum(np.cumprod(rng.random((n, k)) < keep, axis=1).sum(axis=1), m)
    for a, b in zip(m, j):
        rec.observe("c", "ngram", k, int(a), int(b))
    return RecordedAcceptance.from_record(rec.to_file().classes["c"]["ngram"], min_steps=30)


def test_replay_recovers_the_proposal_and_acceptance_rates():
    model = _record(0.7, 0.6, k=4, n=20000)
    there, keep = model.proposal_probs(4)
    # ~20000 / 7000 trials at the first / fourth position: 4 standard errors is under 0.025
    np.testing.assert_allclose(there, 0.7, atol=0.025)
    np.testing.assert_allclose(keep, 0.6, atol=0.03)
    # asking for k: a missing candidate is a rejection, so position 1 succeeds with 0.7 * 0.6
    assert abs(model.position_probs(4)[0] - 0.42) < 0.02


def test_replay_at_an_unrecorded_k_extends_the_pooled_rates_with_a_negative_control():
    """Asked for k = 6 (recorded at 4 only), the replay draws position by position with the
    last recorded rates repeating: mean proposed = sum_{j<=6} 0.7^j, mean kept = sum_j
    (0.7 * 0.6)^j. Negative control: a recording of a drafter with 0.5 availability is
    told apart by the same check."""
    want_m = sum(0.7 ** j for j in range(1, 7))
    want_j = sum(0.42 ** j for j in range(1, 7))
    m, j = _record(0.7, 0.6, k=4, n=20000).sample_proposed(6, 20000, np.random.default_rng(1))
    assert np.all(j <= m) and m.max() <= 6
    tol_m = 4 * m.std() / math.sqrt(m.size) + 0.03  # sampling error plus the recorded rates' own
    assert abs(m.mean() - want_m) < tol_m
    assert abs(j.mean() - want_j) < 4 * j.std() / math.sqrt(j.size) + 0.03
    m_other, _ = _record(0.5, 0.6, k=4, n=20000).sample_proposed(6, 20000, np.random.default_rng(1))
    assert abs(m_other.mean() - want_m) > 5 * tol_m


def test_replay_at_a_recorded_k_resamples_its_histogram():
    model = _record(0.7, 0.6, k=4, n=5000, seed=3)
    hist = model.joint[4].sum(axis=0)
    want = float(np.dot(np.arange(5), hist) / hist.sum())
    got = model.sample(4, 50000, np.random.default_rng(2))
    assert abs(got.mean() - want) < 4 * got.std() / math.sqrt(got.size)
    m, j = model.sample_proposed(4, 50000, np.random.default_rng(2))
    assert np.all(j <= m) and abs(j.mean() - want) < 4 * j.std() / math.sqrt(j.size)


def _replica_steps(truth, output_tokens: int, n_req: int = 8, k: int = 4, seed: int = 0, prompt_idx=None,
                   cached=None):
    """A replica running ``n_req`` requests (4-token prompts; ``prompt_idx``: each one's prompt;
    ``cached``: each one's prompt tokens a prefix cache served) with the static arm ngram:k to the
    end; every ``StepOutcome`` it reported, and its recorder."""
    from adaptspec.control import Arm, PolicyConfig, StaticPolicy
    from adaptspec.control.costs import ProfileCostModel, ProfileFile
    from adaptspec.sim.replica import ClassTruth, Recorder, Replica
    from adaptspec.sim.workload import Requests

    seen = []

    class Capture(StaticPolicy):
        def _observe(self, outcome):
            seen.append(outcome)

    cost = ProfileCostModel(ProfileFile(name="t", verify_tokens=[1.0, 1001.0], verify_s=[0.01, 0.02],
                                        max_num_seqs=64, max_batched_tokens=4096))
    req = Requests(np.zeros(n_req), np.full(n_req, 4), np.full(n_req, output_tokens), np.zeros(n_req, dtype=np.int64),
                   prompt_idx, cached)
    policy = Capture(Arm("ngram", k), PolicyConfig(("ngram",), k))
    rec = Recorder(n_req, 1, policy.table.arms, 1.0, 10_000, step_shapes=[])
    r = Replica(cost, policy, [ClassTruth("c", {"ngram": truth})], req, rec, np.random.default_rng(seed), k,
                drafters=("ngram",))
    for i in range(n_req):
        r.enqueue(i, 0.0)
    now = 0.0
    while r.busy_until < np.inf:
        r.step(now)
        now = r.busy_until
    assert np.all(np.isfinite(rec.finish_s))
    return seen, rec


def test_a_cached_prefix_is_context_of_every_pass_of_its_request_with_a_control():
    """As the engine counts a step's context (every row's request's tokens already cached): a
    request whose prompt has 100 cached tokens prefills its 4 others reading those 100, and every
    decode step reads them too (the step's shape, which is priced, and what the policy is told).
    Control: without cached tokens the prompt pass reads nothing."""
    truth = _record(0.0, 0.9, k=4, n=200, seed=1)
    cached, rec = _replica_steps(truth, output_tokens=6, n_req=2, cached=np.array([100, 100]))
    plain, rec0 = _replica_steps(truth, output_tokens=6, n_req=2)
    assert rec.step_shapes[0][2] == rec0.step_shapes[0][2] == 8  # both prompts in the first pass
    assert rec.step_shapes[0][4] == 200 and rec0.step_shapes[0][4] == 0
    # the first decode step: each request's 100 cached + 4 prefilled + its first token
    assert rec.step_shapes[1][4] == cached[1].context_tokens == 2 * 105
    assert rec0.step_shapes[1][4] == plain[1].context_tokens == 2 * 5


def test_replica_verifies_what_the_recorded_drafter_proposed_with_a_control():
    """n-gram-like: a candidate is there with chance 0.3 at each position, so the live drafter
    proposed ~0.43 of k = 4 per step. The replica verifies (and reports) the proposed
    candidates: the step's verify tokens are the decode rows plus what was proposed, and the
    drafted mean matches the recording's. Control: a drafter that always proposed k."""
    sparse = _record(0.3, 0.9, k=4, n=5000, seed=4)
    h = sparse.joint[4]
    want = float(np.dot(np.arange(5), h.sum(axis=1)) / h.sum())
    steps = _replica_steps(sparse, output_tokens=300)[0]
    decode = [o for o in steps if o.num_prefill == 0]
    drafted = np.array([g.drafted for o in decode for g in o.groups])
    n = np.array([g.num_requests for o in decode for g in o.groups])
    for o in decode:
        assert o.verify_tokens == sum(g.num_requests + g.drafted for g in o.groups)
    per_req = drafted.sum() / n.sum()
    # ~25000 request-steps, m has sd < 1: 4 standard errors is under 0.03
    assert abs(per_req - want) < 0.03, (per_req, want)
    assert any(g.drafted_accepted is not None for o in decode for g in o.groups)
    full = _replica_steps(_record(1.0, 0.9, k=4, n=5000, seed=4), output_tokens=300)[0]
    full_dec = [o for o in full if o.num_prefill == 0]
    per_full = sum(g.drafted for o in full_dec for g in o.groups) / sum(g.num_requests for o in full_dec for g in o.groups)
    assert per_full > 3.8 and abs(per_full - want) > 3.0  # all k but the answer's last steps


def test_recorder_keeps_counts_per_prompt_when_it_knows_each_requests_prompt():
    """With ``prompt_of`` (request id -> prompt index) the counts are kept per prompt too, and
    survive the file; a request of unknown prompt counts for its class only."""
    rec = AcceptanceRecorder(prompt_of={"a": 0, "b": 1}.get)
    step = NS(requests=[NS(request_id="a", request_class="c", drafter="ngram", k=2, drafted=2, accepted=2),
                        NS(request_id="b", request_class="c", drafter="ngram", k=2, drafted=0, accepted=0),
                        NS(request_id="x", request_class="c", drafter="ngram", k=2, drafted=1, accepted=0)])
    rec.observe_step(step)
    rec.observe_step(step)
    f = AcceptanceFile.model_validate(json.loads(json.dumps(rec.to_file("t").model_dump())))
    d = f.classes["c"]["ngram"]
    assert np.array(d.joint[2]).sum() == 6
    assert d.by_prompt[0][2][2][2] == 2 and np.array(d.by_prompt[0][2]).sum() == 2
    assert d.by_prompt[1][2][0][0] == 2 and set(d.by_prompt) == {0, 1}
    assert AcceptanceRecorder().to_file().classes == {}  # and without prompt_of nothing is kept per prompt
    plain = AcceptanceRecorder()
    plain.observe_step(step)
    assert plain.to_file().classes["c"]["ngram"].by_prompt is None


def test_recorder_keeps_the_most_telling_step_per_prompt_and_position():
    """Per prompt and output position the recorder keeps one step: a settled one (a rejection,
    or fewer proposed than asked) over a censored one (all kept); of settled ones, one whose
    drafter ran out, else the deepest k asked (how many an n-gram lookup proposes is seen only
    that far); of censored ones, the deepest. A step under a confidence threshold, or without a
    position or a prompt, is not kept there."""
    from adaptspec.sim.acceptance_replay import settled

    rec = AcceptanceRecorder(prompt_of={"a": 0, "b": 1}.get)
    rec.observe("c", "draft", 2, 2, 2, prompt=0, position=1)  # censored at k = 2
    rec.observe("c", "draft", 4, 4, 4, prompt=0, position=1)  # censored deeper: replaces it
    rec.observe("c", "draft", 2, 2, 2, prompt=0, position=1)  # shallower: does not
    rec.observe("c", "draft", 4, 4, 1, prompt=0, position=5)  # settled (kept 1 of 4)
    rec.observe("c", "draft", 8, 8, 8, prompt=0, position=5)  # censored: never replaces a settled one
    rec.observe("c", "ngram", 4, 4, 1, prompt=0, position=2)  # settled; proposals seen up to 4
    rec.observe("c", "ngram", 8, 8, 1, prompt=0, position=2)  # settled deeper: replaces it
    rec.observe("c", "ngram", 8, 6, 1, prompt=0, position=3)  # settled, the lookup ran out at 6
    rec.observe("c", "ngram", 4, 4, 1, prompt=0, position=3)  # a shallower ask: does not
    rec.observe("c", "ngram", 2, 2, 1, prompt=0, position=4)
    rec.observe("c", "ngram", 4, 3, 1, prompt=0, position=4)  # ran out: says more than a full k = 2
    rec.observe("c", "draft", 4, 4, 0, prompt=1, position=1, threshold=0.3)  # a threshold stopped it
    rec.observe("c", "draft", 4, 4, 0, prompt=1)  # no position
    rec.observe("c", "draft", 4, 4, 0, position=2)  # no prompt
    rec.observe_step(NS(requests=[NS(request_id="b", request_class="c", drafter="draft", k=3, drafted=3,
                                     accepted=1, position=7)]))
    f = AcceptanceFile.model_validate(json.loads(json.dumps(rec.to_file("t").model_dump())))
    d = f.classes["c"]["draft"]
    assert d.by_position == {0: {1: [4, 4, 4], 5: [4, 4, 1]}, 1: {7: [3, 3, 1]}}
    assert f.classes["c"]["ngram"].by_position == {0: {2: [8, 8, 1], 3: [8, 6, 1], 4: [4, 3, 1]}}
    assert np.array(d.joint[4]).sum() == 5  # every step still counts for the class
    assert settled(4, 2, 2) and settled(4, 4, 1) and not settled(4, 4, 4)
    plain = AcceptanceRecorder()
    plain.observe("c", "draft", 4, 4, 1, position=3)
    assert plain.to_file().classes["c"]["draft"].by_position is None


def test_replay_step_settles_what_any_k_would_have_kept_there():
    from adaptspec.sim.acceptance_replay import replay_step

    assert replay_step(4, 4, 4, 2) == (4, 4, 2)  # as seen
    assert replay_step(1, 4, 4, 2) == (1, 1, 1)  # a shallower ask keeps all it asked
    # candidate 3 was rejected: deeper asks keep 2 too; a draft model proposes all 8, n-gram
    # lookup 4 to 8 (not seen past 4)
    assert replay_step(8, 4, 4, 2, full=True) == (8, 8, 2)
    assert replay_step(8, 4, 4, 2) == (4, 8, 2)
    assert replay_step(8, 4, 2, 2) == (2, 2, 2)  # n-gram ran out at 2: no more to propose at 8
    assert replay_step(8, 4, 3, 1) == (3, 3, 1)
    assert replay_step(0, 4, 4, 2) == (0, 0, 0)  # no candidates left to verify
    assert replay_step(2, 4, 4, 4) == (2, 2, 2)  # all 4 kept: 2 of 2
    assert replay_step(8, 4, 4, 4) is None  # all 4 kept: what the 5th would do was not seen


def _walk(lengths, k: int, rec: AcceptanceRecorder, prompt: int, drafter: str = "ngram") -> int:
    """A greedy live request of one prompt at static k: at output position t the drafter's
    candidates match the target's tokens for ``lengths[t]`` tokens; returns its decode steps."""
    t, steps = 1, 0
    while t < len(lengths):
        k_t = min(k, len(lengths) - t - 1)
        j = min(int(lengths[t]), k_t)
        if k_t > 0:  # as the engine's stats: a step that asked for nothing is no sample
            rec.observe("c", drafter, k_t, k_t, j, prompt=prompt, position=t)
        t, steps = t + j + 1, steps + 1
    return steps


def test_a_live_step_that_proposed_all_it_asked_replays_deeper_asks_from_the_recordings_tail_with_a_control():
    """At k = 8 the class's n-gram lookup proposed all 8 in 80 steps and 1 in 20; at a position
    a static k = 4 run saw 4 proposed, 2 kept. Asked for 8 there, the lookup had at least 4 to
    propose, so the replay draws from the recording's proposals of 4 or more: all 8 (2 kept).
    Control: clamping an unconditional draw into 4..8 (the replay before) piles the steps that
    proposed 1 onto 4, about a fifth of them."""
    h = np.zeros((9, 9), dtype=np.int64)
    h[8, 0], h[1, 0] = 80, 20
    model = RecordedAcceptance({8: h}, trace={0: {5: (4, 4, 2)}})
    n = 400
    proposed, kept = model.sample_proposed(8, n, np.random.default_rng(0), np.zeros(n, dtype=np.int64),
                                           np.full(n, 5))
    assert set(proposed.tolist()) == {8} and set(kept.tolist()) == {2} and model.replayed == n
    clamped = np.clip(model._sample_proposed(8, n, np.random.default_rng(0))[0], 4, 8)
    assert 0.12 < float(np.mean(clamped == 4)) < 0.28
    # too few steps at k = 8: candidate by candidate past 4 at the pooled chance one is there
    sparse = RecordedAcceptance({8: h}, min_steps=1000, trace={0: {5: (4, 4, 2)}})
    got, _ = sparse.sample_proposed(8, n, np.random.default_rng(1), np.zeros(n, dtype=np.int64), np.full(n, 5))
    assert got.min() >= 4 and float(np.mean(got == 8)) > 0.95  # positions 5-8: proposed whenever 2 was


def test_a_request_replayed_by_position_takes_the_steps_its_live_run_took_with_a_control():
    """Two prompts walked live at k = 4 over 120 tokens (random match lengths): a simulated
    request of either prompt at ngram:4 replays every step as it went and takes exactly the
    live run's decode steps, whatever the seed; the rest of the class's steps are drawn (none
    here). Control: per prompt but not per position, the steps are drawn from the prompt's
    histogram and their count moves with the seed."""
    rng = np.random.default_rng(3)
    rec = AcceptanceRecorder()
    live = [_walk(rng.integers(0, 6, size=120), 4, rec, p) for p in (0, 1)]
    record = rec.to_file().classes["c"]["ngram"]

    def decode_steps(per_position: bool, prompt: int, seed: int) -> tuple[int, RecordedAcceptance]:
        model = RecordedAcceptance.from_record(record, per_position=per_position)
        seen = _replica_steps(model, output_tokens=120, n_req=1, seed=seed, prompt_idx=np.array([prompt]))[0]
        return sum(1 for o in seen if o.num_prefill == 0), model

    for prompt in (0, 1):
        for seed in range(3):
            n, model = decode_steps(True, prompt, seed)
            assert n == live[prompt] and model.replayed == n and model.drawn == 0
    drawn = {decode_steps(False, 0, seed)[0] for seed in range(6)}
    assert len(drawn) > 1 and drawn != {live[0]}
    assert decode_steps(False, 0, 0)[1].replayed == 0


def test_the_engines_steps_at_a_position_are_what_a_trace_of_another_k_settles(tiny_dir, tiny_draft_dir):
    """The assumption position replay rests on, on the real engine: a greedy request's
    candidates and kept tokens at an output position do not depend on the k asked. Each prompt
    runs at k = 4 (recorded by position) and again at k = 2 and k = 6; every step of those at
    a recorded position that the trace settles is replayed exactly, for the draft model and
    n-gram lookup. Control: a trace from another prompt's run does not match."""
    from collections import defaultdict

    from adaptspec import Engine, SamplingParams, SpecConfig
    from adaptspec.sim.acceptance_replay import replay_step

    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_draft_dir))
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 3 * s) % 16 for i in range(12)] for s in range(3)]

    def run(spec, prompts=prompts) -> tuple[list, list]:
        """The engine's outputs and step stats of ``prompts`` under ``spec``."""
        got: list = []
        eng.step_listeners.append(got.append)
        try:
            return eng.generate(prompts, greedy, [spec] * len(prompts)), got
        finally:
            eng.step_listeners.remove(got.append)

    def steps(drafter: str, k: int) -> dict[int, list]:
        outs, got = run(SpecConfig(drafter, k))
        index = {o.request_id: i for i, o in enumerate(outs)}
        per = defaultdict(list)
        for st in got:
            for r in st.requests:
                per[index[r.request_id]].append(r)
        return per

    for drafter in ("draft", "ngram"):
        rec = AcceptanceRecorder()
        for p, rows in steps(drafter, 4).items():
            assert rows[0].position == 1  # the prompt pass sampled the first token
            for a, b in zip(rows, rows[1:]):
                assert b.position == a.position + a.emitted
            for r in rows:
                if r.k > 0:  # as observe_step: a step that asked for nothing is no sample
                    rec.observe("c", drafter, r.k, r.drafted, r.accepted, prompt=p, position=r.position)
        model = RecordedAcceptance.from_record(rec.to_file().classes["c"][drafter])
        trace = model.trace
        assert model.full == (drafter == "draft")
        checked = mismatched = 0
        for k in (2, 6):
            for p, rows in steps(drafter, k).items():
                for r in (r for r in rows if r.k > 0):
                    seen = trace[p].get(r.position)
                    got = None if seen is None else replay_step(r.k, *seen, full=model.full)
                    if got is not None:
                        assert got[0] <= r.drafted <= got[1] and got[2] == r.accepted, (drafter, k, p, r.position,
                                                                                           seen)
                        checked += 1
                    other = trace[(p + 1) % len(prompts)].get(r.position)
                    alt = None if other is None else replay_step(r.k, *other, full=model.full)
                    mismatched += alt is not None and not (alt[0] <= r.drafted <= alt[1] and alt[2] == r.accepted)
        assert checked >= 20 and mismatched > 0, (drafter, checked, mismatched)
    # a draft-stopping threshold reaches the recorder, which keeps no trace under one, and the
    # controller, whose outcome groups name the arm with it (control: a plain arm's say 0)
    from adaptspec.control.types import StepOutcome

    for threshold in (0.5, 0.0):
        got = run(SpecConfig("draft", 4, threshold), prompts[:1])[1]
        rows = [r for st in got for r in st.requests if r.k > 0]
        assert rows and all(r.min_confidence == threshold for r in rows)
        arms = {g.arm for st in got for g in StepOutcome.from_step_stats(st).groups if g.arm.k}
        assert arms and all(a.min_confidence == threshold for a in arms)
        rec = AcceptanceRecorder(prompt_of=lambda _: 0)
        for st in got:
            rec.observe_step(st)
        assert (rec.to_file().classes[rows[0].request_class]["draft"].by_position is None) == (threshold > 0)


def _two_prompts(n: int = 400, min_steps: int = 30) -> RecordedAcceptance:
    """Class c's n-gram at k = 4: prompt 0 always proposes and keeps 4, prompt 1 never
    proposes, prompt 2 has too few steps of its own (min_steps) to be replayed alone."""
    rec = AcceptanceRecorder()
    for _ in range(n):
        rec.observe("c", "ngram", 4, 4, 4, prompt=0)
        rec.observe("c", "ngram", 4, 0, 0, prompt=1)
    for _ in range(min_steps - 1):
        rec.observe("c", "ngram", 4, 4, 0, prompt=2)
    return RecordedAcceptance.from_record(rec.to_file().classes["c"]["ngram"], min_steps=min_steps)


def test_replay_per_prompt_gives_each_request_its_prompts_acceptance_with_a_control():
    """Each request is replayed from its prompt's own counts; a prompt with too few, or one
    never recorded, from the class's. Control: without prompts every request gets the class's
    mixture (about half of them keep 4)."""
    model = _two_prompts()
    rng = np.random.default_rng(0)
    prompts = np.array([0, 1, 2, 7] * 250)
    m, j = model.sample_proposed(4, prompts.size, rng, prompts)
    assert (j[prompts == 0] == 4).all() and (m[prompts == 1] == 0).all()
    for p in (2, 7):  # the class's: a mixture of both (and prompt 2's few steps)
        assert 0.3 < (j[prompts == p] == 4).mean() < 0.7
    a = model.sample(4, prompts.size, rng, prompts)
    assert (a[prompts == 0] == 4).all() and (a[prompts == 1] == 0).all()
    m0, j0 = model.sample_proposed(4, 1000, rng)
    assert 0.4 < (j0 == 4).mean() < 0.6 and 0.4 < (m0 == 0).mean() < 0.6
    # a prompt recorded at k = 4 only replays its own at k = 2 (pooled over its k's), not at k = 8
    m2, j2 = model.sample_proposed(2, 100, rng, np.zeros(100, dtype=int))
    assert (j2 == 2).all()
    m8, _ = model.sample_proposed(8, 400, rng, np.zeros(400, dtype=int))
    assert (m8 == 0).mean() > 0.3


def test_simulated_requests_keep_their_prompts_acceptance_with_a_control():
    """Eight requests, prompts 0 and 1 in turn (a closed-loop prompt set sends them so): with
    per-prompt replay the prompt-0 requests (4 kept a step) finish in about a fifth of the
    steps of the prompt-1 ones (none proposed); control: without prompts on the requests both
    halves draw from the class's mixture and finish alike."""
    def finish(prompt_idx):
        rec = _replica_steps(_two_prompts(), output_tokens=200, seed=1, prompt_idx=prompt_idx)[1]
        return rec.finish_s[0::2].mean(), rec.finish_s[1::2].mean()

    fast, slow = finish(np.array([0, 1] * 4))
    assert fast < 0.3 * slow
    a, b = finish(None)
    assert 0.75 < a / b < 1.33


def test_replica_asks_no_more_candidates_than_tokens_left_with_a_control():
    """A 3-token answer: the prefill samples the first token, so the first decode step has 2
    left and verifies 1 candidate per request (the engine's ``_k_for``), not k = 4. Control:
    a 50-token answer verifies all 4."""
    from adaptspec.sim.acceptance import BernoulliAcceptance

    short = [o for o in _replica_steps(BernoulliAcceptance(0.0), output_tokens=3)[0] if o.num_prefill == 0]
    assert short[0].verify_tokens == 8 * 2 and short[0].groups[0].drafted == 8
    long = [o for o in _replica_steps(BernoulliAcceptance(0.0), output_tokens=50)[0] if o.num_prefill == 0]
    assert long[0].verify_tokens == 8 * 5 and long[0].groups[0].drafted == 32


def test_recorded_acceptance_in_a_scenario_and_its_errors(tmp_path):
    from adaptspec.sim.runner import class_truths
    from adaptspec.sim.scenario import parse_scenario

    rec = AcceptanceRecorder()
    for a in (0, 1, 2, 2):
        rec.observe("chat", "ngram", 2, 2, a)
    rec.to_file("t").save(tmp_path / "acc.json")
    base = {"name": "t", "duration_s": 10, "hardware": {"profile": "cpu-smollm2-135m-fp32"}, "drafters": ["ngram"],
            "classes": [{"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 8},
                         "output_tokens": {"dist": "fixed", "value": 8},
                         "acceptance": {"ngram": {"recorded": {"file": "acc.json"}}}}],
            "workload": {"rate": {"kind": "constant", "rps": 1}}, "policies": [{"kind": "thompson"}]}
    truths = class_truths(parse_scenario(base), tmp_path)
    assert isinstance(truths[0].acceptance["ngram"], RecordedAcceptance)
    assert truths[0].acceptance["ngram"].steps == 4
    other = json.loads(json.dumps(base))
    other["classes"][0]["acceptance"]["ngram"]["recorded"]["request_class"] = "code"
    with pytest.raises(ValueError, match=r"classes\.0\.acceptance\.ngram\.recorded.*'code'"):
        class_truths(parse_scenario(other), tmp_path)
    missing = json.loads(json.dumps(base))
    missing["classes"][0]["acceptance"]["ngram"]["recorded"]["file"] = "nope.json"
    with pytest.raises(ValueError, match=r"recorded\.file"):
        class_truths(parse_scenario(missing), tmp_path)
    with pytest.raises(ValueError, match="kept <= proposed"):
        RecordedAcceptance({2: np.array([[0, 1, 0], [0, 0, 0], [0, 0, 0]])})
    assert AcceptanceFile.load(tmp_path / "acc.json").classes["chat"]["ngram"].joint[2][2] == [1, 1, 2]
    # gzipped by its name (a scenario may point at a results folder's acceptance.json.gz)
    import gzip

    (tmp_path / "acc.json.gz").write_bytes(gzip.compress((tmp_path / "acc.json").read_bytes()))
    packed = json.loads(json.dumps(base))
    packed["classes"][0]["acceptance"]["ngram"]["recorded"]["file"] = "acc.json.gz"
    assert class_truths(parse_scenario(packed), tmp_path)[0].acceptance["ngram"].steps == 4
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="bad.json.gz"):
        AcceptanceFile.load(tmp_path / "bad.json.gz")


# ---- the report's error math ------------------------------------------------------------------
def test_tokens_in_window_from_chunks_or_spread_evenly():
    live = Row("c", 0.0, 1.0, 4.0, 4, chunks=[(1.0, 1), (2.0, 2), (4.0, 1)])
    assert tokens_in_window(live, 1.5, 3.0) == 2 and tokens_in_window(live, 0.0, 10.0) == 4
    sim = Row("c", 0.0, 1.0, 4.0, 4)  # tokens at 1, 2, 3, 4
    assert tokens_in_window(sim, 1.5, 3.0) == 2 and tokens_in_window(sim, 3.5, 9.0) == 1
    assert tokens_in_window(Row("c", 0.0, 1.0, math.nan, 1), 0.0, 2.0) == 1
    assert tokens_in_window(Row("c", 0.0), 0.0, 2.0) == 0


def _rows(ttft: float, tpot: float, n: int, tokens: int = 11, cls: str = "c", arms=None) -> list[Row]:
    # one request a second, each `tokens` long: first token ttft after it starts, then tpot apart
    return [Row(cls, float(i), i + ttft, i + ttft + tpot * (tokens - 1), tokens, arms=dict(arms or {}))
            for i in range(n)]


def test_side_metrics_measure_inside_the_window():
    rows = _rows(0.1, 0.02, 10, arms={"ngram:4": 5})
    rows.append(Row("c", 9.5, 9.6, math.nan, 3, cut=True, chunks=[(9.6, 1), (9.7, 2)]))  # cut: tokens count
    m = side_metrics([Run(rows, (2.0, 8.0))], "c")
    # finished inside [2, 8]: requests 2..7 end at i + 0.3 -> 2.3 .. 7.3: six of them
    assert m.requests == 6
    assert m.ttft_p50 == pytest.approx(0.1) and m.tpot_p50 == pytest.approx(0.02)
    assert m.top_arm == "ngram:4" and m.arms == {"ngram:4": 1.0}
    assert side_metrics([Run(rows, (2.0, 8.0))], "other").requests == 0
    assert math.isnan(side_metrics([Run(rows, (2.0, 8.0))], "other").ttft_p50)
    # two runs pool their windows
    both = side_metrics([Run(rows, (2.0, 8.0)), Run(rows, (2.0, 8.0))], "c")
    assert both.requests == 12 and both.throughput == pytest.approx(m.throughput)


def _cell(policy, cls, live_scale=(1.0, 1.0, 1.0), top=("none:0", "none:0")):
    live = side_metrics([Run(_rows(0.1, 0.02, 20, arms={top[0]: 1}), (0.0, 30.0))], None)
    sim_rows = _rows(0.1 * live_scale[1], 0.02 * live_scale[2], 20)
    sim = side_metrics([Run(sim_rows, (0.0, 30.0 / live_scale[0]))], None, {top[1]: 3})
    return make_cell("in-process", policy, "c=4", cls, not policy.startswith("static"), live, sim)


def test_relative_errors_and_goals():
    ok = _cell("static:none:0", "a")
    assert all(abs(ok.errors[m]) < 1e-9 for m in ("throughput", "ttft_p50", "tpot_p50"))
    off = _cell("static:none:0", "b", live_scale=(1.15, 1.15, 0.95))  # throughput +15%, TTFT +15%, TPOT -5%
    assert off.errors["throughput"] == pytest.approx(0.15, abs=0.01)
    assert off.errors["ttft_p50"] == pytest.approx(0.15) and off.errors["tpot_p50"] == pytest.approx(-0.05)
    g = {x.name.split(" ")[0]: x for x in goals([ok, off])}
    assert not g["throughput"].met and "static:none:0/c=4/b" in g["throughput"].misses[0]
    assert g["tpot_p50"].met and g["ttft_p50"].met  # 15 % is inside TTFT's 20 %
    assert not g["adaptive"].met  # no adaptive policy ran: nothing to agree on


def test_top_arm_agreement_needs_eighty_percent_of_adaptive_cells():
    agree = [_cell("thompson", c, top=("ngram:4", "ngram:4")) for c in "abcd"]
    one_off = _cell("thompson", "e", top=("ngram:4", "draft:2"))
    static = _cell("static:ngram:4", "f", top=("ngram:4", "draft:2"))  # static cells are not counted
    assert next(g for g in goals(agree + [one_off, static]) if g.name.startswith("adaptive")).met  # 4/5
    two_off = [_cell("thompson", c, top=("ngram:4", "draft:2")) for c in "gh"]
    g = next(g for g in goals(agree[:3] + two_off) if g.name.startswith("adaptive"))
    assert not g.met and g.detail == "3/5 cells" and len(g.misses) == 2


def test_top_drafter_and_arm_distance_beyond_the_top_arm():
    """Near-equal arms of one drafter (ngram:4 live, ngram:5 simulated) differ in the top arm
    but agree in the top drafter, at a distance of the share moved; a different drafter does
    not agree (control), and a side with no steps has no distance."""
    from adaptspec.sim.fidelity import arm_summary

    live = side_metrics([Run(_rows(0.1, 0.02, 4, arms={"ngram:4": 3, "ngram:5": 1}), (0.0, 30.0))], None)
    near = side_metrics([Run(_rows(0.1, 0.02, 4), (0.0, 30.0))], None, {"ngram:4": 1, "ngram:5": 2, "draft:2": 1})
    other = side_metrics([Run(_rows(0.1, 0.02, 4), (0.0, 30.0))], None, {"draft:2": 3, "ngram:4": 1})
    a = make_cell("in-process", "thompson", "c=1", "a", True, live, near)
    b = make_cell("in-process", "thompson", "c=1", "b", True, live, other)
    assert not a.same_top_arm and a.same_top_drafter and a.arm_distance == pytest.approx(0.5)
    assert not b.same_top_drafter and b.arm_distance == pytest.approx(0.75)
    empty = side_metrics([Run([], (0.0, 1.0))], None)
    assert math.isnan(make_cell("in-process", "thompson", "c=1", "c", True, empty, empty).arm_distance)
    assert "top drafter agrees in 1/2 cells" in arm_summary([a, b]) and "median 0.62" in arm_summary([a, b])
    assert arm_summary([_cell("static:none:0", "a")]) == ""  # no adaptive cell: nothing to say


def test_median_interval_spans_the_gap_between_two_even_groups_with_a_control():
    """The bootstrap interval of a median: narrow on one group of values; across the gap when
    two groups split the requests evenly (the n-gram extraction cells of issue #29); inside the
    larger group when they split 80/20 (control: the interval is not just always wide)."""
    from adaptspec.sim.fidelity import median_interval

    rng = np.random.default_rng(3)
    one = list(0.020 + 0.0005 * rng.standard_normal(40))
    lo, hi = median_interval(one, how="sample")
    assert lo <= float(np.median(one)) <= hi and hi - lo < 0.001
    fast, slow = list(0.008 + 0.001 * rng.random(17)), list(0.018 + 0.002 * rng.random(17))
    lo, hi = median_interval(fast + slow, how="sample")
    assert lo < 0.009 and hi > 0.018  # either group's edge is one draw away
    lo, hi = median_interval(fast + fast[:10] + slow[:7], how="sample")
    assert hi < 0.010  # 27 fast of 34: the median stays in the fast group
    assert median_interval(one) == median_interval(one)  # seeded
    assert all(math.isnan(x) for x in median_interval([0.1]))


def test_the_harrell_davis_median_is_scipys_and_steady_across_a_gap_with_a_control():
    """``median(how="hd")`` is scipy's Harrell-Davis estimate. Two groups of prompts, fast and
    slow, split 20/21 and 21/20 (live and simulated sides send the same prompts in the same
    order, so their shares differ by a request or so): the sample median jumps across the gap
    between them (control: the statistic the estimate replaces does fail here), the
    Harrell-Davis one moves by a fraction of it."""
    from scipy.stats.mstats import hdquantiles

    from adaptspec.sim.fidelity import median, median_interval

    rng = np.random.default_rng(5)
    xs = list(0.01 + 0.02 * rng.random(37))
    assert median(xs) == pytest.approx(float(hdquantiles(xs, [0.5])[0]), rel=1e-9)
    assert median(xs, "sample") == float(np.median(xs)) and math.isnan(median([]))
    with pytest.raises(ValueError, match="median"):
        median(xs, "mean")
    fast, slow = list(0.012 + 0.006 * rng.random(21)), list(0.027 + 0.008 * rng.random(21))
    a, b = fast[:20] + slow, fast + slow[:20]
    gap = min(slow) - max(fast)
    assert abs(median(a, "sample") - median(b, "sample")) >= gap  # edge to edge: it jumps the gap
    assert abs(median(a) - median(b)) < 0.3 * gap
    # a bootstrap redraws the groups' shares too, so there both estimates span most of the gap
    lo, hi = median_interval(a + b)
    assert lo < median(a + b) < hi and hi - lo > 0.5 * gap


def test_a_miss_inside_the_live_medians_interval_is_named_so_with_a_control():
    """A TPOT miss whose simulated value another live sample could give (inside the live
    bootstrap interval) is marked in the goal's misses and counted in its detail; a miss
    outside it is not (control). The goal's verdict is the same either way."""
    def cell(cls, live_tpots, sim_tpot):
        rows = [Row(cls, float(i), i + 0.1, i + 0.1 + t * 10, 11) for i, t in enumerate(live_tpots)]
        live = side_metrics([Run(rows, (0.0, 60.0))], cls, noise=True)
        sim = side_metrics([Run([Row(cls, float(i), i + 0.1, i + 0.1 + sim_tpot * 10, 11)
                                 for i in range(len(live_tpots))], (0.0, 60.0))], cls)
        return make_cell("in-process", "static:ngram:4", "c=1", cls, False, live, sim)

    bimodal = [0.008] * 9 + [0.009] * 8 + [0.018] * 8 + [0.020] * 9  # 17 and 17: median 13.5 ms
    noisy = cell("extraction", bimodal, 0.0095)  # the fast group's edge: -30%
    assert noisy.errors["tpot_p50"] == pytest.approx(-0.296, abs=0.01) and noisy.in_live_noise("tpot_p50")
    far = cell("chat", [0.020 + 0.0001 * i for i in range(34)], 0.0095)
    assert not far.in_live_noise("tpot_p50")
    g = next(x for x in goals([noisy, far]) if x.name.startswith("tpot_p50"))
    assert not g.met and "1 of the 2 misses inside" in g.detail
    assert [("inside the live interval" in m) for m in g.misses] == [True, False]
    assert noisy.live.noise["tpot_p50"][0] <= 0.0095 and not noisy.sim.noise  # the simulated side has none


def test_live_rounds_top_arms_and_how_often_they_repeat():
    """compare() keeps each live round's top arm of an adaptive cell, and round_agreement counts
    the pairs of rounds that agree: the ceiling of one live side's agreement with a simulated
    one. Static cells and single rounds keep none."""
    from adaptspec.sim.fidelity import arm_summary, round_agreement
    from adaptspec.sim.fidelity_run import compare

    def run(arm):
        return Run(_rows(0.1, 0.02, 5, cls="a", arms={arm: 3}), (0.0, 30.0))

    sim = (Run(_rows(0.1, 0.02, 5, cls="a"), (0.0, 30.0)),)
    live = {("thompson", "c=1"): [run("ngram:4"), run("ngram:4"), run("ngram:5")],
            ("static:ngram:4", "c=1"): [run("ngram:4"), run("ngram:4")],
            ("thompson", "c=4"): [run("draft:2")]}
    sims = {k: (list(sim), {"a": {"ngram:4": 1.0}}) for k in live}
    cells = {(c.policy, c.level, c.request_class): c for c in compare("in-process", live, sims, ["a"])}
    assert cells[("thompson", "c=1", "a")].live_round_tops == ["ngram:4", "ngram:4", "ngram:5"]
    assert cells[("static:ngram:4", "c=1", "a")].live_round_tops == []
    assert cells[("thompson", "c=4", "a")].live_round_tops == []
    assert round_agreement(list(cells.values())) == (1, 3)  # of three pairs, one agrees
    assert "live rounds repeat their own top arm in 1/3 pairs" in arm_summary(list(cells.values()))
    assert all(not c.live_half_tops for c in cells.values())  # under four rounds: no halves


def test_the_halves_of_four_live_rounds_pooled_and_whether_they_agree():
    """With four rounds, each half of them pooled has a top arm: rounds 1-2 lean ngram:4 on
    steps (3 + 1 against 2 + 1), rounds 3-4 ngram:5; a cell whose halves lean the same way
    counts as agreeing. A half is pooled by steps, not by its rounds' winners: c=4's second
    half (draft:2 in one round, draft:3 in the other) is draft:2, 2 steps against 1."""
    from adaptspec.sim.fidelity import arm_summary, half_agreement
    from adaptspec.sim.fidelity_run import compare

    def run(**arms):
        return Run(_rows(0.1, 0.02, 5, cls="a", arms={a.replace("_", ":"): n for a, n in arms.items()}), (0.0, 30.0))

    sim = (Run(_rows(0.1, 0.02, 5, cls="a"), (0.0, 30.0)),)
    live = {("thompson", "c=1"): [run(ngram_4=3, ngram_5=2), run(ngram_4=1, ngram_5=1),
                                  run(ngram_4=1, ngram_5=3), run(ngram_4=2, ngram_5=1)],
            ("thompson", "c=4"): [run(draft_2=3), run(draft_2=1, draft_3=2), run(draft_2=2), run(draft_3=1)]}
    sims = {k: (list(sim), {"a": {"ngram:4": 1.0}}) for k in live}
    cells = {(c.policy, c.level, c.request_class): c for c in compare("in-process", live, sims, ["a"])}
    assert cells[("thompson", "c=1", "a")].live_half_tops == ["ngram:4", "ngram:5"]
    assert cells[("thompson", "c=4", "a")].live_half_tops == ["draft:2", "draft:2"]
    assert half_agreement(list(cells.values())) == (1, 2)
    assert "each pooled, agree in 1/2 cells" in arm_summary(list(cells.values()))


def test_a_cell_without_values_misses_and_the_all_rows_are_not_judged():
    empty = side_metrics([Run([], (0.0, 1.0))], None)
    c = make_cell("in-process", "static:none:0", "c=1", "a", False, empty, empty)
    assert math.isnan(c.errors["tpot_p50"])
    assert not goals([c])[0].met and "(no value)" in goals([c])[0].misses[0]
    idle = make_cell("in-process", "thompson", "c=1", "a", True, empty, empty)
    assert not idle.same_top_arm  # no arm on either side is no agreement
    assert not goals([idle])[-1].met
    bad_all = _cell("static:none:0", ALL, live_scale=(2.0, 2.0, 2.0))
    assert all(g.met for g in goals([_cell("static:none:0", "a"), bad_all])[:3])


def test_report_json_and_plot(tmp_path):
    from adaptspec.sim.fidelity import plot, table_rows, to_json

    cells = [_cell("thompson", "a", top=("ngram:4", "ngram:4")), _cell("static:none:0", "a", (1.05, 1.1, 1.0))]
    data = json.loads(to_json(cells, goals(cells), {"date": "x"}))
    assert len(data["cells"]) == 2 and data["cells"][1]["errors"]["throughput"] == pytest.approx(0.05, abs=0.01)
    assert data["goals"][0]["met"]
    assert len(table_rows(cells)) == 2 and "+5.0%" in table_rows(cells)[1][5]
    assert plot(cells, tmp_path / "f.png").stat().st_size > 1000


# ---- open-loop arrivals in the load test ---------------------------------------------------------
def test_open_loop_arrivals_are_the_simulators_for_the_same_seed(tmp_path):
    from adaptspec.serve.loadtest import Arrivals
    from adaptspec.sim.runner import _workload
    from adaptspec.sim.scenario import parse_scenario

    arr = Arrivals(rate_rps=3.0, process="gamma", burstiness=0.5, seed=7)
    sc = parse_scenario({"name": "t", "seed": 7, "duration_s": 40, "hardware": {"profile": "cpu-smollm2-135m-fp32"},
                         "drafters": ["ngram"],
                         "classes": [{"name": "chat", "prompt_tokens": {"dist": "fixed", "value": 8},
                                      "output_tokens": {"dist": "fixed", "value": 8},
                                      "acceptance": {"ngram": {"bernoulli": 0.3}}}],
                         "workload": {"rate": {"kind": "constant", "rps": 3.0},
                                      "arrival": {"process": "gamma", "burstiness": 0.5}},
                         "policies": [{"kind": "thompson"}]})
    req = _workload(sc, tmp_path, None, np.random.default_rng([sc.seed, 1]))
    np.testing.assert_array_equal(arr.times(40.0), req.arrival_s)
    assert 80 < req.arrival_s.size < 160


def test_load_levels_name_the_bad_option():
    from adaptspec.serve.cli import load_levels
    from adaptspec.serve.loadtest import Arrivals

    assert load_levels("1,4", "") == [1, 4]
    assert load_levels("2", "", think_time=0.5, think="exponential")[0] == Arrivals(clients=2, think_s=0.5,
                                                                                    think="exponential")
    assert [a.label for a in load_levels("1", "0.5,2", "gamma", 0.25)] == ["0.5 rps gamma 0.25", "2 rps gamma 0.25"]
    for args, needle in (((",", ""), "--concurrency"), (("1", "x"), "--rate"), (("1", "-2"), "--rate"),
                         (("1", "1", "uniform"), "--arrival"), (("1", "", "poisson", 1.0, 0.5, "normal"), "--think")):
        with pytest.raises(ValueError, match=needle):
            load_levels(*args)
    with pytest.raises(ValueError, match="clients"):
        Arrivals(clients=2, rate_rps=1.0)


def _tiny_cfg(tmp_path, tiny_dir, tiny_draft_dir) -> Path:
    import yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": {"target": str(tiny_dir), "draft": str(tiny_draft_dir)},
        "controller": {"report_interval_s": 0.05, "max_k": 4},
        "engine": {"max_num_seqs": 4, "max_model_len": 512, "torch_threads": 1}}))
    return cfg


def test_loadtest_in_process_open_loop_and_think_time(tiny_dir, tiny_draft_dir, tmp_path):
    """``adaptspec loadtest --in-process --rate``: requests start when due, whatever the engine
    is doing; with --think-time a client waits that long after each reply."""
    from typer.testing import CliRunner

    from adaptspec.cli import app

    cfg = _tiny_cfg(tmp_path, tiny_dir, tiny_draft_dir)
    out = tmp_path / "r.json"
    common = ["loadtest", "--in-process", "--config", str(cfg), "--max-tokens", "6", "--duration", "0.8",
              "--warmup", "0.2", "--policies", "static:ngram:2", "--json", str(out)]
    res = CliRunner().invoke(app, common + ["--rate", "25", "--arrival", "gamma", "--burstiness", "2"])
    assert res.exit_code == 0, res.output
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["rate_rps"] == 25 and lv["concurrency"] == 0 and lv["level"] == "25 rps gamma 2"
    assert 5 <= lv["requests"] <= 45 and lv["errors"] == 0  # ~20 due in the 0.8 s window
    res = CliRunner().invoke(app, common + ["--concurrency", "2", "--think-time", "0.3"])
    assert res.exit_code == 0, res.output
    lv = json.loads(out.read_text())["levels"][0]
    # two clients, each at most one request per 0.3 s of thinking: <= 2 * (1 + 1 / 0.3) per second
    assert lv["think_s"] == 0.3 and 1 <= lv["requests"] <= 2 * (0.8 / 0.3 + 1)
    bad = CliRunner().invoke(app, common + ["--rate", "0"])
    assert bad.exit_code == 2 and "--rate" in bad.output


# ---- end to end ---------------------------------------------------------------------------------
def test_fidelity_end_to_end_on_tiny_models(tiny_dir, tiny_draft_dir, tmp_path):
    """``adaptspec fidelity``: a fresh calibration, live runs in-process, the mirror simulated,
    the report written. Tiny models and sub-second windows: this checks the plumbing, not the
    fidelity (a step of the tiny model is mostly Python overhead outside the engine's timers)."""
    from typer.testing import CliRunner

    from adaptspec.cli import app

    cfg = _tiny_cfg(tmp_path, tiny_dir, tiny_draft_dir)
    out = tmp_path / "fid"
    # prompts of its own (--prompts), in the tiny model's words: pools of 3, 2 and 4 prompts
    pools = {"chat": ["t1 t2 t3", "t4 t5", "t6 t7 t8 t9"], "code_edit": ["t2 t2 t2 t2 t2 t3", "t5 t6 t7"],
             "extraction": ["t9 t1", "t3 t3 t3 t4 t5 t6 t7 t8", "t10 t11", "t12 t13 t14"]}
    (tmp_path / "prompts.json").write_text(json.dumps(pools))
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--out", str(out), "--concurrency", "2",
                                   "--rate", "20", "--duration", "0.6", "--warmup", "0.2", "--max-tokens", "6",
                                   "--prompts", str(tmp_path / "prompts.json"),
                                   "--policies", "thompson,static:ngram:2", "--calibrate-batch", "1,2",
                                   "--calibrate-ks", "2", "--calibrate-repeats", "1",
                                   "--probe-tolerance", "inf"])  # the tiny model's steps are mostly noise
    assert res.exit_code == 0, res.output
    data = json.loads((out / "fidelity.json").read_text())
    cells = data["cells"]
    keys = {(c["policy"], c["level"], c["request_class"]) for c in cells}
    assert keys == {(p, lv, c) for p in ("thompson", "static:ngram:2") for lv in ("c=2", "20 rps")
                    for c in ("chat", "code_edit", "extraction", ALL)}
    for c in cells:
        assert c["path"] == "in-process" and c["live"]["throughput"] > 0 and c["sim"]["throughput"] > 0
        assert set(c["errors"]) == {"throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"}
        if c["policy"] == "static:ngram:2" and c["request_class"] != ALL:
            assert c["live"]["top_arm"] == c["sim"]["top_arm"] == "ngram:2"
    assert [g["name"].split(" ")[0] for g in data["goals"]] == ["throughput", "tpot_p50", "ttft_p50", "adaptive"]
    assert data["meta"]["acceptance_steps"] > 0 and Path(data["meta"]["profile"]).is_file()
    # each simulated run replays the prefix-cache hits of its live run
    assert set(data["meta"]["cache_replay"]) == {f"{p} {lv}" for p in ("thompson", "static:ngram:2")
                                                 for lv in ("c=2", "20 rps")}
    for name in ("fidelity.png", "acceptance.json", "prompt_set.csv", "scenario.yaml", "profile.json"):
        assert (out / name).stat().st_size > 0
    # the prompt set the simulator ran is the one sent: a row per prompt, in the file's order
    assert data["meta"]["cpu_kernel"].startswith(("on (", "off", "no C compiler", "build/load", "self-check", "C "))
    assert json.loads((out / "prompts.json").read_text()) == pools and data["meta"]["prompts"] == str(
        tmp_path / "prompts.json")
    ps_rows = (out / "prompt_set.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in ps_rows] == ["chat"] * 3 + ["code_edit"] * 2 + ["extraction"] * 4
    assert [int(r.split(",")[1]) for r in ps_rows][5:] == [2, 8, 2, 3]
    recording = AcceptanceFile.load(out / "acceptance.json")
    assert set(recording.classes) == {"chat", "code_edit", "extraction"}
    # every request's prompt was known: the counts per prompt add up to the class's
    for per in recording.classes.values():
        for d in per.values():
            assert d.by_prompt and sum(np.array(h).sum() for j in d.by_prompt.values() for h in j.values()) == \
                sum(np.array(h).sum() for h in d.joint.values())
    gap = data["meta"]["host_gap_measured"]
    assert set(gap) == {"*", "thompson", "static:ngram:2"}
    assert gap["*"]["gaps"] == gap["thompson"]["gaps"] + gap["static:ngram:2"]["gaps"] > 0 and gap["*"]["mean_s"] > 0
    assert data["meta"]["host_gap"]["thompson"]["a_s"] == gap["thompson"]["a_s"]
    # the scenario it wrote runs with `adaptspec simulate`, from wherever the folder is moved to
    assert yaml.safe_load((out / "scenario.yaml").read_text())["hardware"]["profile_file"] == "profile.json"
    moved = shutil.copytree(out, tmp_path / "moved")
    res = CliRunner().invoke(app, ["simulate", str(moved / "scenario.yaml")])
    assert res.exit_code == 0, res.output
    # the live runs simulated again from the folder (nothing live): the same live side, the
    # simulated side without the host's time between steps or the cache replay this time
    again = tmp_path / "again"
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(out), "--out", str(again),
                                   "--no-host-gap", "--no-cache-replay", "--probe-tolerance", "inf"])
    assert res.exit_code == 0, res.output
    redo = json.loads((again / "fidelity.json").read_text())
    assert redo["meta"]["resimulated"]["from"] == str(out) and redo["meta"]["host_gap"] == {}
    assert redo["meta"]["cache_replay"] is None
    key = lambda c: (c["policy"], c["level"], c["request_class"])  # noqa: E731
    before = {key(c): c["live"] for c in cells}
    for c in redo["cells"]:
        assert c["live"] == before[key(c)]
    bad = CliRunner().invoke(app, ["fidelity", "--resimulate", str(tmp_path), "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "--resimulate" in bad.output
    # a results folder keeps its large files gzipped: the same live side from the .gz's
    import gzip

    packed = tmp_path / "packed"
    shutil.copytree(out, packed)
    for name in ("live_runs.json", "fidelity.json", "acceptance.json"):
        plain = packed / name
        (packed / f"{name}.gz").write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(packed), "--out",
                                   str(tmp_path / "unpacked"), "--no-host-gap", "--no-cache-replay",
                                   "--probe-tolerance", "inf"])
    assert res.exit_code == 0, res.output
    for c in json.loads((tmp_path / "unpacked" / "fidelity.json").read_text())["cells"]:
        assert c["live"] == before[key(c)]
    # the resimulation's scenario names the source folder's recording (gzipped) and prompt set, and runs
    classes = yaml.safe_load((tmp_path / "unpacked" / "scenario.yaml").read_text())["classes"]
    files = {a["recorded"]["file"] for c in classes for a in c["acceptance"].values() if "recorded" in a}
    assert files == {"../packed/acceptance.json.gz"}
    ran = CliRunner().invoke(app, ["simulate", str(tmp_path / "unpacked" / "scenario.yaml")])
    assert ran.exit_code == 0, ran.output
    bad = CliRunner().invoke(app, ["fidelity", "--resimulate", str(out), "--out", str(tmp_path / "x"),
                                   "--probe-tolerance", "-0.1"])
    assert bad.exit_code != 0 and "--probe-tolerance" in bad.output
    # speed probes: every live run probed before and after, a factor per run against the
    # calibration's probe, applied; the resimulation takes the probes on file; --no-probe does not
    speed = data["meta"]["speed"]
    assert speed["applied"] and speed["probed_runs"] == len(speed["per_run"]) == 4
    assert all(r["factor"] > 0 and set(r["before_s"]) == set(r["after_s"]) for r in speed["per_run"])
    assert speed["min"] <= speed["median"] <= speed["max"] and "speed factor" in res.output
    assert redo["meta"]["speed"]["per_run"] == speed["per_run"]
    saved = json.loads((out / "live_runs.json").read_text())
    assert saved["version"] == 4 and all(r["probe"]["before"] and r["speed_factor"] > 0
                                         for r in saved["live"]["in-process"])
    # every live step's shape is kept (its phases add up to the step), and the report prices
    # them on the profile beside the simulated steps' shapes, the resimulation too
    for r in saved["live"]["in-process"]:
        assert len(r["shapes"]) == r["steps"] > 0
        assert sum(sum(s[6:9]) for s in r["shapes"]) == pytest.approx(r["step_wall_s"], abs=1e-4)
        assert any(s[2] > 0 for s in r["shapes"]) and any(s[1] > 0 for s in r["shapes"])
    for folder in (out, again):
        tables = json.loads((folder / "step_shapes.json").read_text())
        assert {(t["policy"], t["level"]) for t in tables} == {(p, lv) for p in ("thompson", "static:ngram:2")
                                                               for lv in ("c=2", "20 rps")}
        for t in tables:
            total = t["rows"][-1]
            assert total["decoding"] == "all" and total["live_n"] > 0 and total["sim_n"] > 0
            assert total["repriced_ms"] > 0 and total["sim_ms"] > 0
        assert "priced err" in (folder / "step_shapes.md").read_text()
    # prompt probes beside them (the calibration has a prompt table): a prompt factor per run
    ps = data["meta"]["prompt_speed"]
    assert ps["applied"] and ps["probed_runs"] == len(ps["per_run"]) == 4
    assert all(r["factor"] > 0 and set(r["before_s"]) == {"8", "16", "32"} for r in ps["per_run"])
    assert redo["meta"]["prompt_speed"]["per_run"] == ps["per_run"]
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(out), "--out",
                                   str(tmp_path / "noprompt"), "--no-prompt-probe", "--probe-tolerance", "inf"])
    assert res.exit_code == 0, res.output
    np_meta = json.loads((tmp_path / "noprompt" / "fidelity.json").read_text())["meta"]
    assert np_meta["speed"]["applied"] and not np_meta["prompt_speed"]["applied"]
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(out), "--out",
                                   str(tmp_path / "noprobe"), "--no-probe"])
    assert res.exit_code == 0, res.output
    off = json.loads((tmp_path / "noprobe" / "fidelity.json").read_text())["meta"]
    assert not off["speed"]["applied"] and any("--no-probe" in n for n in off["notes"])
    # each run's speed read off its own logged steps instead (and none: the calibration's)
    for source in ("steps", "none"):
        res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(out), "--out",
                                       str(tmp_path / source), "--speed-from", source])
        assert res.exit_code == 0, res.output
        got = json.loads((tmp_path / source / "fidelity.json").read_text())["meta"]
        assert any(f"--speed-from {source}" in n for n in got["notes"])
        if source == "steps":
            assert got["speed"]["applied"] and got["speed"]["probed_runs"] == 4 and got["speed"]["source"] == "steps"
            assert "live decode steps" in res.output
        else:
            assert not got["speed"]["applied"] and not got["prompt_speed"]["applied"]
    bad = CliRunner().invoke(app, ["fidelity", "--resimulate", str(out), "--out", str(tmp_path / "x"),
                                   "--speed-from", "clock"])
    assert bad.exit_code != 0 and "--speed-from" in bad.output
    # the p50s by the sample median instead: recorded in the meta, the cells' medians are the
    # middle requests', and the goal lines count the Harrell-Davis estimate beside them
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--resimulate", str(out), "--out",
                                   str(tmp_path / "sample"), "--median", "sample"])
    assert res.exit_code == 0, res.output
    got = json.loads((tmp_path / "sample" / "fidelity.json").read_text())
    assert got["meta"]["median"] == "sample" and redo["meta"]["median"] == "hd"
    cell = next(c for c in got["cells"] if c["request_class"] != "all" and c["live"]["requests"] > 2)
    assert cell["live"]["median"] == "sample" and set(cell["live"]["other_p50"]) == {"ttft_p50", "tpot_p50"}
    assert "by the Harrell-Davis median" in " ".join(res.output.split())  # rich wraps long lines
    bad = CliRunner().invoke(app, ["fidelity", "--resimulate", str(out), "--out", str(tmp_path / "y"),
                                   "--median", "mean"])
    assert bad.exit_code != 0 and "--median" in bad.output


def test_step_log_from_records_counts_gaps_only_while_the_engine_had_work():
    """A replica's logged steps (``step_shapes.record``) make the same log as a listener's: a
    gap after a step that left the engine idle is the client's think time, not the host's."""
    from types import SimpleNamespace

    from adaptspec.sim import step_shapes
    from adaptspec.sim.fidelity_run import StepLog

    def st(end, wall, unfinished):
        return SimpleNamespace(end_s=end, wall_s=wall, batch_size=2, num_prefill=1, unfinished=unfinished,
                               requests=[], context_tokens=10, prefill_tokens=4, verify_tokens=2, draft_s=0.0,
                               prefill_s=0.001, verify_s=wall - 0.002, other_s=0.001)

    steps = [st(1.0, 0.1, 3), st(1.15, 0.1, 0), st(2.0, 0.1, 1), st(2.2, 0.1, 1)]
    fed, called = StepLog(), StepLog()
    fed.extend(step_shapes.record(s) for s in steps)
    for s in steps:
        called(s)
    for log in (fed, called):
        assert log.steps == [(1.0, 0.1), (1.15, 0.1), (2.0, 0.1), (2.2, 0.1)]
        assert [sh[0] for sh in log.shapes_inside(1.1, 2.1)] == [1.15, 2.0]
        log.clear("p")
        # 1.15 - 0.1 - 1.0 after a busy step; none after the idle one at 1.15; 2.2 - 0.1 - 2.0
        assert log.gaps["p"] == [(3, pytest.approx(0.05)), (3, pytest.approx(0.1))]
        assert log.steps == [] and log.shapes == []


def test_host_gap_fit_and_its_fallbacks():
    from adaptspec.sim.fidelity import fit_host_gap

    rng = np.random.default_rng(0)
    rows = rng.integers(1, 17, 400)
    gaps = 0.001 + 0.0002 * rows + rng.normal(0, 1e-5, rows.size)
    a, b = fit_host_gap(list(zip(rows, gaps)))
    assert a == pytest.approx(0.001, abs=1e-5) and b == pytest.approx(0.0002, abs=2e-6)
    # a gap that shrinks with the batch is not a model of the host: the mean gap alone
    a, b = fit_host_gap(list(zip(rows, 0.004 - 0.0002 * rows)))
    assert b == 0.0 and a == pytest.approx(float(np.mean(0.004 - 0.0002 * rows)))
    assert fit_host_gap([]) == (0.0, 0.0) and fit_host_gap([(4, 0.002), (4, 0.004)]) == (pytest.approx(0.003), 0.0)


def test_snapshot_policy_hands_out_arms_as_a_live_replica_sees_them():
    """Arms change only at a refresh, after interval_s of engine time (steps and the host's
    gaps), when the policy has learned from every step since the last one. Control: the
    policy itself would answer differently at every step."""
    from adaptspec.control import Arm, Load, StepOutcome
    from adaptspec.sim.fidelity import SnapshotPolicy

    class Counting:  # a new arm at every decision
        def __init__(self):
            self.decisions, self.seen, self.table = 0, [], NS(arms=[])

        def choose_many(self, classes, load):
            self.decisions += 1
            return [Arm("ngram", self.decisions) for _ in classes]

        def observe(self, o):
            self.seen.append(o)

    inner = Counting()
    snap = SnapshotPolicy(inner, ["a", "b"], interval_s=1.0, host_gap=(0.05, 0.0))
    step = StepOutcome(4, 0, 8, 100, 0.0, 0.15, 0.0, 0.15)  # 0.15 s + 0.05 s host: 5 steps a second
    arms = []
    for _ in range(12):
        arms.append(snap.choose_many(["a", "b"], Load()))
        snap.observe(step)
    assert [a[0].k for a in arms] == [1] * 5 + [2] * 5 + [3] * 2 and all(x == y for x, y in arms)
    assert len(inner.seen) == 10 and snap.table is inner.table  # learned in two reports; the rest is the policy's
    snap.flush()
    assert len(inner.seen) == 12 and snap.choose_many(["a"], Load())[0].k == 4
    assert snap.choose_many(["c"], Load())[0].k == 5  # a class the snapshot lacked: added at once
    assert inner.choose_many(["a"], Load())[0].k != inner.choose_many(["a"], Load())[0].k  # the control


def test_step_rows_report_the_engine_per_level():
    from adaptspec.sim.fidelity import step_rows

    from adaptspec.sim.fidelity import step_time

    # a step of 1 s ending at 0.5 is half inside [0, 10]; one ending at 10.5 is not counted but
    # its first half is busy time inside
    assert step_time([0.5, 5.0, 10.5], [1.0, 1.0, 1.0], (0.0, 10.0)) == (2, 2.0, 2.0)
    live = side_metrics([Run(_rows(0.1, 0.02, 5), (0.0, 10.0), steps=400, step_wall_s=8.0, busy_s=8.0)], None)
    sim = side_metrics([Run(_rows(0.1, 0.02, 5), (0.0, 10.0), steps=500, step_wall_s=9.0, busy_s=9.0)], None)
    assert live.step_ms == pytest.approx(20.0) and live.busy == pytest.approx(0.8)
    row = step_rows([make_cell("in-process", "thompson", "c=4", ALL, True, live, sim)])[0]
    assert row[3] == "40.0/50.0" and row[4].startswith("20.00/18.00 (-10.0%)") and row[5] == "0.80/0.90"


def test_an_unrecorded_class_takes_the_busiest_recorded_class_of_that_drafter():
    from adaptspec.sim.acceptance import BernoulliAcceptance
    from adaptspec.sim.fidelity import acceptance_source, truths_from_recording

    rec = AcceptanceRecorder()
    for cls, n in (("a", 3), ("b", 5)):
        for _ in range(n):
            rec.observe(cls, "ngram", 2, 2, 1)
    f = rec.to_file()
    assert [acceptance_source(f, c, "ngram") for c in ("a", "b", "c")] == ["a", "b", "b"]
    assert acceptance_source(f, "a", "draft") is None
    truths, notes = truths_from_recording(f, ["a", "c"], ["ngram", "draft"])
    assert truths[1].acceptance["ngram"].steps == 5 and isinstance(truths[0].acceptance["draft"], BernoulliAcceptance)
    assert any(n.startswith("c/ngram") for n in notes) and any(n.startswith("a/draft") for n in notes)


class _FakeStream:
    """What ``Client.stream`` returns: chunks of a request (two tokens, 20 ms apart)."""

    def __init__(self):
        import time as _t

        self._t = _t

    def __iter__(self):
        for i in range(2):
            self._t.sleep(0.02)
            yield NS(token_ids=[1], finished=i == 1, speculation=NS(arms=[NS(arm="none:0", steps=2)]))

    def cancel(self):
        pass


class _FakeClient:
    def __init__(self, slow: str | None = None):
        self.sent = []
        self.slow = slow  # a prompt whose request takes ten times as long

    def stream(self, prompt, **kw):
        import time as _t

        self.sent.append((_t.perf_counter(), kw["request_class"], prompt))
        stream = _FakeStream()
        if prompt == self.slow:
            stream._t = NS(sleep=lambda s: _t.sleep(10 * s))
        return stream


def test_grpc_load_generator_sends_open_loop_arrivals_on_time_and_clients_think():
    """The gRPC side's scheduling, against a stand-in for the service (the service itself is
    covered by the integration tests): open-loop requests go out at their arrival times
    whatever the replies do; a thinking client waits after each reply."""
    import time as _t

    from adaptspec.serve.loadtest import Arrivals, LoadSpec, bench_prompts, pick_prompt, run_level

    spec = LoadSpec(["chat", "code_edit"], max_tokens=2)
    arr = Arrivals(rate_rps=40.0, seed=3)
    client = _FakeClient()
    t0 = _t.perf_counter()
    recs, window = run_level(client, arr, 0.5, spec, warmup_s=0.1)
    due = arr.times(0.6)
    assert len(client.sent) == due.size and len(recs) == due.size
    lateness = np.array(sorted(t for t, _, _ in client.sent)) - (t0 + due)
    assert lateness.min() > -0.005  # none goes before it is due (how late depends on the machine's load)
    prompts = bench_prompts()
    assert sorted((r.request_class, r.prompt_index) for r in recs) == sorted(
        pick_prompt(prompts, spec.classes, i)[:2] for i in range(due.size))
    client = _FakeClient()
    recs, _ = run_level(client, Arrivals(clients=2, think_s=0.2), 0.5, spec)
    # each client: a 40 ms request, then 0.2 s of thinking: at most 3 requests each in 0.5 s
    assert 2 <= len(client.sent) <= 6
    # a closed loop's clients take the next prompt of one stream, as the in-process load test
    # and the simulator do: what was sent is the stream's first requests, however slow some
    # prompts run (the control: a client holding every 4th request of the stream would have
    # sent the slow prompt's share of it far less often than the others')
    slow = prompts["chat"][0]
    client = _FakeClient(slow=slow)
    recs, _ = run_level(client, 4, 0.6, spec)
    sent = [(c, p) for _, c, p in sorted(client.sent)]
    stream = [pick_prompt(prompts, spec.classes, i) for i in range(len(sent))]
    assert sorted(sent) == sorted((c, p) for c, _, p in stream)
    assert len(sent) > 20 and 2 <= sent.count(("chat", slow)) <= len(sent) / 8


# ---- speed probes on the simulated side -------------------------------------------------------------
def _speed_setup(rounds: int):
    from adaptspec.control.costs import ProfileCostModel, ProfileFile
    from adaptspec.serve.config import load_config
    from adaptspec.sim.acceptance import BernoulliAcceptance
    from adaptspec.sim.closed_loop import PromptSet
    from adaptspec.sim.fidelity_run import FidelityOptions
    from adaptspec.sim.replica import ClassTruth
    from adaptspec.sim.scenario import ClassSpec

    cfg = load_config(None)
    opts = FidelityOptions(levels=[1], policies=["static:none:0"], classes=["chat"], duration_s=20.0, warmup_s=2.0,
                           rounds=rounds, drain_s=5.0)
    cost = ProfileCostModel(ProfileFile(name="t", verify_tokens=[1.0, 64.0], verify_s=[0.010, 0.040],
                                        step_overhead_s=0.001, max_num_seqs=16, max_batched_tokens=256))
    truths = [ClassTruth("chat", {d: BernoulliAcceptance(0.0) for d in cfg.drafters})]
    specs = [ClassSpec(name="chat", acceptance={"ngram": {"bernoulli": 0.0}})]
    prompts = PromptSet([np.array([40, 60])], [np.array([30, 50])])
    return cfg, opts, cost, truths, specs, prompts


def test_a_speed_factor_of_two_halves_a_static_policys_simulated_throughput():
    """Round 0 at factor 1, round 1 at factor 2 (per run, as the live probes said): every step
    costs twice as much in round 1, so one client gets half the tokens per second (window
    edges: a request's worth). Control: no factors on file simulates both rounds alike."""
    from adaptspec.sim.fidelity_run import simulate_all

    cfg, opts, cost, truths, specs, prompts = _speed_setup(rounds=2)
    key = ("static:none:0", "c=1")
    runs, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, speed={key: [1.0, 2.0]})[key]
    tput = [side_metrics([r], None).throughput for r in runs]
    assert tput[0] > 0 and tput[1] / tput[0] == pytest.approx(0.5, rel=0.03)
    plain, _ = simulate_all(cfg, opts, cost, truths, specs, prompts)[key]
    base = [side_metrics([r], None).throughput for r in plain]
    assert base[0] == pytest.approx(tput[0]) and base[1] / base[0] == pytest.approx(1.0, rel=0.03)
    # a run without a factor takes the mean of the others' (here 2: both rounds at half speed)
    half, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, speed={key: [float("nan"), 2.0]})[key]
    assert side_metrics([half[0]], None).throughput == pytest.approx(tput[1])


def test_simulated_rows_carry_their_requests_arm_steps_as_live_rows_do_with_a_control():
    """Each simulated request's row says how many of its steps ran each arm, as a live row
    does: at static:none:0 one step a token after the prefill's first. Control: a simulation
    that does not keep them (not a fidelity run) leaves the rows without arms."""
    from adaptspec.sim.fidelity_run import simulate_all

    cfg, opts, cost, truths, specs, prompts = _speed_setup(rounds=1)
    runs, _ = simulate_all(cfg, opts, cost, truths, specs, prompts)[("static:none:0", "c=1")]
    done = [r for run in runs for r in run.rows if math.isfinite(r.end_s)]
    assert done and all(r.arms == {"none:0": r.tokens - 1} for r in done if r.tokens > 1)
    from adaptspec.sim.replica import Recorder

    assert Recorder(1, 1, [], 1.0, 1).request_arms is None


def test_a_prompt_factor_moves_the_simulated_first_token_alone():
    """With a prompt table, round 1 at prompt factor 3 (its prompt probes said so) pays three
    times the prompt passes: its TTFT rises by twice the table's price of the prompts; with
    the speed factor at 1 its decode steps, hence TPOT, stay. Control: without prompt factors
    both rounds alike; a run without one takes the others' mean."""
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.sim.fidelity_run import simulate_all

    cfg, opts, cost, truths, specs, prompts = _speed_setup(rounds=2)
    cost = ProfileCostModel(cost.profile.model_copy(update={"prefill_tokens": [8.0, 64.0],
                                                            "prefill_s": [0.020, 0.080]}))
    key = ("static:none:0", "c=1")
    runs, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, speed={key: [1.0, 1.0]},
                           prompt_speed={key: [1.0, 3.0]})[key]
    m = [side_metrics([r], None) for r in runs]
    assert m[1].ttft_p50 > 1.8 * m[0].ttft_p50
    assert m[1].tpot_p50 == pytest.approx(m[0].tpot_p50, rel=0.02)
    plain, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, speed={key: [1.0, 1.0]})[key]
    p = [side_metrics([r], None) for r in plain]
    assert p[0].ttft_p50 == pytest.approx(m[0].ttft_p50) and p[1].ttft_p50 == pytest.approx(p[0].ttft_p50, rel=0.02)
    mean, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, speed={key: [1.0, 1.0]},
                           prompt_speed={key: [float("nan"), 3.0]})[key]
    assert side_metrics([mean[0]], None).ttft_p50 == pytest.approx(m[1].ttft_p50)


def test_prompt_factors_from_the_runs_prompt_probes(tmp_path):
    """A run's prompt factor is the mean of its prompt probes before and after against the
    profile's prompt table; it survives the live file; runs without prompt probes (older
    files) or a profile without a table give none."""
    from adaptspec.sim.fidelity_run import load_live, prompt_factors, save_live

    _, _, cost, *_ = _speed_setup(rounds=1)
    prof = cost.profile.model_copy(update={"prefill_tokens": [8.0, 32.0], "prefill_s": [0.020, 0.050]})
    probe = {"before": {1: 0.018}, "after": {1: 0.018}, "prompt_before": {8: 0.041, 32: 0.101},
             "prompt_after": {8: 0.021, 32: 0.101}}
    run = Run(_rows(0.1, 0.02, 3), (0.0, 10.0), probe=probe)
    old = Run(_rows(0.1, 0.02, 3), (0.0, 10.0), probe={"before": {1: 0.018}, "after": {1: 0.018}})
    live = {"in-process": {("static:none:0", "c=1"): [run, old]}}
    factors, meta = prompt_factors(live, prof)
    want = math.sqrt((0.030 / 0.020) * (0.100 / 0.050))  # 1.5 at 8 tokens, 2.0 at 32 (beyond the 1 ms overhead)
    got = factors[("static:none:0", "c=1")]
    assert got[0] == pytest.approx(want) and math.isnan(got[1])
    assert meta["applied"] and meta["probed_runs"] == 1 and meta["table_s"] == {"8": 0.020, "32": 0.050}
    save_live(tmp_path / "live.json", live, prof)
    back = load_live(tmp_path / "live.json")
    assert prompt_factors(back, prof)[0][("static:none:0", "c=1")][0] == pytest.approx(want)
    assert prompt_factors({"in-process": {("static:none:0", "c=1"): [old]}}, prof) == ({}, {"applied": False,
                                                                                          "table_s": meta["table_s"]})
    assert prompt_factors(live, cost.profile)[0] == {}  # no prompt table
    assert prompt_factors(live, prof, enabled=False)[0] == {}


def test_speed_factors_from_probes_and_old_live_files_without_them(tmp_path):
    """The factor of a run is (mean of its probes before and after) / the calibration's
    reference, geometric mean over batch sizes; a version-1 live file (no probes) still loads,
    and then, as with a profile that has no probe, no factor is applied and a note says why."""
    from adaptspec.control.costs import SpeedProbeRef
    from adaptspec.sim.fidelity_run import load_live, save_live, speed_factors

    _, _, cost, *_ = _speed_setup(rounds=1)
    prof = cost.profile.model_copy(update={"probe": SpeedProbeRef(batch_sizes=[1, 8], start_s=[0.010, 0.030],
                                                                   end_s=[0.014, 0.034])})
    run = Run(_rows(0.1, 0.02, 3), (0.0, 10.0), probe={"before": {1: 0.018, 8: 0.060}, "after": {1: 0.018, 8: 0.068}})
    live = {"in-process": {("static:none:0", "c=1"): [run]}}
    factors, meta, notes = speed_factors(live, prof)
    want = math.sqrt((0.018 / 0.012) * (0.064 / 0.032))  # 1.5 at batch 1, 2.0 at batch 8
    assert factors[("static:none:0", "c=1")] == [pytest.approx(want)] and notes == []
    assert meta["applied"] and meta["median"] == pytest.approx(want)
    assert meta["calibration_drift"] == pytest.approx(math.sqrt(1.4 * 34 / 30))
    save_live(tmp_path / "live.json", live, prof)
    back = load_live(tmp_path / "live.json")["in-process"][("static:none:0", "c=1")][0]
    assert back.probe == run.probe
    assert json.loads((tmp_path / "live.json").read_text())["live"]["in-process"][0]["speed_factor"] == \
        pytest.approx(want)
    # a version-1 file, as the runs before probes wrote it
    old = {"version": 1, "live": {"in-process": [{"policy": "static:none:0", "level": "c=1", "window": [0.0, 10.0],
                                                  "steps": 3, "step_wall_s": 0.1, "busy_s": 0.1,
                                                  "rows": [["chat", 0.0, 0.1, 1.0, 5, False, False, 5, 0, {}, 0]]}]}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    runs = load_live(tmp_path / "old.json")
    assert runs["in-process"][("static:none:0", "c=1")][0].probe is None
    factors, meta, notes = speed_factors(runs, prof)
    assert factors == {} and not meta["applied"] and "no speed probes" in notes[0]
    factors, meta, notes = speed_factors(live, cost.profile)  # a profile calibrated before probes
    assert factors == {} and "no speed probe" in notes[0]


def _priced_shapes(cost, f: float, fp: float) -> list[list]:
    """Engine step shapes (``step_shapes.FIELDS``; decode-only and prompt-carrying, one and
    four requests, a draft batch) whose times are ``cost`` at speed ``f``, prompt table ``fp``."""
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.sim import step_shapes

    run_cost = ProfileCostModel(cost.profile.scaled(f, fp))
    out = []
    for i, (decoding, prompt, decode, ctx, batch) in enumerate(
            [(1, 0, 1, 40, []), (4, 0, 12, 300, [4, 4]), (2, 0, 2, 90, []), (1, 48, 1, 40, []),
             (4, 16, 12, 320, [4]), (0, 60, 0, 0, [])] * 3):
        s = [float(i), decoding, prompt, decode, ctx, 0, 0.0, 0.0, 0.0, *batch]
        s[6:9] = step_shapes.reprice(s, run_cost)
        out.append(s)
    return out


def test_step_factors_read_each_runs_speed_off_its_own_steps():
    """``--speed-from steps``: a run whose decode steps took 1.3x the profile's price and whose
    prompt chunks took 0.7x the prompt table's gets factors 1.3 and 0.7 (the prompt factor net of
    the decode rows it carried), whatever the mix of shapes. Controls: steps at the profile's own
    price give 1 and 1; a run with no steps on file gets none (nan), and files without any give
    no factors and a note."""
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.sim.fidelity_run import step_factors

    _, _, cost, *_ = _speed_setup(rounds=1)
    cost = ProfileCostModel(cost.profile.model_copy(update={"prefill_tokens": [8.0, 64.0], "prefill_s": [0.02, 0.08],
                                                            "draft_batch": [1.0, 8.0], "draft_s": [0.002, 0.004]}))
    key = ("static:none:0", "c=1")
    runs = [Run(_rows(0.1, 0.02, 3), (0.0, 10.0), shapes=_priced_shapes(cost, 1.3, 0.7)),
            Run(_rows(0.1, 0.02, 3), (0.0, 10.0), shapes=_priced_shapes(cost, 1.0, 1.0)),
            Run(_rows(0.1, 0.02, 3), (0.0, 10.0))]
    speed, prompt_speed, meta, p_meta, notes = step_factors({"in-process": {key: runs}}, cost)
    assert speed[key][:2] == [pytest.approx(1.3), pytest.approx(1.0)] and math.isnan(speed[key][2])
    assert prompt_speed[key][:2] == [pytest.approx(0.7), pytest.approx(1.0)] and math.isnan(prompt_speed[key][2])
    assert meta["source"] == "steps" and meta["probed_runs"] == 2 and p_meta["median"] == pytest.approx(0.85)
    assert [r["decode_steps"] for r in meta["per_run"]] == [9, 9, 0] and "steps" in notes[0]
    none = step_factors({"in-process": {key: [runs[2]]}}, cost)
    assert none[0] == {} and not none[2]["applied"] and "no live run" in none[4][0]


def test_a_run_whose_probes_disagree_is_simulated_without_its_factor():
    """Two probes half a second each, a minute apart, that differ by more than the tolerance
    cannot say how fast the minute between them ran: that run gets no factor (nan: its level's
    other rounds', else 1) and a note; runs whose probes agree keep theirs. Control: with no
    tolerance (inf) every run keeps its factor."""
    from adaptspec.control.costs import SpeedProbeRef
    from adaptspec.sim.fidelity_run import _round_factors, prompt_factors, speed_factors

    _, _, cost, *_ = _speed_setup(rounds=1)
    prof = cost.profile.model_copy(update={"probe": SpeedProbeRef(batch_sizes=[1, 8], start_s=[0.010, 0.030],
                                                                   end_s=[0.010, 0.030]),
                                           "prefill_tokens": [8.0, 32.0], "prefill_s": [0.020, 0.050]})
    steady = Run(_rows(0.1, 0.02, 3), (0.0, 10.0), probe={"before": {1: 0.012, 8: 0.036}, "after": {1: 0.0125, 8: 0.036},
                                                          "prompt_before": {8: 0.021}, "prompt_after": {8: 0.021}})
    jumpy = Run(_rows(0.1, 0.02, 3), (0.0, 10.0), probe={"before": {1: 0.010, 8: 0.030}, "after": {1: 0.010, 8: 0.042},
                                                         "prompt_before": {8: 0.021}, "prompt_after": {8: 0.031}})
    live = {"in-process": {("static:none:0", "c=1"): [steady, jumpy]}}
    factors, meta, notes = speed_factors(live, prof, tolerance=0.1)
    f = factors[("static:none:0", "c=1")]
    assert f[0] == pytest.approx(math.sqrt(1.225 * 1.2)) and math.isnan(f[1])
    assert [r["agreed"] for r in meta["per_run"]] == [True, False] and meta["per_run"][1]["apart"] == pytest.approx(0.4)
    assert "1 of 2 runs" in notes[0] and "--speed-from steps" in notes[0] and meta["tolerance"] == 0.1
    assert _round_factors(f, 1.0)(1) == pytest.approx(f[0])  # the other round's factor stands in
    assert _round_factors([f[1]], 1.0)(0) == 1.0  # none: the calibration's speed
    pf = prompt_factors(live, prof, tolerance=0.1)[0][("static:none:0", "c=1")]
    assert math.isfinite(pf[0]) and math.isnan(pf[1])
    # the control: without a tolerance the jumpy run's mean is taken at face value
    loose, meta, notes = speed_factors(live, prof)
    assert loose[("static:none:0", "c=1")][1] == pytest.approx(math.sqrt(1.0 * 1.2)) and notes == []
    assert math.isfinite(prompt_factors(live, prof)[0][("static:none:0", "c=1")][1])


def _cache_run(uses: list[tuple[str, int, int]]) -> Run:
    """A live run whose requests were sent in this order: (class, prompt index, cached tokens)."""
    rows = [Row(c, float(n), float(n) + 0.1, float(n) + 0.5, 10, prompt_index=i, cached_tokens=k)
            for n, (c, i, k) in enumerate(uses)]
    return Run(rows, (0.0, float(len(uses))))


def test_cache_replay_replays_each_runs_prefix_cache_hits_in_send_order():
    """By hand: pools of two prompts per class; the pool becomes one copy per time the run sent
    its prompts, copy j less what the cache served the j-th request of that prompt; a prompt sent
    fewer times takes its median in the run, one never sent the median over all runs (the CSV's);
    at least one token is always prefilled. Control: another run gets its own hits."""
    from adaptspec.sim.fidelity_run import cache_replay

    ps_rows = [("a", 40, 7, 16), ("a", 50, 8, 32), ("b", 30, 9, 16), ("b", 70, 6, 0)]
    run0 = _cache_run([("a", 0, 32), ("b", 0, 16), ("a", 1, 48), ("b", 1, 64),
                       ("a", 0, 16), ("b", 0, 29), ("a", 1, 32)])
    run1 = _cache_run([("a", 0, 0), ("b", 0, 0)])
    live = {"in-process": {("p", "c=1"): [run0, run1]},
            "grpc": {("p", "c=1"): [_cache_run([("a", 0, 39)] * 3)]}}  # the first path's run counts
    sets, served = cache_replay(ps_rows, live, ["a", "b"])
    s0, s1 = sets[("p", "c=1")]
    assert s0.prompt_tokens[0].tolist() == [40 - 32, 50 - 48, 40 - 16, 50 - 32]
    assert s0.cached_tokens[0].tolist() == [32, 48, 16, 32]  # read as context by the simulated passes
    # b1 was sent once (64 cached of 70), b0 twice; b1's second copy: its median in the run
    assert s0.prompt_tokens[1].tolist() == [30 - 16, 70 - 64, 30 - 29, 70 - 64]
    assert s0.output_tokens[0].tolist() == [7, 8, 7, 8] and s0.output_tokens[1].tolist() == [9, 6, 9, 6]
    # copy j of prompt i is prompt i (acceptance replays per prompt by it)
    assert [x.tolist() for x in s0.prompt_ids] == [[0, 1, 0, 1]] * 2 and s1.prompt_ids[0].tolist() == [0, 1]
    # run 1 sent a0 and b0 once with nothing cached; a1 and b1 take the CSV's medians
    assert s1.prompt_tokens[0].tolist() == [40, 50 - 32] and s1.prompt_tokens[1].tolist() == [30, 70]
    assert served[("p", "c=1")] == pytest.approx([(32 + 16 + 48 + 64 + 16 + 29 + 32) / 7, 0.0])
    full = cache_replay([("a", 20, 5, 0)], {"x": {("p", "c=1"): [_cache_run([("a", 0, 20)])]}}, ["a"])[0]
    assert full[("p", "c=1")][0].prompt_tokens[0].tolist() == [1]  # all cached: one token still prefilled
    assert full[("p", "c=1")][0].cached_tokens[0].tolist() == [19]


def test_a_run_whose_cache_served_less_is_simulated_with_a_later_first_token():
    """Round 1's live cache served nothing, round 0's most of each prompt: simulated round 1's
    TTFT is higher by about the price of the extra prompt tokens. Control: one prompt set for both
    rounds (no replay) simulates them alike."""
    from adaptspec.sim.closed_loop import PromptSet
    from adaptspec.sim.fidelity_run import simulate_all

    cfg, opts, cost, truths, specs, prompts = _speed_setup(rounds=2)
    key = ("static:none:0", "c=1")
    warm, cold = PromptSet([np.array([4, 6])], [np.array([30, 50])]), PromptSet([np.array([40, 60])], [np.array([30, 50])])
    runs, _ = simulate_all(cfg, opts, cost, truths, specs, prompts, run_prompts={key: [warm, cold]})[key]
    ttft = [side_metrics([r], None).ttft_p50 for r in runs]
    assert ttft[1] > ttft[0] * 1.3
    plain, _ = simulate_all(cfg, opts, cost, truths, specs, prompts)[key]
    base = [side_metrics([r], None).ttft_p50 for r in plain]
    assert base[1] == pytest.approx(base[0], rel=0.02) and base[0] == pytest.approx(ttft[1], rel=0.02)


def test_the_path_outside_the_engine_is_measured_live_and_added_to_the_simulated_tokens(tmp_path):
    """Through a service the client's TTFT holds the engine's plus the path's (proxy, ingress,
    replica, engine pipe): rows keep that difference, the live file keeps it (version 2 files,
    without it, still load), and a path's simulated runs are compared with every token that
    much later: TTFT matches, TPOT does not move. Control: ``--no-path-delay`` (delays None)."""
    from adaptspec.serve.loadtest import RequestRecord
    from adaptspec.sim.fidelity_run import compare, load_live, path_delays, rows_from_records, save_live

    recs = [RequestRecord("c", 0.13 + 0.01 * i, 0.33 + 0.01 * i, 11, start_s=float(i), engine_ttft_s=0.03)
            for i in range(10)]
    recs.append(RequestRecord("c", 0.2, 0.5, 11, start_s=10.0))  # in-process: no engine TTFT
    rows = rows_from_records(recs)
    assert [r.path_s for r in rows[:3]] == pytest.approx([0.10, 0.11, 0.12]) and math.isnan(rows[-1].path_s)
    live = {"grpc": {("static:none:0", "c=1"): [Run(rows, (0.0, 12.0))]},
            "in-process": {("static:none:0", "c=1"): [Run(_rows(0.03, 0.02, 11), (0.0, 12.0))]}}
    delays = path_delays(live)
    assert delays == {"grpc": {("static:none:0", "c=1"): pytest.approx(0.145)}}  # the median of 0.10 .. 0.19
    sim = {("static:none:0", "c=1"): ([Run(_rows(0.03, 0.02, 11), (0.0, 12.0))], {})}
    cell = lambda d: next(c for c in compare("grpc", live["grpc"], sim, ["c"], d) if c.request_class == "c")  # noqa: E731
    with_delay, without = cell(delays["grpc"]), cell(None)
    assert with_delay.sim.ttft_p50 == pytest.approx(0.03 + 0.145) and without.sim.ttft_p50 == pytest.approx(0.03)
    assert with_delay.sim.tpot_p50 == pytest.approx(without.sim.tpot_p50) == pytest.approx(0.02)
    assert sim[("static:none:0", "c=1")][0][0].rows[0].first_token_s == pytest.approx(0.03)  # not changed in place
    save_live(tmp_path / "live.json", live)
    back = load_live(tmp_path / "live.json")
    assert [r.path_s for r in back["grpc"][("static:none:0", "c=1")][0].rows][:2] == pytest.approx([0.10, 0.11])
    old = json.loads((tmp_path / "live.json").read_text())
    old["version"] = 2
    for run in old["live"]["grpc"]:
        run["rows"] = [row[:11] for row in run["rows"]]
    (tmp_path / "v2.json").write_text(json.dumps(old))
    assert path_delays(load_live(tmp_path / "v2.json")) == {}


def test_step_shapes_price_the_simulated_steps_on_their_own_profile_with_a_control():
    """Every simulated step keeps its shape, and the shape priced again on the profile it ran
    on gives its own time: the re-pricing the report applies to live steps is the simulator's
    own pricing. Controls: steps 25% slower than the profile show a -20% priced error, and a
    mix of other shapes (4 clients against 1) shows in the shares, not in the price."""
    from adaptspec.sim import step_shapes
    from adaptspec.sim.fidelity_run import shape_tables, simulate_all

    cfg, opts, cost, truths, specs, prompts = _speed_setup(rounds=1)
    opts.levels = [1, 4]
    sim = simulate_all(cfg, opts, cost, truths, specs, prompts)
    for (_, level), (runs, _) in sim.items():
        run = runs[0]
        assert run.shapes and len(run.shapes) == run.steps
        assert sum(s[6] + s[7] + s[8] for s in run.shapes) == pytest.approx(run.step_wall_s)
        for s in run.shapes:
            assert run.window[0] <= s[0] <= run.window[1]
            assert sum(step_shapes.reprice(s, cost)) == pytest.approx(s[6] + s[7] + s[8])
    one = sim[("static:none:0", "c=1")][0][0]
    assert {s[1] for s in one.shapes} <= {0, 1}  # one client: its prompt pass, then decoding alone
    slow = [[*s[:6], *(1.25 * x for x in s[6:9]), *s[9:]] for s in one.shapes]
    key = ("static:none:0", "c=1")
    live = {"in-process": {key: [Run([], one.window, shapes=slow)]}}
    rows = shape_tables(live, sim, cost, {}, {})[("in-process", *key)]
    total = rows[-1]
    assert total["decoding"] == "all" and total["share_live"] == total["share_sim"] == 1.0
    assert total["repriced_ms"] / total["live_ms"] == pytest.approx(0.8)
    assert total["sim_ms"] == pytest.approx(total["repriced_ms"])
    # the same live steps against the 4-client simulation: the shares differ, the price does not
    key4 = ("static:none:0", "c=4")
    live4 = {"in-process": {key4: [Run([], one.window, shapes=one.shapes)]}}
    rows4 = {(r["decoding"], r["prompt"]): r for r in shape_tables(live4, sim, cost, {}, {})[("in-process", *key4)]}
    alone = rows4[("1", False)]
    assert alone["share_live"] > 0.8 and alone["share_sim"] < 0.2
    assert alone["repriced_ms"] == pytest.approx(alone["live_ms"])
    assert rows4[("3-4", False)]["live_n"] == 0 and rows4[("3-4", False)]["sim_n"] > 0
    assert "priced err" in step_shapes.markdown({("in-process", *key4): list(rows4.values())})
    # a live step's shape: draft forwards per position from each draft request's k
    st = NS(batch_size=3, prefill_tokens=5, verify_tokens=12, context_tokens=100, draft_s=0.002, prefill_s=0.001,
            verify_s=0.003, other_s=0.0005,
            requests=[NS(drafter="draft", k=3), NS(drafter="draft", k=1), NS(drafter="ngram", k=4),
                      NS(drafter="none", k=0)])
    assert step_shapes.from_step(st, 7.0) == [7.0, 3, 5, 12, 100, 1, 0.002, 0.004, 0.0005, 2, 1, 1]
