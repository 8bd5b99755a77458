"""Engine behaviour on tiny random models: batching, seeds, stops, bad input."""
from __future__ import annotations

import pytest

from adaptspec import Engine, SamplingParams, SpecConfig
from tests.conftest import first_fresh_word, make_tiny_model


@pytest.fixture(scope="module")
def engine(tiny_dir, tiny_draft_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_draft_dir), max_num_seqs=4, max_model_len=128)


PROMPTS = [[1, 2, 3], [4, 5, 4, 5, 4, 5, 4], [7] * 20, [9, 3, 9, 3, 9, 1, 2, 9, 3]]


def test_greedy_speculation_equals_plain(engine):
    params = SamplingParams(max_new_tokens=24)
    plain = [o.token_ids for o in engine.generate(PROMPTS, params, SpecConfig())]
    for spec in (SpecConfig("ngram", 1), SpecConfig("ngram", 8), SpecConfig("draft", 3), SpecConfig("draft", 8)):
        outs = engine.generate(PROMPTS, params, spec)
        assert [o.token_ids for o in outs] == plain, spec
        assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    assert engine.totals.accepted > 0


def test_continuous_batching_matches_running_alone(engine):
    """Requests of different lengths and k join mid-way and leave early: same tokens as alone."""
    specs = [SpecConfig("draft", 2), SpecConfig("ngram", 5), SpecConfig(), SpecConfig("draft", 7),
             SpecConfig("ngram", 1), SpecConfig("draft", 4)]
    prompts = PROMPTS + [[2, 2, 8], [6, 1]]
    lens = [5, 30, 12, 20, 8, 16]
    alone = [engine.generate([p], SamplingParams(max_new_tokens=n), s)[0].token_ids
             for p, n, s in zip(prompts, lens, specs)]
    done, rids = {}, []
    for i, (p, n, s) in enumerate(zip(prompts, lens, specs)):  # one joins every step; 6 > 4 slots
        rids.append(engine.add_request(p, SamplingParams(max_new_tokens=n), s))
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[r] for r in rids] == alone


def test_arm_may_change_every_step(engine):
    params = SamplingParams(max_new_tokens=30)
    plain = engine.generate([PROMPTS[1]], params)[0].token_ids
    rid = engine.add_request(PROMPTS[1], params, SpecConfig("draft", 3))
    arms = [SpecConfig("ngram", 4), SpecConfig(), SpecConfig("draft", 1), SpecConfig("draft", 6)]
    out, i = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            out = o if o.finished else out
        if rid in engine.requests:
            engine.set_spec(rid, arms[i % len(arms)])
            i += 1
    assert out.token_ids == plain
    assert len(out.stats.arms) >= 3


def test_per_request_seeds_reproduce(engine):
    p = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s) for s in (1, 1, 2)]
    a = engine.generate(PROMPTS[:1] * 3, p, SpecConfig("draft", 3))
    b = engine.generate(PROMPTS[:1] * 3, p, SpecConfig("draft", 3))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids == a[1].token_ids != a[2].token_ids


def test_stats_are_consistent(engine):
    out = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=20), SpecConfig("ngram", 4))[0]
    st = out.stats
    # every output token but the prefill's first comes from a verification step
    assert st.emitted == len(out.token_ids) - 1
    assert st.accepted == sum(st.accepted_per_position) <= st.drafted
    # a step emits its accepted tokens plus one (recovered or bonus), except where the request
    # stopped inside its last step, which can cut at most k = 4 of them
    assert 0 <= st.accepted + st.steps - st.emitted <= 4 and st.steps >= 1
    step = engine.last_step
    assert step.verify_tokens >= step.batch_size and step.wall_s >= step.verify_s


def test_stop_strings_and_abort(engine):
    out = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=20))[0]
    word = out.text.split()[2]
    stopped = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=20, stop=[word]))[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text and len(stopped.token_ids) < 20
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=50))
    engine.step()
    free_before, blocks_before = engine.free_seqs, engine.pool.num_free
    assert engine.abort(rid) and engine.free_seqs == free_before + 1
    assert engine.pool.num_free > blocks_before  # its KV blocks went back
    assert not engine.has_unfinished()


@pytest.mark.parametrize("make,field", [
    (lambda: SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=-1), "top_k"),
    (lambda: SpecConfig("ngram", 17), "k"),
    (lambda: SpecConfig("ngram", -1), "k"),
    (lambda: SpecConfig("medusa", 2), "drafter"),
])
def test_bad_parameters_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):  # the word, not letters inside another
        make()


def test_bad_requests_name_the_field(engine, tiny_dir):
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("   ")
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], SamplingParams(max_new_tokens=500))
    limit = engine.config.max_model_len - 16 - 1  # room for k = 16 candidates and the bonus token
    with pytest.raises(ValueError, match=r"^prompt: 111 tokens"):  # too long whatever max_new_tokens is
        engine.add_request([1] * limit, SamplingParams(max_new_tokens=1))
    engine.abort(engine.add_request([1] * (limit - 1), SamplingParams(max_new_tokens=1)))  # the longest that fits
    real = engine.encode
    try:
        engine.encode = lambda prompt, raw=False: []  # a text that tokenizes to nothing
        with pytest.raises(ValueError, match=r"^prompt: the prompt tokenizes to no tokens"):
            engine.add_request("\u200b")
    finally:
        engine.encode = real
    no_draft = Engine.from_pretrained(str(tiny_dir), max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match="drafter"):
        no_draft.add_request([1], spec=SpecConfig("draft", 2))


def test_a_temperature_too_small_to_divide_by_is_greedy(engine):
    """logits / 1e-30 overflow to inf and softmax to NaN: such temperatures are greedy, their limit."""
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=1e-4).greedy
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12))[0].token_ids
    tiny = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, temperature=1e-30, seed=1),
                           SpecConfig("draft", 3))[0].token_ids
    assert tiny == greedy


def test_draft_with_another_vocabulary_is_refused(tiny_dir, tmp_path):
    other = make_tiny_model(tmp_path, vocab=20, seed=2)
    with pytest.raises(ValueError, match="draft: vocabulary"):
        Engine.from_pretrained(str(tiny_dir), draft=str(other))


def test_failing_drafter_means_k_zero_not_a_lost_request(engine, monkeypatch):
    params = SamplingParams(max_new_tokens=20)
    plain = engine.generate(PROMPTS[:2], params)
    prop = engine.proposers["draft"]
    real, calls = prop.propose, {"n": 0}

    def flaky(seqs, ks):  # fails every other call, mid-stream
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise RuntimeError("drafter replica went away")
        return real(seqs, ks)

    monkeypatch.setattr(prop, "propose", flaky)
    errors = engine.drafter_errors
    outs = engine.generate(PROMPTS[:2], params, SpecConfig("draft", 4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert engine.drafter_errors > errors


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(engine):
    full = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12))[0]
    words = full.text.split(" ")
    at = first_fresh_word(full.text)
    out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=at + 1, stop=[words[at]]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.find(words[at])]


def test_accepted_counts_only_drafted_tokens_kept(tiny_dir):
    """The target as its own draft accepts every candidate; a stop string inside a step ends the
    request there, and the candidates after it are not counted as accepted."""
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_seqs=2, max_model_len=128)
    full = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=20))[0]
    words = full.text.split(" ")
    at = first_fresh_word(full.text, 3)
    steps = []
    eng.step_listeners.append(steps.append)
    out = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=20, stop=[words[at]]), SpecConfig("draft", 8))[0]
    rs = [r for s in steps for r in s.requests]
    assert out.finish_reason == "stop" and rs[-1].drafted > rs[-1].emitted  # the stop cut the last step short
    assert all(r.accepted <= r.emitted for r in rs) and out.stats.accepted == sum(r.accepted for r in rs)
    assert sum(out.stats.accepted_per_position) == out.stats.accepted


def test_a_draft_with_a_shorter_context_caps_the_engines(tiny_dir, tmp_path):
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(tiny_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (short / "config.json").write_text(json.dumps(cfg))
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(short), max_num_seqs=1, max_model_len=128)
    assert eng.config.max_model_len == 48
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=40))
