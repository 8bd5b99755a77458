"""CUDA graphs of the drafting passes (issue #23): a draft model's forward and a draft head's
layers replay one graph per token-count bucket, like the target's (``Engine.draft_graphs``,
``models.cuda_graph.GraphRunner``).

Greedy output is exact whatever the draft proposes, so equal tokens alone would not show that
the draft's graphs compute the right thing: every test also compares the candidates the
draft proposed at every step with the eager draft's. On the CPU ``cuda_graphs=True`` runs the
padded static-buffer path without capture; the capture itself is emulated with
test_cuda_graph's recorder (each capture op by op, replayed on the same tensors). Negative
controls: a pad block that a request owns, inputs that never reach the static buffer, and a
host read inside a capture. The CUDA cases (marker ``cuda``, in ``make gpu-check``'s subset)
replay real graphs.
"""
from __future__ import annotations

import pytest
import torch

from adaptspec import Engine, SamplingParams, SpecConfig
from tests.conftest import make_tiny_model
from tests.unit.test_cuda_graph import _Capture, _FakeCuda, _StaticTorchAttention
from tests.unit.test_head_inference import V as HEAD_VOCAB, _eagle3_head

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA-only: needs a GPU (the padded path is tested on the CPU)")
VOCAB = 64
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
# three drafting requests: their passes have 3 rows, padded to the 4-row bucket
SPECS = [SpecConfig("draft", 4), SpecConfig("ngram", 3), SpecConfig("draft", 3), SpecConfig("draft", 2)]
HEAD_SPECS = [SpecConfig("draft", 3), SpecConfig("draft", 5), SpecConfig("none", 0), SpecConfig("draft", 2)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # head_dim 16: the smallest the Triton kernel compiles for (the CUDA cases capture it)
    return make_tiny_model(tmp_path_factory.mktemp("dg_target"), vocab=VOCAB, hidden=64, layers=2, init=0.3, seed=7)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """The target as its own draft (every candidate accepted: two unseen tokens a step) and
    another random model (most rejected: the draft's KV rolls back every step)."""
    return {"self": target, "other": make_tiny_model(tmp_path_factory.mktemp("dg_other"), vocab=VOCAB, hidden=64,
                                                     layers=2, init=0.3, seed=8)}


@pytest.fixture(scope="module")
def head_target(tmp_path_factory):
    tdir = make_tiny_model(tmp_path_factory.mktemp("dg_e3"), vocab=HEAD_VOCAB, hidden=64, layers=3, seed=3)
    _eagle3_head(tdir, tdir / "head")
    return tdir


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 21, 2, 40)]
    out[1] = (out[1][:5] * 5)[:21]  # repetitive: n-gram lookup finds candidates
    return out


def _engine(target_dir, draft, device="cpu", **kw) -> Engine:
    return Engine.from_pretrained(str(target_dir), draft=None if draft is None else str(draft), device=device,
                                  max_num_seqs=4, max_model_len=128, **kw)


def _run(eng: Engine, prompts, specs, params=GREEDY):
    """(each request's tokens, each step's candidates per request) of a generate."""
    seen, propose = [], eng._propose

    def spy(rows):
        out = propose(rows)
        seen.append([(r.seq.request_id, list(d.token_ids)) for r, d in zip(rows, out)])
        return out

    eng._propose = spy
    outs = eng.generate(prompts, params, specs)
    return [o.token_ids for o in outs], seen


class _Passes:
    """Counts a runner's passes: feature passes (no logits: a head's observe) and drafting ones."""

    def __init__(self, runner):
        self.observe, self.draft, self._fwd = 0, 0, runner.forward
        runner.forward = self

    def __call__(self, rows, ctx, tables, logits_indices, inputs=None):
        if logits_indices:
            self.draft += 1
        else:
            self.observe += 1
        return self._fwd(rows, ctx, tables, logits_indices, inputs)


def _same(a: torch.Tensor, b: torch.Tensor, fused: bool) -> bool:
    # the C kernels compute each row alone (bitwise); a BLAS may round over more rows differently
    return torch.equal(a, b) if fused else torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("which", ["self", "other"])
def test_draft_model_graphs_draft_what_the_eager_draft_does(target, drafts, which):
    """The padded path of the draft model's passes: at every step the same candidates as the
    eager draft, the eager engine's tokens and plain decoding's; the passes really went
    through the draft's runner, and its padding rows wrote the pad block only."""
    prompts, draft = _prompts(VOCAB), drafts[which]
    eager = _engine(target, draft)
    want, want_drafts = _run(eager, prompts, SPECS)
    plain = [o.token_ids for o in _engine(target, None).generate(prompts, GREEDY, SpecConfig("none", 0))]
    eng = _engine(target, draft, cuda_graphs=True)
    runner = eng.draft_graphs
    assert runner is not None and not runner.capture and eng.proposers["draft"].graphs is runner
    assert runner.model is eng.draft.model and runner.pad_block == eng.num_blocks == eng.graphs.pad_block
    assert eng.draft.model.num_blocks == eng.num_blocks + 1
    passes = _Passes(runner)
    got, got_drafts = _run(eng, prompts, SPECS)
    assert got_drafts == want_drafts
    assert got == want == plain
    assert passes.draft >= GREEDY.max_new_tokens // 2 and passes.observe == 0
    assert sum(len(t) for step in got_drafts for _, t in step) > 0
    pad, fused = runner.pad_block, eng.draft.model.fused
    for ka, kb in zip(eager.draft.model.k_cache, eng.draft.model.k_cache):
        assert _same(ka, kb[:pad], fused)
    assert eng.draft.model.k_cache[0][pad].abs().sum() > 0  # the padding rows did write there


def test_head_graphs_draft_what_the_eager_head_does(head_target):
    """An EAGLE-3 head on the padded path: its feature passes (after every step) and its
    drafting passes go through one runner (one input width), and it drafts the eager head's
    candidates at every step; the tokens are the eager engine's and plain decoding's."""
    prompts = _prompts(HEAD_VOCAB)
    head = head_target / "head"
    want, want_drafts = _run(_engine(head_target, head), prompts, HEAD_SPECS)
    plain = [o.token_ids for o in _engine(head_target, None).generate(prompts, GREEDY, SpecConfig("none", 0))]
    eng = _engine(head_target, head, cuda_graphs=True)
    runner = eng.draft_graphs
    assert runner is not None and runner.model is eng.draft.model.decoder and eng.proposers["draft"].graphs is runner
    assert runner._x.shape == (runner.max_tokens, eng.draft.model.cfg.hidden_size)
    passes = _Passes(runner)
    got, got_drafts = _run(eng, prompts, HEAD_SPECS)
    assert got_drafts == want_drafts
    assert got == want == plain
    assert passes.observe > 0 and passes.draft > 0  # both kinds of pass replayed (here: ran padded)
    assert sum(len(t) for step in got_drafts for _, t in step) > 0


def test_a_pad_block_that_a_request_owns_is_caught_in_the_drafts(target, drafts):
    """Negative control: the draft's padding rows writing into block 0, which the first
    request owns, corrupt the draft's keys there; its candidates change (the tokens cannot:
    the verifier keeps them exact), and the comparison with the eager drafts catches it."""
    prompts = _prompts(VOCAB)
    want, want_drafts = _run(_engine(target, drafts["self"]), prompts, SPECS)
    eng = _engine(target, drafts["self"], cuda_graphs=True)
    eng.draft_graphs.pad_block = 0
    got, got_drafts = _run(eng, prompts, SPECS)
    assert got == want  # exact whatever the draft proposes
    assert got_drafts != want_drafts


def test_inputs_that_never_reach_the_static_buffer_are_caught(head_target):
    """Negative control: a head runner whose static input buffer is never written (stale
    zeros) drafts other candidates than the eager head."""
    prompts = _prompts(HEAD_VOCAB)
    head = head_target / "head"
    _, want_drafts = _run(_engine(head_target, head), prompts, HEAD_SPECS)
    eng = _engine(head_target, head, cuda_graphs=True)
    eng.draft_graphs._put_inputs = lambda inputs: None
    _, got_drafts = _run(eng, prompts, HEAD_SPECS)
    assert got_drafts != want_drafts


def _emulate_capture(runner, monkeypatch) -> None:
    """GraphRunner._capture on the CPU (test_cuda_graph's stand-in for torch.cuda), the
    runner's model on a graph-safe torch attention."""
    m, c = runner.model, runner.model.cfg
    assert not m.fused  # torch ops only: the recorder sees every one
    m._cuda_attn = _StaticTorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, m.cos, m.sin)
    with monkeypatch.context() as mp:
        _FakeCuda().install(mp)
        runner.capture = True
        runner._capture()
    assert sorted(runner.graphs) == list(runner.buckets) and runner.graph_bytes == 1000


@pytest.mark.parametrize("kind", ["model", "head"])
def test_emulated_draft_capture_and_replay_draft_the_eager_candidates(target, drafts, head_target, kind,
                                                                      monkeypatch):
    """The draft's graphs captured (emulated) and replayed through the engine: nothing
    captured reads device data on the host, and at every step the draft proposes the eager
    draft's candidates."""
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "0")
    if kind == "model":
        tdir, draft, prompts, specs = target, drafts["self"], _prompts(VOCAB), SPECS
    else:
        tdir, draft, prompts, specs = head_target, head_target / "head", _prompts(HEAD_VOCAB), HEAD_SPECS
    want, want_drafts = _run(_engine(tdir, draft), prompts, specs)
    eng = _engine(tdir, draft, cuda_graphs=True)
    runner = eng.draft_graphs
    _emulate_capture(runner, monkeypatch)
    for g in runner.graphs.values():
        names = {f._opname for f, *_ in g.capture.ops}
        assert not names & set(_Capture.SYNCS), names
        assert {"embedding", "searchsorted", "index_put_", "index_select"} <= names  # the whole pass
    passes = _Passes(runner)
    got, got_drafts = _run(eng, prompts, specs)
    assert got == want and got_drafts == want_drafts
    assert passes.draft > 0 and (kind == "model" or passes.observe > 0)


def test_the_capture_emulation_catches_a_host_read(target, drafts, monkeypatch):
    """Negative control of the check above: a pass that reads a device value on the host
    while captured shows up among the recorded ops."""
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "0")
    eng = _engine(target, drafts["self"], cuda_graphs=True)
    runner, fn = eng.draft_graphs, eng.draft_graphs.step_fn

    def reads_back(batch, inputs):
        int(batch.positions.max())  # a sync on a GPU, and wrong in a graph: frozen at capture
        return fn(batch, inputs)

    runner.step_fn = reads_back
    _emulate_capture(runner, monkeypatch)
    names = {f._opname for f, *_ in runner.graphs[runner.max_tokens].capture.ops}
    assert names & set(_Capture.SYNCS)


def test_runner_inputs_are_checked(target, head_target):
    eng = _engine(target, target, cuda_graphs=True)
    with pytest.raises(ValueError, match="inputs are needed exactly when"):
        eng.draft_graphs.forward([[1]], [0], [[0]], [0], torch.zeros(1, 64))
    head = _engine(head_target, head_target / "head", cuda_graphs=True).draft_graphs
    with pytest.raises(ValueError, match="inputs are needed exactly when"):
        head.forward([[1]], [0], [[0]], [0])
    with pytest.raises(ValueError, match="width"):
        head.forward([[1]], [0], [[0]], [0], torch.zeros(1, 3))


def test_no_draft_graphs_without_the_switch(target, head_target):
    """Off on the CPU by default (no runner, no pad block), and no draft runner without a draft."""
    eng = _engine(target, target)
    assert eng.draft_graphs is None and eng.proposers["draft"].graphs is None
    assert eng.draft.model.num_blocks == eng.num_blocks
    assert _engine(head_target, head_target / "head").proposers["draft"].graphs is None
    assert _engine(target, None, cuda_graphs=True).draft_graphs is None


# ---- CUDA ---------------------------------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", ["model", "head"])
def test_draft_graph_replay_equals_the_eager_draft(target, drafts, head_target, kind):
    """Replayed draft graphs propose exactly what the same padded path proposes run eagerly
    (the same kernels on the same shapes), and the eager engine's tokens (fp32); against the
    unpadded eager draft the candidates agree but for near ties (a product over more rows may
    round differently)."""
    if kind == "model":
        tdir, draft, prompts, specs = target, drafts["self"], _prompts(VOCAB), SPECS
    else:
        tdir, draft, prompts, specs = head_target, head_target / "head", _prompts(HEAD_VOCAB), HEAD_SPECS
    small = dict(cuda_graph_max_tokens=32)  # every step here fits; fewer graphs to capture
    eng = _engine(tdir, draft, "cuda", **small)  # None: on for CUDA
    runner = eng.draft_graphs
    assert runner is not None and runner.capture and runner.graph_bytes > 0 and eng.graphs.capture
    passes = _Passes(runner)
    got, got_drafts = _run(eng, prompts, specs)
    assert passes.draft > 0 and (kind == "model" or passes.observe > 0)
    padded = _engine(tdir, draft, "cuda", **small)
    padded.draft_graphs.capture = False  # the captured buffers and buckets, run eagerly
    assert _run(padded, prompts, specs) == (got, got_drafts)
    eager = _engine(tdir, draft, "cuda", cuda_graphs=False)
    assert eager.graphs is None and eager.draft_graphs is None
    want, want_drafts = _run(eager, prompts, specs)
    assert got == want
    pairs = [(a, b) for sa, sb in zip(got_drafts, want_drafts) for a, b in zip(sa, sb)]
    assert len(got_drafts) == len(want_drafts) and sum(a == b for a, b in pairs) >= 0.9 * len(pairs)


@pytest.mark.cuda
@needs_cuda
def test_kv_fraction_is_sized_after_the_draft_graphs_too(target, drafts):
    eng = _engine(target, drafts["other"], "cuda", kv_cache_memory=0.001, cuda_graph_max_tokens=32)
    assert eng.num_blocks > 0 and eng.graphs.graph_bytes > 0 and eng.draft_graphs.graph_bytes > 0
    assert eng.generate(_prompts(VOCAB)[:2], GREEDY, SpecConfig("draft", 3))[0].token_ids
