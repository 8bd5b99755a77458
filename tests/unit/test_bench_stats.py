"""`adaptspec bench`'s acceptance and bound: the per-token acceptance recovers the rate the
bound's formula assumes; accepted / drafted does not (the negative control)."""
import numpy as np
import pytest

from adaptspec.tools.bench import analytic_bound, token_acceptance, verify_cost
from adaptspec.engine.stats import RequestStepStats, StepStats


def _steps(a: float, k: int, n: int, seed: int = 0) -> list[StepStats]:
    rng = np.random.default_rng(seed)
    ok = rng.random((n, k)) < a
    accepted = np.cumprod(ok, axis=1).sum(axis=1)
    out = []
    for i, j in enumerate(accepted.tolist()):
        r = RequestStepStats("r", "chat", "draft", k, k, j, j + 1)
        out.append(StepStats(i, 1, 0, 0, k + 1, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, [r]))
    return out


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.6, 4), (0.8, 8)])
def test_token_acceptance_recovers_the_iid_rate(a, k):
    steps = _steps(a, k, 40_000)
    est = token_acceptance(steps)
    assert est == pytest.approx(a, abs=0.01)
    # the bound's token count then equals the measured mean accepted length
    emitted = np.mean([s.requests[0].emitted for s in steps])
    assert analytic_bound(est, k, 0.0) == pytest.approx(emitted, rel=0.02)
    # negative control: accepted / drafted is not the rate the formula wants
    rate = sum(s.requests[0].accepted for s in steps) / sum(s.requests[0].drafted for s in steps)
    assert abs(rate - a) > 0.05
    assert analytic_bound(rate, k, 0.0) < 0.95 * emitted


def test_token_acceptance_counts_only_judged_candidates():
    r = [RequestStepStats("r", "c", "ngram", 4, 3, 1, 2),  # judged 2 (accept, reject), third never judged
         RequestStepStats("r", "c", "ngram", 4, 0, 0, 1),  # nothing drafted: nothing judged
         RequestStepStats("r", "c", "ngram", 4, 2, 2, 3)]  # all judged and accepted
    st = StepStats(0, 3, 0, 0, 8, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, r)
    assert token_acceptance([st]) == pytest.approx(3 / 4)
    assert token_acceptance([]) == 0.0
    assert analytic_bound(0.5, 2, 0.1) == pytest.approx((1 + 0.5 + 0.25) / 1.2)


def test_verify_cost_is_the_step_less_its_drafting_over_a_plain_step():
    def st(wall, draft, prefill=0.0):
        return StepStats(step=0, batch_size=1, num_prefill=0, prefill_tokens=0, verify_tokens=5, context_tokens=10,
                         num_waiting=0, prefill_s=prefill, draft_s=draft, verify_s=wall - draft - prefill, other_s=0.0,
                         wall_s=wall)

    # steps of 12 and 14 ms with 2 and 2 ms of drafting: 11 ms a step against a 10 ms plain one
    assert verify_cost([st(0.012, 0.002), st(0.014, 0.002)], 0.010) == pytest.approx(1.1)
    assert verify_cost([st(0.013, 0.002, prefill=0.001)], 0.010) == pytest.approx(1.0)
    assert verify_cost([], 0.010) == 0.0


def test_bench_interleaves_methods_and_checks_exactness(tiny_dir, tiny_draft_dir, monkeypatch):
    """`adaptspec bench` end to end on tiny models: every method runs every prompt, the
    methods take turns chunk by chunk (a slow minute hits them alike), and the greedy
    speculative rows give the plain tokens."""
    from adaptspec.tools import bench

    calls = []
    monkeypatch.setattr(bench, "bench_prompts", lambda: {"a": ["t1 t2 t3", "t4 t5", "t6 t7 t8 t9"], "b": ["t2 t2"]})
    real = bench._HF.generate
    monkeypatch.setattr(bench._HF, "generate", lambda self, ch, n, **kw: (calls.append(("hf", len(ch))),
                                                                            real(self, ch, n, **kw))[1])
    cfg = bench.BenchConfig(target=str(tiny_dir), drafts=[str(tiny_draft_dir)], dtypes=["float32"], batches=[1],
                            ks=[2], classes=["a"], max_new_tokens=6, prompts_per_class=3)
    from adaptspec.engine.engine import Engine

    order = []
    gen = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, ps, params=None, spec=None, **kw: (
        order.append(spec.drafter if spec else None), gen(self, ps, params, spec, **kw))[1])
    rows = bench.run_bench(cfg)
    methods = [(r.method, r.k) for r in rows]
    assert methods[:3] == [("ours-plain", 0), ("ours-ngram", 2), ("ours-draft", 2)]
    assert ("hf-plain", 0) in methods and ("hf-assisted", 0) in methods and ("hf-lookup", 2) in methods
    base = rows[0]
    for r in rows:
        assert r.tokens == base.tokens  # the same 3 prompts, ignore_eos: every method makes the same tokens
    assert all(r.same_tokens for r in rows[1:3])
    assert base.verify_cost is None and all(r.verify_cost is None for r in rows if r.method.startswith("hf"))
    assert all(r.verify_cost > 0 for r in rows[1:3])
    # interleaved: ours ran chunk by chunk, the first method rotating (3 chunks, 3 of our methods)
    ours = order[1:]  # order[0]: the warm-up
    assert len(ours) == 9
    assert ours[:3] == ["none", "ngram", "draft"] and ours[3:6] == ["ngram", "draft", "none"]
    assert calls == [("hf", 1)] * (1 + 3 * 3)  # the warm-up, then 3 chunks x 3 transformers methods


def test_bench_repeats_run_every_chunk_again(tiny_dir, tiny_draft_dir, monkeypatch):
    """--repeats 2: every method runs every prompt twice (rotation continuing across rounds),
    tokens double, and the greedy rows still equal the plain tokens."""
    from adaptspec.tools import bench
    from adaptspec.engine.engine import Engine

    monkeypatch.setattr(bench, "bench_prompts", lambda: {"a": ["t1 t2 t3", "t4 t5"]})
    order = []
    gen = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, ps, params=None, spec=None, **kw: (
        order.append(spec.drafter if spec else None), gen(self, ps, params, spec, **kw))[1])
    cfg = bench.BenchConfig(target=str(tiny_dir), drafts=[str(tiny_draft_dir)], dtypes=["float32"], batches=[1],
                            ks=[2], classes=["a"], max_new_tokens=6, prompts_per_class=2, hf=False)
    once = bench.run_bench(cfg)
    order.clear()
    cfg.repeats = 2
    twice = bench.run_bench(cfg)
    assert len(order) == 1 + 2 * 2 * 3  # warm-up, then 2 rounds x 2 chunks x 3 methods
    assert order[1:4] == ["none", "ngram", "draft"] and order[7:10] == ["draft", "none", "ngram"]
    assert [r.tokens for r in twice] == [2 * r.tokens for r in once]
    assert all(r.same_tokens for r in twice[1:])
    cfg.repeats = 0
    with pytest.raises(ValueError, match="repeats"):
        bench.run_bench(cfg)


def test_the_json_names_the_cpu_kernel_the_rows_ran_on(tmp_path):
    """A bench result from a CPU says which kernel its CPU rows used (width, or why torch)."""
    import json

    from adaptspec.models import cpu_gemm
    from adaptspec.tools import bench

    bench._write_json(str(tmp_path / "b.json"), bench.BenchConfig(target="x"), [])
    meta = json.loads((tmp_path / "b.json").read_text())["meta"]
    assert meta["cpu_kernel"] == cpu_gemm.status() and meta["cpu_kernel"]
