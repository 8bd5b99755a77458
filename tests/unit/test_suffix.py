"""The suffix drafter: hand-built token cases (why each answer is right is in its comment),
its bounded class store, and exactness in the engine (tiny models; the real one is slow)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from adaptspec.engine.suffix import ClassStore, SuffixProposer, TokenIndex


def _own(tokens):
    idx = TokenIndex()
    idx.extend(tokens)
    return idx


def test_longest_suffix_in_the_request_itself():
    p = SuffixProposer(use_class=False)
    # the context ends with 1 2 3, which occurred at 0..2 followed by 9 8 5; one occurrence:
    # every next token has count 1 of 1, confidence 1.0, until the occurrence reaches the end
    toks, conf = p.draft(_own([1, 2, 3, 9, 8, 5, 1, 2, 3]), "c", 4)
    assert toks == [9, 8, 5, 1] and conf == [1.0] * 4
    # the occurrence's continuation ends where the request's text ends (nothing past it)
    assert p.draft(_own([4, 5, 6, 4, 5]), "c", 8)[0] == [6, 4, 5]
    assert p.draft(_own([4, 5, 6, 4, 5]), "c", 1)[0] == [6]


def test_deepest_match_wins_over_a_more_frequent_shallow_one():
    p = SuffixProposer(use_class=False)
    # (2, 3) occurs three times: followed by 7, 7 and (after 1 2 3) 9. The context ends
    # with 1 2 3, which matches 3 deep only at the third occurrence: its continuation 9 wins
    toks, _ = p.draft(_own([5, 2, 3, 7, 6, 2, 3, 7, 1, 2, 3, 9, 0, 1, 2, 3]), "c", 1)
    assert toks == [9]


def test_frequency_confidence_and_the_floor():
    p = SuffixProposer(min_confidence=0.6)
    for out in ([10, 11, 12, 13], [10, 11, 12, 13], [10, 11, 12, 14]):
        p.observe_output("json", out)
    own = _own([50, 10, 11, 12])
    # node "10 11 12" occurs 3 times: children 13 (2) and 14 (1): 13 with confidence 2/3;
    # then "... 12 13" has no continuation in either store: the chain ends
    toks, conf = p.draft(own, "json", 4)
    assert toks == [13] and conf == pytest.approx([2 / 3])
    assert p.draft(own, "json", 4, min_confidence=0.7) == ([], [])  # 2/3 is below the floor
    assert p.draft(own, "other", 4) == ([], [])  # another class has no such outputs


def test_class_outputs_and_own_tokens_pool_at_equal_depth():
    p = SuffixProposer()
    p.observe_output("c", [7, 8, 1])
    p.observe_output("c", [7, 8, 1])
    # own text: 7 8 2 ... 7 8 -> own says 2 (1 occurrence), the class says 1 (2 occurrences):
    # all three match 2 deep (the context's 3rd-last token 9 matches none): 1 wins, 2/3
    toks, conf = p.draft(_own([7, 8, 2, 9, 7, 8]), "c", 1)
    assert toks == [1] and conf == pytest.approx([2 / 3])


def test_ties_take_the_most_recent_occurrence():
    p = SuffixProposer(use_class=False, min_confidence=0.0)
    # (4, 5) is followed by 6 at the first occurrence and by 7 at the second: a tie, the
    # most recent (7) wins
    assert p.draft(_own([4, 5, 6, 0, 4, 5, 7, 0, 4, 5]), "c", 1)[0] == [7]


def test_a_single_token_match_is_the_fallback():
    # no 2-token suffix of the context (8 3) occurs; its last token 3 does, followed by 4 5
    p = SuffixProposer(use_class=False)
    assert p.draft(_own([3, 4, 5, 8, 3]), "c", 2)[0] == [4, 5]
    assert SuffixProposer(use_class=False, min_match=2).draft(_own([3, 4, 5, 8, 3]), "c", 2) == ([], [])


def test_no_match_or_no_room_proposes_nothing():
    p = SuffixProposer()
    assert p.draft(_own([1, 2, 3, 4]), "c", 4) == ([], [])
    assert p.draft(_own([1, 2]), "c", 4) == ([], [])
    assert p.draft(_own([1, 2, 1, 2]), "c", 0) == ([], [])


def test_matches_never_cross_document_boundaries():
    store = ClassStore(1000)
    store.add([1, 2])
    store.add([3, 4, 5])
    p = SuffixProposer(min_match=2)  # 2-token matches only: a lone "3" would match
    p.classes["c"] = store
    # "2 3" spans the boundary between the two outputs: no occurrence
    assert p.draft(_own([9, 2, 3]), "c", 2) == ([], [])
    assert p.draft(_own([9, 3, 4]), "c", 2)[0] == [5]


def test_class_store_evicts_the_oldest_output_and_stays_bounded():
    store = ClassStore(max_tokens=100)
    rng = random.Random(0)
    first = [1000, 1001, 1002, 1003]
    store.add(first)
    for _ in range(400):
        store.add([rng.randrange(500) for _ in range(rng.randint(5, 30))])
    assert store.tokens <= 100 + 30
    assert store.index.n <= 2 * 130 + 4096 + 64  # live + dead part before compaction
    p = SuffixProposer()
    p.classes["c"] = store
    assert p.draft(_own([1000, 1001]), "c", 2) == ([], [])  # the first output is gone
    # and the store still answers from what it keeps: the newest output
    last = store.docs[-1].tolist()
    toks, _ = p.draft(_own([7777] + last[:2]), "c", 1)
    assert toks and toks[0] in set(np.concatenate(list(store.docs)).tolist())


def test_classes_are_lru_bounded():
    p = SuffixProposer(max_classes=2)
    for c in ("a", "b", "c"):
        p.observe_output(c, [1, 2, 3])
    assert list(p.classes) == ["b", "c"]


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(max_depth=1)
    with pytest.raises(ValueError, match="min_confidence"):
        SuffixProposer(min_confidence=1.5)
    with pytest.raises(ValueError, match="min_match"):
        SuffixProposer(min_match=3)


# ---- in the engine ------------------------------------------------------------------
def _engine(folder, **cfg):
    from adaptspec import Engine

    eng = Engine.from_pretrained(str(folder), **cfg)
    prop = SuffixProposer()
    _add(eng, prop)
    return eng, prop


def _add(eng, prop) -> None:
    if hasattr(eng, "add_proposer"):
        eng.add_proposer("suffix", prop)
    else:  # the engine before Engine.add_proposer
        eng.proposers["suffix"] = prop


def test_greedy_output_with_the_suffix_drafter_equals_plain(tiny_dir):
    from adaptspec import SamplingParams, SpecConfig

    eng, prop = _engine(tiny_dir)
    # repetitive prompts, so the drafter has something to propose
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5], [3] * 9, [7, 8, 9, 7, 8]]
    p = SamplingParams(max_new_tokens=24)
    plain = eng.generate(prompts, p, SpecConfig("none", 0), request_class="x")
    prop.classes.clear()  # the plain run's answers to these very prompts must not be in the store
    for k in (3, 8):  # the second round also drafts from the first round's outputs, stored in class "x"
        mixed = [SpecConfig("suffix", k), SpecConfig("ngram", 2), SpecConfig("suffix", k), SpecConfig("none", 0)]
        spec = eng.generate(prompts, p, mixed, request_class="x")
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert "x" in prop.classes and prop.classes["x"].tokens > 0
    assert eng.totals.drafted > 0 and eng.totals.accepted > 0
    assert not prop._own  # every request released its own index


def test_sampled_requests_run_and_a_seed_reproduces_them(tiny_dir):
    """Stochastic requests go through the exact verifier with one-hot q. A seeded request
    repeats itself given the same drafts (a fresh store each time: drafts from a store
    that grew would consume the request's random stream differently)."""
    from adaptspec import SamplingParams, SpecConfig

    p = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3)
    runs = []
    eng, _ = _engine(tiny_dir)
    for _ in range(2):
        _add(eng, SuffixProposer())
        runs.append(eng.generate([[1, 2, 1, 2, 1]], p, SpecConfig("suffix", 4))[0].token_ids)
    assert len(runs[0]) == 20 and runs[0] == runs[1]


@pytest.mark.slow
def test_greedy_output_equals_plain_on_the_real_model(smollm_dir):
    from adaptspec import SamplingParams, SpecConfig

    from adaptspec.engine.suffix_bench import structured_prompts

    eng, prop = _engine(smollm_dir, dtype="float32", max_num_seqs=4, max_model_len=1024)
    prompts = [x.prompt for x in structured_prompts(6, seed=1)]
    p = SamplingParams(max_new_tokens=40)
    plain = eng.generate(prompts, p, SpecConfig("none", 0), request_class="extract")
    spec = eng.generate(prompts, p, SpecConfig("suffix", 6), request_class="extract")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in spec) > 0


def test_the_replay_counts_what_the_engine_counts(tiny_dir):
    """``suffix_bench.simulate`` replays greedy drafting without the model; on the same
    requests (batch 1, in order) its per-class counts equal the engine's."""
    from adaptspec import SamplingParams, SpecConfig
    from adaptspec.engine.suffix_bench import simulate

    eng, _ = _engine(tiny_dir, max_num_seqs=1)
    prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 6], [1, 2, 3, 1, 2, 3], [7, 7, 7], [4, 5, 6, 4]]
    classes = ["a", "b", "a", "b", "a"]
    p = SamplingParams(max_new_tokens=16)
    outs = [eng.generate([q], p, SpecConfig("none", 0), request_class=c)[0].token_ids for q, c in zip(prompts, classes)]
    for drafter in ("ngram", "suffix"):
        _add(eng, SuffixProposer())  # a fresh store: the plain run's answers are not in it
        got = {}
        for q, c in zip(prompts, classes):
            st = eng.generate([q], p, SpecConfig(drafter, 4), request_class=c)[0].stats
            g = got.setdefault(c, {"steps": 0, "emitted": 0, "drafted": 0, "accepted": 0})
            for key in g:
                g[key] += getattr(st, key)
        assert simulate(prompts, outs, classes, drafter, 4, 16) == got, drafter
    assert got["a"]["accepted"] > 0
