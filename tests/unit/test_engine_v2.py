"""Engine v2: the paged KV cache, prefix caching, chunked prefill and the flattened step.

Every test compares against an independent run (caching off, one big budget, separate
passes) and carries a check that the comparison can fail.
"""
from __future__ import annotations

import random

import pytest
import torch

from adaptspec import Engine, SamplingParams, SpecConfig
from adaptspec.engine.kv_cache import BlockPool, KVCacheManager
from adaptspec.models.batch import FlatBatch

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int, vocab: int = 16) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    base = _prompt(40, 1)  # 2 full blocks of 16 shared, then each prompt its own tail
    return [base + _prompt(n, 10 + i) for i, n in enumerate((5, 13, 1, 30))]


def _run_one_by_one(engine, prompts, params, spec):
    return [engine.generate([p], params, spec)[0] for p in prompts]


@pytest.mark.parametrize("spec", [SpecConfig("none", 0), SpecConfig("ngram", 4), SpecConfig("draft", 3)])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=24, temperature=0.9, seed=5,
                                                           ignore_eos=True)])
def test_prefix_cache_gives_the_same_tokens(tiny_dir, shared_prefix_prompts, spec, params):
    """Requests sharing a 40-token prefix reuse its 2 full blocks; with speculation and
    rollbacks crossing block boundaries (24 tokens from positions 41-70) the tokens equal
    those of an engine without prefix caching."""
    on = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir))  # self-draft: long accepted runs
    off = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), enable_prefix_caching=False)
    got = _run_one_by_one(on, shared_prefix_prompts, params, spec)
    want = _run_one_by_one(off, shared_prefix_prompts, params, spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats.cached_prompt_tokens for o in got] == [0, 32, 32, 32]
    assert [o.stats.cached_prompt_tokens for o in want] == [0, 0, 0, 0]
    if spec.drafter == "draft":
        assert sum(o.stats.accepted for o in got) > 0  # rollbacks and acceptances both happened
    on.pool.check()
    assert on.pool.num_free == on.num_blocks


def test_prefix_cache_really_serves_the_kv(tiny_dir, shared_prefix_prompts):
    """The control: corrupt the cached blocks' keys and a request that reuses them decodes
    other tokens (so the equality above is not two engines computing everything)."""
    eng = Engine.from_pretrained(str(tiny_dir))
    first = eng.generate([shared_prefix_prompts[0]], GREEDY)[0]
    assert first.stats.cached_prompt_tokens == 0
    want = Engine.from_pretrained(str(tiny_dir), enable_prefix_caching=False).generate(
        [shared_prefix_prompts[1]], GREEDY)[0].token_ids
    cached = list(eng.pool.cached.values())
    for layer in eng.target.model.k_cache:
        layer[cached] = torch.randn_like(layer[cached]) * 10
    got = eng.generate([shared_prefix_prompts[1]], GREEDY)[0]
    assert got.stats.cached_prompt_tokens == 32 and got.token_ids != want


@pytest.mark.parametrize("budget", [8, 17, 64, 1024])
def test_chunked_prefill_gives_the_same_tokens_at_any_budget(tiny_dir, budget):
    """A 150-token prompt arriving while others decode, prefilled in chunks of the step's
    token budget: every request's tokens equal an engine with one large budget."""
    prompts = [_prompt(6, 3), _prompt(150, 4), _prompt(9, 5), _prompt(70, 6)]
    specs = [SpecConfig("ngram", 3), SpecConfig("draft", 2), SpecConfig("none", 0), SpecConfig("draft", 4)]
    ref = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_batched_tokens=4096)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY, specs)]
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_num_seqs=4,
                                 max_num_batched_tokens=budget)
    steps = []
    eng.step_listeners.append(steps.append)
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, specs)]
    assert got == want
    assert max(s.prefill_tokens + s.verify_tokens for s in steps) <= budget
    if budget < 150:  # the long prompt really was cut
        assert sum(1 for s in steps if s.prefill_tokens) > 1


def test_a_long_prompt_never_stalls_running_requests(tiny_dir):
    """While a 300-token prompt prefills in 32-token chunks, a running request gets a token
    in every step."""
    eng = Engine.from_pretrained(str(tiny_dir), max_num_batched_tokens=32)
    rid = eng.add_request(_prompt(5, 7), SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.step()
    eng.add_request(_prompt(300, 8), SamplingParams(max_new_tokens=4, ignore_eos=True))
    gaps = 0
    for _ in range(12):  # the long prompt needs ~10 steps
        outs = {o.request_id: o for o in eng.step()}
        gaps += rid not in outs or not outs[rid].new_token_ids
    assert gaps == 0


def test_mixed_step_equals_separate_passes(tiny_dir):
    """One forward over a prompt chunk, a decode row and a 4-token verification row gives
    the logits of the three run apart (each on its own model copy)."""
    from adaptspec.models.loader import load_model

    models = [load_model(str(tiny_dir)).model for _ in range(4)]
    for m in models:
        m.allocate_kv(12, 16)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    ctx = [_prompt(20, 11), _prompt(33, 12), _prompt(7, 13)]
    rows = [_prompt(9, 14), _prompt(1, 15), _prompt(5, 16)]
    # each sequence's cache holds its context; then row 0 is a 9-token prompt chunk, row 1 a
    # decode token, row 2 a token plus 4 candidates
    for m in models:
        m.forward(FlatBatch.build(ctx, [0, 0, 0], tables, [], 16, "cpu"))
    lens = [len(c) for c in ctx]
    n = [len(r) for r in rows]
    all_rows = list(range(sum(n)))
    mixed, _ = models[0].forward(FlatBatch.build(rows, lens, tables, all_rows, 16, "cpu"))
    at = 0
    for i in range(3):
        alone, _ = models[1 + i].forward(FlatBatch.build([rows[i]], [lens[i]], [tables[i]],
                                                         list(range(n[i])), 16, "cpu"))
        assert (mixed[at:at + n[i]] - alone).abs().max() <= 1e-5
        at += n[i]
    # the control: the same rows over a context one position shorter differ
    short, _ = models[1].forward(FlatBatch.build([rows[0]], [lens[0] - 1], [tables[0]], list(range(n[0])),
                                                 16, "cpu"))
    assert (mixed[:n[0]] - short).abs().max() > 1e-3


def test_preemption_under_a_small_pool_keeps_every_token(tiny_dir):
    """A pool of 40 blocks for 6 requests that need up to 10 each: the scheduler preempts and
    recomputes; tokens equal an engine with room for all."""
    prompts = [_prompt(60 + 7 * i, 20 + i) for i in range(6)]
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    want = Engine.from_pretrained(str(tiny_dir)).generate(prompts, params, SpecConfig("ngram", 3))
    model_bytes = Engine.from_pretrained(str(tiny_dir)).target.model.kv_bytes_per_block(16)
    small = Engine.from_pretrained(str(tiny_dir), kv_cache_memory=40 * model_bytes, max_num_seqs=6)
    steps = []
    small.step_listeners.append(steps.append)
    got = small.generate(prompts, params, SpecConfig("ngram", 3))
    assert small.num_blocks == 40 and small.scheduler.num_preempted > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    small.pool.check()
    assert small.pool.num_free == 40


def test_pool_too_small_for_one_request_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Engine.from_pretrained(str(tiny_dir), kv_cache_memory=1000, max_model_len=512)


# ---- the block pool alone: invariants under random operations ------------------------
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


class _Seq:  # the fields KVCacheManager reads and writes
    def __init__(self, tokens):
        self.token_ids, self.block_table, self.block_hashes = tokens, [], []
        self.num_computed = self.num_registered = 0


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "commit", "rollback", "free"]),
                                     st.integers(0, 5), st.integers(1, 40)), max_size=60),
                  st.booleans())
def test_block_pool_invariants(ops, caching):
    """Whatever the order of admissions, growth, commits, rollbacks and frees: every block
    is free xor referenced, references equal the tables that hold the block, no table holds
    a block twice, and freeing everything returns every block."""
    pool = BlockPool(24, 4, caching)
    kv = KVCacheManager(pool)
    rng = random.Random(0)
    seqs: dict[int, _Seq] = {}
    for op, i, n in ops:
        s = seqs.get(i)
        if op == "admit" and s is None:
            s = _Seq([rng.randrange(3) for _ in range(n)])  # few distinct tokens: prefix hits happen
            kv.admit(s)
            seqs[i] = s
        elif s is None:
            continue
        elif op == "grow" and kv.can_grow(s, s.num_computed + n % 9 + 1):
            kv.grow(s, s.num_computed + n % 9 + 1)
        elif op == "commit":  # positions with a block become committed tokens
            room = len(s.block_table) * 4
            s.num_computed = min(room - 1 if room else 0, max(s.num_computed, room - 1))
            while len(s.token_ids) < s.num_computed + 1:
                s.token_ids.append(rng.randrange(3))
            kv.commit(s)
        elif op == "rollback":  # a rejection: fewer committed positions, tail blocks go back
            s.num_computed = max(s.num_registered * 4, s.num_computed - n % 5)
            del s.token_ids[s.num_computed + 1:]
            kv.commit(s)
        elif op == "free":
            kv.free(s)
            del seqs[i]
        pool.check()
        held = [b for s in seqs.values() for b in s.block_table]
        assert all(len(set(s.block_table)) == len(s.block_table) for s in seqs.values())
        assert sum(pool.ref_count) == len(held)
        for b in set(held):
            assert pool.ref_count[b] == held.count(b)
    for s in list(seqs.values()):
        kv.free(s)
    pool.check()
    assert pool.num_free == pool.num_blocks


def test_double_free_is_caught():
    pool = BlockPool(4, 4)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: needs a GPU (the CPU path is tested above)")
def test_cuda_engine_matches_the_cpu_engine(tiny_dir):
    prompts = [_prompt(30, 30), _prompt(70, 31)]
    cpu = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir)).generate(prompts, GREEDY, SpecConfig("draft", 3))
    gpu = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), device="cuda").generate(
        prompts, GREEDY, SpecConfig("draft", 3))
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
