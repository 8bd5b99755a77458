"""Engine guards found missing by a mutation audit (issue 30), on tiny random models.

Public API only (Engine, add_request, step, generate, set_spec, step_listeners, the
RequestOutput and StepStats fields), so the tests outlive changes to the engine's inside.
References are independent of the code under test where it matters: each request decoded
alone WITHOUT speculation (no rollback, no verifier), and the draft model run on its own
from the full context (what the co-located draft must propose if its state after every
step is right).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from adaptspec import Engine, SamplingParams, SpecConfig
from tests.conftest import first_fresh_word

PROMPTS = [[1, 2, 3], [4, 5, 4, 5, 4, 5, 4], [7] * 20, [9, 3, 9, 3, 9, 1, 2, 9, 3], [3, 7, 1], [6, 1]]


@pytest.fixture(scope="module")
def near_draft_dir(tiny_dir, tmp_path_factory):
    """The target with 6% noise on every weight: accepts about 60% of its greedy drafts, at
    every position (the random tiny draft accepts almost nothing, so its rollback would
    always be to zero accepted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(tiny_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.06 * torch.randn(p.shape, generator=g) * p.std().clamp(min=1e-3))
    out = tmp_path_factory.mktemp("near_draft")
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(tiny_dir, near_draft_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(near_draft_dir), max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def draft_alone(near_draft_dir):
    """The draft model as a target of its own: its greedy continuation of a context."""
    return Engine.from_pretrained(str(near_draft_dir), max_num_seqs=1, max_model_len=128)


def _run(engine, requests, arm_schedule=None):
    """Add ``requests`` ((prompt, params, spec, join_at_step)) as their step comes, step to
    the end; ``arm_schedule[i]``: arms request i cycles through, one per step. Returns the
    final outputs and every step's RequestStepStats per request, in order."""
    steps, done, rids = [], {}, [None] * len(requests)
    engine.step_listeners.append(steps.append)
    try:
        t = 0
        while t == 0 or engine.has_unfinished() or any(r is None for r in rids):
            for i, (prompt, params, spec, join) in enumerate(requests):
                if join == t:
                    rids[i] = engine.add_request(prompt, params, spec)
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            for i, arms in (arm_schedule or {}).items():
                if rids[i] in engine.requests and rids[i] not in done:
                    engine.set_spec(rids[i], arms[t % len(arms)])
            t += 1
    finally:
        engine.step_listeners.remove(steps.append)
    per_req = {rid: [r for st in steps for r in st.requests if r.request_id == rid] for rid in rids}
    return [done[r] for r in rids], [per_req[r] for r in rids]


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_draft_model_proposes_after_every_step_what_a_fresh_draft_would(engine, draft_alone):
    """Issue 30, bug 1: a draft whose KV length is rolled back one too far (or not at all)
    after verification raises, falls back to k = 0, and the output stays exact: only the
    drafter errors and the acceptance show it. Here every draft-model step of a mixed batch
    (k = 2, 5, 7 and a request that moves between the draft, n-gram and no drafting, so the
    draft catches up) must accept exactly as many tokens as the common prefix of the
    target's output and the draft model's own greedy continuation of the same context:
    what a draft whose state is right after every step proposes."""
    errors = engine.drafter_errors
    n = 28
    reqs = [(PROMPTS[0], SamplingParams(max_new_tokens=n), SpecConfig("draft", 2), 0),
            (PROMPTS[1], SamplingParams(max_new_tokens=n), SpecConfig("draft", 5), 0),
            (PROMPTS[4], SamplingParams(max_new_tokens=n), SpecConfig("draft", 7), 1),
            (PROMPTS[5], SamplingParams(max_new_tokens=n), SpecConfig("draft", 3), 2)]
    switch = {3: [SpecConfig("draft", 3), SpecConfig("ngram", 2), SpecConfig(), SpecConfig("draft", 4),
                  SpecConfig("draft", 1)]}
    outs, stats = _run(engine, reqs, switch)
    assert engine.drafter_errors == errors
    checked = partial = 0
    for (prompt, *_), out, rs in zip(reqs, outs, stats):
        toks, pos = out.token_ids, 1  # token 0 came from the prefill
        for j, r in enumerate(rs):
            if r.drafter == "draft" and r.k > 0:
                fresh = draft_alone.generate([prompt + toks[:pos]], SamplingParams(max_new_tokens=r.k))[0].token_ids
                want = _common_prefix(fresh, toks[pos:pos + r.k])
                assert (r.drafted, r.accepted) == (r.k, want), f"{out.request_id} step {j}: context of {pos} tokens"
                checked += 1
                partial += 0 < r.accepted < r.k
            pos += r.emitted
        assert pos == len(toks) == n
    # rollback after a partial acceptance, at many points: what the check is about
    assert checked >= 20 and partial >= 5


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(engine):
    """Issue 30, bug 5 (the README promises it): a request's random draws come from its own
    generator, as many per step as its own k needs, whatever else shares the batch (other
    seeds, other k, greedy requests, requests joining and leaving)."""
    mine = (PROMPTS[4], SamplingParams(max_new_tokens=24, temperature=1.0, seed=1234), SpecConfig("draft", 2))
    alone = engine.generate([mine[0]], mine[1], mine[2])[0].token_ids
    reqs = [(PROMPTS[1], SamplingParams(max_new_tokens=30, temperature=0.7, seed=5), SpecConfig("draft", 6), 0),
            (*mine, 1),
            (PROMPTS[2], SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=6),
             SpecConfig("ngram", 4), 1),
            (PROMPTS[3], SamplingParams(max_new_tokens=12), SpecConfig("draft", 5), 2),
            (PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=0.9, top_k=5, seed=7), SpecConfig("draft", 7), 3)]
    outs, _ = _run(engine, reqs)
    assert outs[1].token_ids == alone


def test_continuous_batching_with_speculation_equals_plain_decoding_alone(engine):
    """The reference is each request decoded alone without speculation: nothing there is
    rolled back or verified, so a bug shared by the speculative runs alone and batched (a
    target KV length not rolled back after a rejection) cannot hide."""
    specs = [SpecConfig("draft", 2), SpecConfig("ngram", 5), SpecConfig(), SpecConfig("draft", 7),
             SpecConfig("ngram", 1), SpecConfig("draft", 4)]
    lens = [5, 30, 12, 20, 8, 16]
    plain = [engine.generate([p], SamplingParams(max_new_tokens=n))[0].token_ids for p, n in zip(PROMPTS, lens)]
    reqs = [(p, SamplingParams(max_new_tokens=n), s, i) for i, (p, n, s) in enumerate(zip(PROMPTS, lens, specs))]
    outs, stats = _run(engine, reqs)  # one joins every step; 6 requests > 4 slots: some wait
    assert [o.token_ids for o in outs] == plain
    assert sum(r.accepted for rs in stats for r in rs) > 0
    assert any(r.accepted < r.drafted for rs in stats for r in rs)  # rejections: rollbacks happened


def test_several_stop_strings_cut_at_the_earliest_match(engine):
    """Issue 30, bug 4. Stop strings that complete on the same token but start at different
    places (``b``, ``a b``, ``x a b``) cut the text at the earliest start; one that never
    occurs does not keep another from stopping."""
    full = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=24))[0]
    words = full.text.split(" ")
    at = first_fresh_word(full.text, 3)  # words[at] first occurs at its own position
    start = [len(" ".join(words[:i])) + (1 if i else 0) for i in range(len(words))]  # where word i begins
    one, two, three = words[at], " ".join(words[at - 1:at + 1]), " ".join(words[at - 2:at + 1])
    cases = [([one, two], start[at - 1]), ([two, one], start[at - 1]), ([one, three, two], start[at - 2]),
             (["zzz", one], start[at]), ([one, "zzz"], start[at])]
    for spec in (SpecConfig(), SpecConfig("draft", 4)):
        for stops, cut in cases:
            out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=24, stop=stops), spec)[0]
            assert out.finish_reason == "stop", (stops, spec)
            assert out.text == full.text[:cut], (stops, spec)
            assert out.token_ids == full.token_ids[:at + 1], (stops, spec)  # stopped on the completing token


@pytest.fixture(scope="module")
def self_draft(tiny_dir):
    """The target as its own draft: greedy drafts are always accepted, so every step emits
    exactly k + 1 tokens and where a step starts is known."""
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_seqs=2, max_model_len=128)


def test_a_draft_equal_to_the_target_accepts_every_draft_and_the_step_stats_add_up(self_draft):
    outs, stats = _run(self_draft, [(PROMPTS[1], SamplingParams(max_new_tokens=30), SpecConfig("draft", 4), 0),
                                    (PROMPTS[3], SamplingParams(max_new_tokens=17), SpecConfig("draft", 3), 1)])
    for out, rs, k in zip(outs, stats, (4, 3)):
        assert [(r.drafted, r.accepted, r.emitted) for r in rs] == [(r.k, r.k, r.k + 1) for r in rs]
        assert all(r.k == min(k, n) for r, n in zip(rs, _remaining_after_each(rs, out)))
        assert out.stats.drafted == out.stats.accepted == sum(r.k for r in rs)
        assert out.ttft_s is not None and 0 <= out.ttft_s <= out.e2e_s
    steps = []
    self_draft.step_listeners.append(steps.append)
    try:
        self_draft.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_new_tokens=9), SpecConfig("draft", 2))
    finally:
        self_draft.step_listeners.remove(steps.append)
    for st in steps:
        assert st.wall_s == pytest.approx(st.prefill_s + st.draft_s + st.verify_s + st.other_s, rel=1e-6, abs=1e-9)
        assert st.batch_size == len(st.requests)
        assert st.verify_tokens == sum(r.drafted + 1 for r in st.requests)
        assert st.emitted == sum(r.emitted for r in st.requests)


def _remaining_after_each(rs, out):
    """Tokens a request may still draft before each step: the most its k is clamped to
    (``max_new_tokens`` minus those emitted so far, minus the one the step adds)."""
    left, out_left = [], len(out.token_ids) - 1
    for r in rs:
        left.append(out_left - 1)
        out_left -= r.emitted
    return left


@pytest.fixture(scope="module")
def eos_setup(tiny_dir, tmp_path_factory, self_draft):
    """A copy of the tiny target whose tokenizer (and config) has an EOS id: a token its
    greedy output first emits in the middle of a k = 4 step (with the self-draft, steps
    emit tokens 1-5, 6-10, ...)."""
    from transformers import AutoTokenizer

    prompt = PROMPTS[1]
    ref = self_draft.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
    pos = next(p for p in range(2, len(ref)) if ref.index(ref[p]) == p and (p - 1) % 5 != 4)
    eos = ref[pos]
    folder = tmp_path_factory.mktemp("tiny_eos")
    shutil.copytree(tiny_dir, folder, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.eos_token = f"t{eos}"
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            cfg = json.loads((folder / name).read_text())
            cfg["eos_token_id"] = eos
            (folder / name).write_text(json.dumps(cfg))
    eng = Engine.from_pretrained(str(folder), draft=str(folder), max_num_seqs=2, max_model_len=128)
    return eng, prompt, ref, pos


def test_eos_in_the_middle_of_a_step_ends_the_request_there(eos_setup):
    """The tokens a step accepted after the EOS are dropped, the EOS is the last token, and
    the drafted tokens past it do not count as accepted."""
    eng, prompt, ref, pos = eos_setup
    assert eng.tokenizer.eos_token_id == ref[pos]
    for spec in (SpecConfig("draft", 4), SpecConfig()):
        outs, stats = _run(eng, [(prompt, SamplingParams(max_new_tokens=40), spec, 0)])
        out, rs = outs[0], stats[0]
        assert out.token_ids == ref[:pos + 1], spec
        assert out.finish_reason == "stop"
        assert out.text == eng.tokenizer.decode(ref[:pos])  # the EOS itself is not text
        assert sum(r.emitted for r in rs) == pos
        if spec.k:
            assert rs[-1].emitted < rs[-1].drafted + 1  # the EOS landed inside the last step
            assert all(r.accepted <= r.emitted for r in rs) and out.stats.accepted == sum(r.accepted for r in rs)
    ignored = eng.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True), SpecConfig("draft", 4))[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
