"""CUDA graphs of the target's forward (``adaptspec.models.cuda_graph``), the padded
static-buffer path they replay, the CUDA step timing, and loading without a device-side copy.

On the CPU the padded path runs eagerly (``cuda_graphs=True`` there: no capture), so the
padding, the pad block and the buffers' layout are checked where the suite runs: the padded
path must give the unpadded path's tokens (on the CPU kernels, bitwise its logits), and a
pad block that a request owns must be caught. The CUDA cases (marker ``cuda``, skipped
without a GPU) replay captured graphs against the eager engine token for token.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adaptspec import Engine, SamplingParams, SpecConfig
from adaptspec.models.attention import TritonAttention
from adaptspec.models.cuda_graph import GraphRunner, token_buckets
from adaptspec.models.llama import LlamaModel
from tests.conftest import make_tiny_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA-only: needs a GPU (the padded path is tested on the CPU)")
VOCAB = 64
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
# a mixed batch: n-gram, draft model and plain rows verified in one pass
SPECS = [SpecConfig("ngram", 3), SpecConfig("draft", 4), SpecConfig("none", 0), SpecConfig("draft", 2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # head_dim 16: the smallest the Triton kernel compiles for (tl.dot needs 16)
    return make_tiny_model(tmp_path_factory.mktemp("graph_tiny"), vocab=VOCAB, hidden=64, layers=2, init=0.3,
                           seed=7)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 21, 2, 40)]
    out[1] = (out[1][:5] * 5)[:21]  # repetitive: n-gram lookup finds candidates
    return out


def _engine(folder, device="cpu", **kw) -> Engine:
    return Engine.from_pretrained(str(folder), draft=str(folder), device=device, max_num_seqs=4,
                                  max_model_len=128, **kw)


class _Count:
    """Counts the runner's steps (so a test knows the padded path really ran)."""

    def __init__(self, runner: GraphRunner):
        self.n, self.runner, self._fwd = 0, runner, runner.forward
        runner.forward = self

    def __call__(self, *a):
        self.n += 1
        return self._fwd(*a)


def test_buckets():
    assert token_buckets(512)[:11] == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert token_buckets(512)[-3:] == (448, 480, 512)
    assert token_buckets(5) == (1, 2, 4, 5)  # the maximum is always a bucket
    assert token_buckets(100)[-2:] == (96, 100)
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        token_buckets(0)


def test_padded_path_gives_the_eager_tokens(folder):
    """Greedy with speculation (n-gram, draft model, plain, batched): the padded static path
    emits exactly the unpadded engine's tokens, and it really ran for the decode steps."""
    prompts = _prompts()
    want = [o.token_ids for o in _engine(folder).generate(prompts, GREEDY, SPECS)]
    eng = _engine(folder, cuda_graphs=True)
    assert eng.graphs is not None and not eng.graphs.capture
    count = _Count(eng.graphs)
    outs = eng.generate(prompts, GREEDY, SPECS)
    assert [o.token_ids for o in outs] == want
    assert count.n >= GREEDY.max_new_tokens // 2  # the decode steps went through it
    assert sum(o.stats.accepted for o in outs) > 0  # speculation ran


def test_padded_logits_equal_the_unpadded_ones(folder):
    """One verification step through the runner against the model's own forward on the
    exact batch: the CPU kernels compute each row alone, so the logits are bitwise equal
    (padding rows change nothing)."""
    from adaptspec.models.batch import FlatBatch

    eng = _engine(folder, cuda_graphs=True)
    model, runner = eng.target.model, eng.graphs
    tables = [[3, 1], [0], [2, 4]]
    rows, ctx = [[5, 6, 7], [8], [9, 10]], [17, 4, 20]
    logits_rows = list(range(6))
    for ts, c, t in zip(tables, ctx, rows):  # fill the cached prefixes the rows attend to
        pre = list(range(1, c + 1))
        model.forward(FlatBatch.build([pre], [0], [ts], [], model.block_size, "cpu"))
    kc = [k.clone() for k in model.k_cache]
    got, gh = runner.forward(rows, ctx, tables, logits_rows)
    got, gh = got.clone(), gh.clone()
    assert runner.bucket(6) == 8  # two padding rows
    for k, saved in zip(model.k_cache, kc):  # the caches as before the step, for the eager run
        k.copy_(saved)
    want, wh = model.forward(FlatBatch.build(rows, ctx, tables, logits_rows, model.block_size, "cpu"))
    if model.fused:  # the C kernels: a row's result never depends on the other rows
        assert torch.equal(got, want) and torch.equal(gh, wh)
    else:  # no C compiler here: a BLAS may round a product over more rows differently
        assert torch.allclose(got, want, atol=1e-5) and torch.allclose(gh, wh, atol=1e-5)


def test_a_pad_block_that_a_request_owns_is_caught(folder):
    """Negative control: padding rows writing into block 0, which the first request owns,
    corrupt its keys, and the comparison with the eager tokens catches it."""
    prompts = _prompts()
    want = [o.token_ids for o in _engine(folder).generate(prompts, GREEDY, SPECS)]
    eng = _engine(folder, cuda_graphs=True)
    eng.graphs.pad_block = 0
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, SPECS)]
    assert got != want


def test_padding_rows_only_touch_the_pad_block(folder):
    """After padded steps, every block but the pad block holds what the eager engine wrote."""
    prompts = _prompts()[:2]
    a, b = _engine(folder), _engine(folder, cuda_graphs=True)
    a.generate(prompts, GREEDY, SPECS[:2])
    b.generate(prompts, GREEDY, SPECS[:2])
    pad = b.graphs.pad_block
    assert pad == b.num_blocks and b.target.model.num_blocks == b.num_blocks + 1
    same = torch.equal if b.target.model.fused else lambda x, y: torch.allclose(x, y, atol=1e-5)  # (BLAS rounding)
    for ka, kb in zip(a.target.model.k_cache, b.target.model.k_cache):
        assert same(ka, kb[:pad])
    assert b.target.model.k_cache[0][pad].abs().sum() > 0  # the padding rows did write there


def test_padded_path_with_a_feature_head(tmp_path_factory):
    """A target tapped for an EAGLE-3 head (its hidden states at several layers): the head
    drafts the same candidates and the engine emits the same tokens on the padded path."""
    from tests.unit.test_head_inference import V, _eagle3_head

    tdir = make_tiny_model(tmp_path_factory.mktemp("graph_e3"), vocab=V, seed=3, layers=3)
    _eagle3_head(tdir, tdir / "head")
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 40, 19)]
    spec = SpecConfig("draft", 3)

    def run(**kw):
        eng = Engine.from_pretrained(str(tdir), draft=str(tdir / "head"), max_num_seqs=4, **kw)
        count = _Count(eng.graphs) if eng.graphs else None
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), spec)
        return eng, count, [(o.token_ids, o.stats.drafted, o.stats.accepted) for o in outs]

    _, _, want = run()
    eng, count, got = run(cuda_graphs=True)
    assert eng.feature_layers == (1, 2, 3) and eng.graphs.feature_layers == eng._taps
    assert got == want and sum(d for _, d, _ in got) > 0 and count.n > 0


class _StaticTorchAttention(TritonAttention):
    """A graph-safe attention in plain torch for the capture emulation below: the Triton
    backend's device-only row -> sequence map, and each row attends over its sequence's
    whole block table (a shape fixed by the table width), masked by position."""

    name = "static-torch"

    def attend(self, qkv, k_cache, v_cache, batch, meta):
        seq_of = meta
        N, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.cos[batch.positions][:, None], self.sin[batch.positions][:, None]
        q = self.rotate_and_write(qkv, k_cache, v_cache, batch.slot_mapping, cos, sin)  # [N, H, D]
        bt = batch.block_tables.long()[seq_of.long()]  # [N, W]
        W, bs = bt.shape[1], k_cache.shape[2]

        def gather(cache):  # [N, Hkv, W * bs, D]
            return cache[bt].permute(0, 2, 1, 3, 4).reshape(N, Hkv, W * bs, D)

        mask = torch.arange(W * bs, device=q.device)[None, :] <= batch.positions[:, None]  # [N, W * bs]
        a = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], gather(k_cache), gather(v_cache), attn_mask=mask[:, None, None], enable_gqa=Hkv != H)
        return a.reshape(N, H * D)


class _Capture(torch.utils._python_dispatch.TorchDispatchMode):
    """What a CUDA graph keeps of a capture, emulated on the CPU: every aten op with its very
    tensors. ``replay`` runs them again on the same memory, writing each op's new result into
    the tensor it first returned (as a graph's kernels rewrite the same addresses)."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def replay(self):
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for o, n in zip(*((out, new) if isinstance(out, (tuple, list)) else ((out,), (new,)))):
                    if isinstance(o, torch.Tensor) and o is not n and o.data_ptr() != n.data_ptr():
                        o.copy_(n)


class _FakeCuda:
    """The torch.cuda calls GraphRunner._capture makes, on the CPU."""

    def __init__(self):
        self.free = iter([10_000, 9_000])

    class CUDAGraph:
        def __init__(self):
            self.capture = _Capture()

        def pool(self):
            return id(self)

        def replay(self):
            self.capture.replay()

    @staticmethod
    def graph(g, pool=None):
        return g.capture

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    def install(self, monkeypatch):
        import contextlib

        for name, fn in (("synchronize", lambda *a: None), ("empty_cache", lambda: None),
                         ("mem_get_info", lambda *a: (next(self.free), 20_000)), ("Stream", self.Stream),
                         ("stream", lambda s: contextlib.nullcontext()), ("current_stream", lambda *a: self.Stream()),
                         ("CUDAGraph", self.CUDAGraph), ("graph", self.graph)):
            monkeypatch.setattr(torch.cuda, name, fn)


def test_emulated_capture_and_replay_give_the_eager_tokens(folder, monkeypatch):
    """GraphRunner._capture itself, on the CPU: torch.cuda stood in for, each capture
    recorded op by op and replayed on the same tensors (what a CUDA graph does), the model on
    torch ops only with a graph-safe attention. Greedy with speculation through the engine
    gives the eager engine's tokens; nothing captured reads device data on the host."""
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "0")  # torch ops only: the recorder sees every one
    prompts = _prompts()
    want = [o.token_ids for o in _engine(folder).generate(prompts, GREEDY, SPECS)]
    eng = _engine(folder, cuda_graphs=True)
    m, c = eng.target.model, eng.target.model.cfg
    assert not m.fused
    m._cuda_attn = _StaticTorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, m.cos, m.sin)
    runner = eng.graphs
    _FakeCuda().install(monkeypatch)
    runner.capture = True
    runner._capture()
    monkeypatch.undo()
    assert sorted(runner.graphs) == list(runner.buckets) and runner.graph_bytes == 1000
    for g in runner.graphs.values():
        names = {f._opname for f, *_ in g.capture.ops}
        assert not names & set(_Capture.SYNCS), names
        assert {"embedding", "searchsorted", "index_put_", "index_select"} <= names  # the whole forward
    count = _Count(runner)
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, SPECS)]
    assert got == want and count.n >= GREEDY.max_new_tokens // 2


def test_graph_safe_row_to_sequence_map():
    """The Triton backend's row -> sequence map comes from cu_seqlens on the device (no host
    list): right for empty sequences and a trailing padding sequence."""
    cu = torch.tensor([0, 3, 3, 4, 8, 8, 8], dtype=torch.int32)  # seq 1 and 4, 5 empty; 4..7 padding (seq 3)
    pos = torch.zeros(8, dtype=torch.long)
    from adaptspec.models.batch import FlatBatch

    batch = FlatBatch(torch.zeros(8, dtype=torch.long), pos, cu, torch.zeros(6, dtype=torch.int32),
                      torch.zeros(6, 1, dtype=torch.int32), pos, pos, [3, 0, 1, 4, 0, 0], [0] * 6, 1, 16)
    attn = TritonAttention(4, 2, 16, torch.ones(4, 16), torch.zeros(4, 16))
    seq_of = attn.prepare(batch)
    assert seq_of.dtype == torch.int32
    assert seq_of.tolist() == [0, 0, 0, 2, 3, 3, 3, 3]


def test_padded_triton_path_equals_unpadded_under_the_interpreter(folder):
    """The exact CUDA path but the capture: the Triton attention on the padded static batch
    (under the Triton interpreter on the CPU) gives the unpadded batch's logits."""
    if CUDA:
        pytest.skip("with a GPU the CUDA cases below run the compiled kernels, captured")
    from adaptspec_kernels.testing import load_kernels_or_skip

    load_kernels_or_skip()  # the interpreter, for the rest of this process (as the kernel tests do)
    from adaptspec.models.batch import FlatBatch
    from adaptspec.models.loader import load_model

    m = load_model(str(folder), matmul="reference", quiet=True).model
    c = m.cfg
    m._cuda_attn = TritonAttention(c.num_heads, c.num_kv_heads, c.head_dim, m.cos, m.sin)
    assert m.attn is m._cuda_attn
    m.allocate_kv(9, 16)
    runner = GraphRunner(m, max_tokens=16, max_seqs=4, max_blocks_per_seq=4, pad_block=8, capture=False)
    tables, ctx, rows = [[3, 1], [0], [2, 4]], [0, 0, 0], [[5, 6, 7, 1, 2], [8], [9, 10, 11]]
    kc = [k.clone() for k in m.k_cache]
    got = runner.forward(rows, ctx, tables, list(range(9)))[0].clone()
    for k, saved in zip(m.k_cache, kc):
        k.copy_(saved)
    want = m.forward(FlatBatch.build(rows, ctx, tables, list(range(9)), 16, "cpu"))[0]
    assert runner.bucket(9) == 16
    assert (got - want).abs().max() <= 1e-5


def test_runner_refuses_what_it_cannot_run(folder):
    eng = _engine(folder, cuda_graphs=True)
    r = eng.graphs
    assert not r.fits(r.max_tokens + 1, 1, 1) and not r.fits(1, r.max_seqs + 1, 1) and not r.fits(1, 1, r.width + 1)
    with pytest.raises(ValueError, match="buckets"):
        r.forward([[1]] * (r.max_seqs + 1), [0] * (r.max_seqs + 1), [[0]] * (r.max_seqs + 1),
                  list(range(r.max_seqs + 1)))
    with pytest.raises(ValueError, match="capturing needs a CUDA device"):
        GraphRunner(eng.target.model, max_tokens=8, max_seqs=1, max_blocks_per_seq=1, pad_block=0, capture=True)
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        _engine(folder, cuda_graph_max_tokens=0)


def test_cpu_default_has_no_graph_path(folder):
    """Off on the CPU by default: no runner, no pad block, host-clock timings published at once."""
    eng = _engine(folder)
    assert eng.graphs is None and eng.target.model.num_blocks == eng.num_blocks
    seen = []
    eng.step_listeners.append(seen.append)
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [s.step for s in seen] == list(range(len(seen))) and eng.last_step is seen[-1]


class _FakeLap:
    """A CUDA event pair stand-in: its step's forward 'ran' 1 ms, and the events complete
    when the next step starts (as on a GPU when a step had no transfer)."""

    def __init__(self, timer):
        self.timer, self.step, self.waited = timer, timer.started, False

    def ready(self) -> bool:
        return self.timer.started > self.step

    def seconds(self) -> float:
        self.waited = not self.ready()
        return 1e-3


class _FakeTimer:
    def __init__(self):
        self.started, self.laps = 0, []

    def start(self):
        self.started += 1

    def stop(self):
        pass

    def lap(self):
        self.laps.append(_FakeLap(self))
        return self.laps[-1]


def test_event_timings_are_published_in_order_once_complete(folder):
    """The CUDA publishing logic on the CPU, with a stand-in timer whose events complete a step
    later: each step's stats reach the listeners after the next step, in order, with the
    events' time as the forward's; when the engine goes idle the last step is waited for."""
    eng = _engine(folder)
    eng._timer = _FakeTimer()
    seen = []
    eng.step_listeners.append(seen.append)
    eng.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng.step()
    assert seen == [] and eng.last_step is None  # its events have not run yet
    eng.step()
    assert [s.step for s in seen] == [0] and eng.last_step is seen[-1]
    while eng.has_unfinished():
        eng.step()
    assert [s.step for s in seen] == list(range(eng.step_count))  # idle: nothing held back
    assert [lap.waited for lap in eng._timer.laps] == [False] * (eng.step_count - 1) + [True]
    assert all(abs(s.prefill_s + s.verify_s - 1e-3) < 1e-12 for s in seen)


def test_loading_moves_only_final_tensors_in_the_model_dtype(folder, monkeypatch):
    """An fp32 checkpoint loaded as bf16: every tensor that reaches the device is bf16 and
    final (moved once; together exactly the model's weights and rotary tables), so the
    device never holds fp32 weights, concatenation sources or copies."""
    from adaptspec.models.loader import load_model

    moved = []
    orig = LlamaModel._place

    def spy(self, t):
        out = orig(self, t)
        moved.append(out)
        return out

    monkeypatch.setattr(LlamaModel, "_place", spy)
    m = load_model(str(folder), dtype="bf16", matmul="reference", quiet=True).model
    assert moved and all(t.dtype == torch.bfloat16 for t in moved)
    assert len({t.data_ptr() for t in moved}) == len(moved)  # nothing moved twice
    held = [m.embed, m.norm, m.cos, m.sin, *(x for lay in m.layers for x in lay if x is not None)]
    if not m.cfg.tie_word_embeddings:
        held.append(m.lm_head)
    assert sorted(t.data_ptr() for t in held) == sorted(t.data_ptr() for t in moved)


# ---- CUDA ---------------------------------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_token_for_token(folder, dtype):
    """Replayed graphs give exactly what the same padded path gives run eagerly (the same
    kernels on the same shapes), in fp32 and bf16; in fp32 also the unpadded eager engine's
    tokens (in bf16 a product over more rows may round differently and flip a near tie)."""
    prompts = _prompts()
    eng = _engine(folder, "cuda", dtype=dtype)  # None: on for CUDA
    assert eng.graphs is not None and eng.graphs.capture and eng.graphs.graph_bytes > 0
    count = _Count(eng.graphs)
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, SPECS)]
    assert count.n >= GREEDY.max_new_tokens // 2  # the decode steps replayed graphs
    padded = _engine(folder, "cuda", dtype=dtype)
    padded.graphs.capture = False  # the captured buffers and buckets, run eagerly
    assert [o.token_ids for o in padded.generate(prompts, GREEDY, SPECS)] == got
    eager = _engine(folder, "cuda", dtype=dtype, cuda_graphs=False)
    assert eager.graphs is None
    want = [o.token_ids for o in eager.generate(prompts, GREEDY, SPECS)]
    if dtype == "float32":
        assert got == want
    else:  # the same length, and mostly the same tokens
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        assert same >= 0.25 * sum(map(len, want)), (got, want)


@pytest.mark.cuda
@needs_cuda
def test_graph_replay_with_sampling_matches_eager(folder):
    """Seeded sampled requests (fp32) draw the same tokens with and without graphs."""
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    prompts = _prompts()
    want = [o.token_ids for o in _engine(folder, "cuda", cuda_graphs=False).generate(prompts, params, SPECS)]
    assert [o.token_ids for o in _engine(folder, "cuda").generate(prompts, params, SPECS)] == want


@pytest.mark.cuda
@needs_cuda
def test_cuda_step_timings_come_from_events_in_order(folder):
    eng = _engine(folder, "cuda")
    seen = []
    eng.step_listeners.append(seen.append)
    outs = eng.generate(_prompts(), GREEDY, SPECS)
    assert outs and not eng._unpublished  # idle: every step published
    assert [s.step for s in seen] == list(range(eng.step_count))
    assert all(s.verify_s + s.prefill_s > 0 for s in seen)


@pytest.mark.cuda
@needs_cuda
def test_kv_fraction_is_sized_after_the_graphs(folder):
    eng = _engine(folder, "cuda", kv_cache_memory=0.001)
    free, _ = torch.cuda.mem_get_info()
    per_block = eng.target.model.kv_bytes_per_block(16) * 2  # target and draft
    assert eng.num_blocks > 0 and eng.graphs.graph_bytes > 0
    assert eng.num_blocks * per_block <= 0.001 * (free + eng.num_blocks * per_block + eng.graphs.graph_bytes) * 1.01
    assert eng.generate([[1, 2, 3]], GREEDY)[0].token_ids


@pytest.mark.cuda
@needs_cuda
def test_bf16_loading_peaks_near_the_weights(tmp_path):
    """An fp32 checkpoint loaded as bf16 onto the GPU peaks at <= 1.2x the bf16 weights."""
    from adaptspec.models.loader import load_model

    folder = make_tiny_model(tmp_path / "m", vocab=2048, hidden=256, layers=4, init=0.02, seed=1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    m = load_model(str(folder), dtype="bf16", device="cuda", quiet=True).model
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = torch.cuda.memory_allocated() - base
    weights = sum(t.numel() * t.element_size() for t in
                  [m.embed, m.norm, m.cos, m.sin, m.lm_head, *(x for lay in m.layers for x in lay if x is not None)])
    assert held <= 1.05 * weights
    assert peak <= 1.2 * weights, (peak, weights)
