"""The small-M CPU kernel: packing, products against torch, the model on packed weights."""
from __future__ import annotations

import pytest
import torch

from adaptspec.models import cpu_gemm

needs_kernel = pytest.mark.skipif(not cpu_gemm.enabled(), reason=f"CPU kernel unavailable: {cpu_gemm.status()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip(dtype):
    w = torch.randn(7, 45).to(dtype)  # 45 columns: one full block and one padded block
    pw = cpu_gemm.pack(w, pairs=False)
    assert pw.blocks.shape == (2, 7, 32) and not pw.pairs
    assert torch.equal(pw.unpacked(), w)
    if dtype == torch.bfloat16:  # interleaved halves: stored 2j is column j, 2j + 1 is 16 + j
        assert torch.equal(pw.blocks[0, :, 0], w[:, 0]) and torch.equal(pw.blocks[0, :, 1], w[:, 16])
        assert torch.equal(pw.blocks[1, :, 2], w[:, 33])


def test_pack_round_trip_bf16_pairs():
    """The pair layout: 7 rows -> 4 pairs (the last padded), row 2p and 2p + 1 of a column
    side by side."""
    w = torch.randn(7, 45).bfloat16()
    pw = cpu_gemm.pack(w, pairs=True)
    assert pw.pairs and pw.blocks.shape == (2, 4, 64)
    assert torch.equal(pw.unpacked(), w)
    assert torch.equal(pw.blocks[0, 1, 0:2], w[2:4, 0]) and torch.equal(pw.blocks[1, 0, 2:4], w[0:2, 33])
    assert torch.equal(pw.blocks[0, 3, 2], w[6, 1]) and pw.blocks[0, 3, 3] == 0
    assert not cpu_gemm.pack(w.float(), pairs=True).pairs  # fp32 has one layout
    with pytest.raises(ValueError, match="2-D fp32/bf16"):
        cpu_gemm.pack(torch.zeros(3, 4, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 40, 80, 600])  # 80, 600: fp32 goes to torch
def test_products_match_torch(dtype, rows):
    x, w = _check_product(dtype, rows, seed=rows)
    # leading dimensions are kept
    assert cpu_gemm.matmul(x.view(1, rows, 70), cpu_gemm.pack(w)).shape == (1, rows, 100)


def _check_product(dtype, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(70, 100, generator=g).to(dtype)
    x = torch.randn(rows, 70, generator=g).to(dtype)
    want = x.float() @ w.float()
    got = cpu_gemm.matmul(x, cpu_gemm.pack(w))
    assert got.dtype == dtype and got.shape == (rows, 100)
    tol = 1e-4 if dtype == torch.float32 else 2.0 ** -7 * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= tol
    return x, w


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 17, 130])
def test_bf16_pairs_multiply_bf16_activations(rows):
    """The pair layout (VDPBF16PS) rounds x to bf16 and accumulates in fp32: the product of
    the bf16-rounded x, to fp32 rounding; the widened layout multiplies the fp32 x. An odd
    number of input rows exercises the padded last pair. The two differ by x's rounding (the
    check can fail)."""
    if not cpu_gemm.bf16_pairs():
        pytest.skip("no AVX512_BF16 on this CPU (or ADAPTSPEC_CPU_BF16_DOT=0): no pair layout")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(71, 100, generator=g).bfloat16()
    x = torch.randn(rows, 71, generator=g)
    got = cpu_gemm.matmul(x, cpu_gemm.pack(w, pairs=True))
    widened = cpu_gemm.matmul(x, cpu_gemm.pack(w, pairs=False))
    rounded_x, exact_x = x.bfloat16().float() @ w.float(), x @ w.float()
    scale = exact_x.abs().max().item()
    assert got.dtype == torch.float32 and got.shape == (rows, 100)
    assert (got - rounded_x).abs().max().item() <= 1e-5 * scale
    assert (widened - exact_x).abs().max().item() <= 1e-5 * scale
    assert (got - exact_x).abs().max().item() > 1e-4 * scale
    x[0, 3] = float("nan")  # a NaN stays a NaN in its row and nowhere else
    nan = cpu_gemm.matmul(x, cpu_gemm.pack(w, pairs=True))
    assert nan[0].isnan().all() and not nan[1:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback_on_packed_blocks(monkeypatch, dtype):
    """Without the kernel (no compiler, a failed build) torch multiplies the packed blocks."""
    monkeypatch.setattr(cpu_gemm, "_lib", None)
    for rows in (1, 5, 600):
        _check_product(dtype, rows, seed=4)
    if dtype == torch.bfloat16:  # weights packed in pairs, then no kernel: torch on them unpacked
        w, x = torch.randn(33, 40).bfloat16(), torch.randn(3, 33).bfloat16()
        got = cpu_gemm.matmul(x, cpu_gemm.pack(w, pairs=True)).float()
        assert (got - x.float() @ w.float()).abs().max().item() <= 2.0 ** -7 * (x.float() @ w.float()).abs().max()


def test_negative_control_a_wrong_layout_is_caught():
    """Packing the untransposed weight gives a different product: the checks above can fail."""
    w = torch.randn(32, 32)
    x = torch.randn(3, 32)
    assert (cpu_gemm.matmul(x, cpu_gemm.pack(w.t().contiguous())) - x @ w).abs().max() > 1e-2
    # bf16 blocks in plain column order (not interleaved) are read as the wrong columns
    wb, xb = w.bfloat16(), x.bfloat16()
    plain = cpu_gemm.PackedWeight(wb.view(32, 1, 32).permute(1, 0, 2).contiguous(), 32, 32)
    assert (cpu_gemm.matmul(xb, plain).float() - xb.float() @ wb.float()).abs().max() > 1e-2
    assert (cpu_gemm.matmul(xb, cpu_gemm.pack(wb)).float() - xb.float() @ wb.float()).abs().max() < 0.1


def test_mode_parsing(monkeypatch):
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "0")
    assert cpu_gemm.mode() == "0"
    assert cpu_gemm.default_matmul(torch.bfloat16, torch.device("cpu")) == "fast"
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "nonsense")
    with pytest.raises(ValueError, match="ADAPTSPEC_CPU_KERNEL"):
        cpu_gemm.mode()
    monkeypatch.setenv("ADAPTSPEC_CPU_KERNEL", "bf16")
    assert cpu_gemm.default_matmul(torch.float32, torch.device("cpu")) == "fast"
    assert cpu_gemm.default_matmul(torch.bfloat16, torch.device("cpu")) == "packed"
    monkeypatch.delenv("ADAPTSPEC_CPU_KERNEL")  # the default: the kernel for both dtypes
    assert cpu_gemm.default_matmul(torch.float32, torch.device("cpu")) == "packed"
    assert cpu_gemm.default_matmul(torch.bfloat16, torch.device("cpu")) == "packed"
    assert cpu_gemm.default_matmul(torch.float32, torch.device("cuda")) == "reference"
    monkeypatch.setenv("ADAPTSPEC_CPU_LAYER_LOOP", "Python")
    assert cpu_gemm._layer_loop() == "python"
    monkeypatch.setenv("ADAPTSPEC_CPU_LAYER_LOOP", "fortran")
    with pytest.raises(ValueError, match="ADAPTSPEC_CPU_LAYER_LOOP"):
        cpu_gemm._layer_loop()


@needs_kernel
@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", False), ("llama", True)])
def test_tiny_model_on_packed_weights_matches_transformers(tmp_path, model_type, tie):
    from tests.unit.test_llama_forward import _ours, _prefill_then_ragged
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path, vocab=40, seed=5, model_type=model_type, tie=tie)
    hf, m = _ours(folder, "packed")
    _prefill_then_ragged(hf, m, 40, 1e-4)  # a 32-row prefill and a 16-row ragged step
    assert torch.allclose(m.output_rows(), hf.lm_head.weight, atol=0)


@needs_kernel
def test_bfloat16_packed_computes_in_fp32_on_bf16_weights(tiny_dir, monkeypatch):
    """bf16 on the kernel, widened layout (``ADAPTSPEC_CPU_BF16_DOT=0`` or a CPU without
    AVX512_BF16) is weight-only bf16: the same logits as an fp32 forward over the
    bf16-rounded weights (fp32 rounding apart), with fp32 activations and KV cache."""
    from adaptspec.models.llama import LlamaModel
    from tests.conftest import SlotAdapter
    from tests.unit.test_llama_forward import _ours

    monkeypatch.setattr(cpu_gemm, "BF16_DOT", False)
    hf, fast = _ours(tiny_dir, "fast", dtype=torch.bfloat16)
    _, packed = _ours(tiny_dir, "packed", dtype=torch.bfloat16)
    rounded = {k: v.bfloat16().float() for k, v in hf.state_dict().items()}
    ref = SlotAdapter(LlamaModel(packed.cfg, rounded, torch.float32, "cpu", "reference"), 4, 128)
    assert packed.compute_dtype == torch.float32 and packed.k_cache[0].dtype == torch.float32
    ids = torch.randint(0, 16, (1, 10), generator=torch.Generator().manual_seed(1))
    a, _ = fast.forward(ids, [0], [0], [10])
    b, hb = packed.forward(ids, [0], [0], [10])
    r, hr = ref.forward(ids, [0], [0], [10])
    assert b.dtype == torch.float32 and hb.dtype == torch.float32
    assert (b - r).abs().max() <= 1e-4 and (hb - hr).abs().max() <= 1e-4
    # torch's all-bf16 forward lands near it, but further off (its activations are rounded)
    assert (b - r).abs().max() < (a.float() - r).abs().max() < 0.3
    # the comparison can fail: an fp32 forward over the unrounded weights is further off
    full = SlotAdapter(LlamaModel(packed.cfg, dict(hf.state_dict()), torch.float32, "cpu", "reference"), 4, 128)
    f, _ = full.forward(ids, [0], [0], [10])
    assert (b - f).abs().max() > 1e-4


@needs_kernel
def test_bfloat16_packed_in_pairs_rounds_only_the_matmul_inputs(tiny_dir):
    """bf16 in the pair layout: every matmul takes its input rounded to bf16 (as a bf16 GEMM
    does) and accumulates in fp32; norms, attention, the KV cache and the residual stream stay
    fp32. So the logits are an fp32 forward over the bf16 weights whose matmul inputs are
    rounded to bf16, to a few fp32 roundings (one flips a bf16 rounding now and then); the
    widened layout's forward (fp32 matmul inputs) is much further from it."""
    from adaptspec.models.llama import LlamaModel
    from tests.conftest import SlotAdapter
    from tests.unit.test_llama_forward import _ours

    if not cpu_gemm.bf16_pairs():
        pytest.skip("no AVX512_BF16 on this CPU (or ADAPTSPEC_CPU_BF16_DOT=0): no pair layout")
    hf, packed = _ours(tiny_dir, "packed", dtype=torch.bfloat16)
    assert [w.pairs for w in packed.layers[0] if isinstance(w, cpu_gemm.PackedWeight)] == [True] * 4
    rounded = {k: v.bfloat16().float() for k, v in hf.state_dict().items()}

    class RoundedInputs(LlamaModel):
        def _mm(self, x, w, b=None):
            return super()._mm(x.bfloat16().float(), w, b)

    refs = []
    for cls in (RoundedInputs, LlamaModel):
        refs.append(SlotAdapter(cls(packed.cfg, rounded, torch.float32, "cpu", "reference"), 4, 128))
    ids = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    for m in (packed, *refs):  # a prefill (the kernel at 2 x 8 rows), then a ragged step
        m.forward(ids[:, :8], [0, 1], [0, 0], [8, 8])
    b, _ = packed.forward(ids[:, 8:], [0, 1], [8, 8], [1, 1])
    r, _ = refs[0].forward(ids[:, 8:], [0, 1], [8, 8], [1, 1])
    f, _ = refs[1].forward(ids[:, 8:], [0, 1], [8, 8], [1, 1])
    err, far = (b - r).abs().max().item(), (b - f).abs().max().item()
    assert err <= 1e-4 and far > 1e-2, (err, far)


@needs_kernel
def test_fp32_blas_copy_takes_prefills_and_one_row_only_when_asked(monkeypatch):
    """fp32 packed weights keep torch's copy for prefills (more than MAX_ROWS_F32 rows: the
    BLAS's GEMM is faster there); 1-64 rows go to the kernel, one-row products to the BLAS
    only with ADAPTSPEC_CPU_ONE_ROW=blas (``ONE_ROW_BLAS``); every path gives the product."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(70, 96, generator=g)
    pw = cpu_gemm.pack(w, blas_copy=True)
    assert pw.rows is not None and torch.equal(pw.rows, w)
    assert cpu_gemm.pack(w.bfloat16(), blas_copy=True).rows is None  # bf16: the kernel only
    x = torch.randn(3, 70, generator=g)
    bad = cpu_gemm.PackedWeight(pw.blocks, 70, 96, torch.zeros(70, 96))  # tells which copy was read
    assert not cpu_gemm.ONE_ROW_BLAS  # the default
    for rows in (x[:1], x):
        assert (cpu_gemm.matmul(rows, pw) - rows @ w).abs().max() < 1e-4
        assert torch.count_nonzero(cpu_gemm.matmul(rows, bad)) > 0
    monkeypatch.setattr(cpu_gemm, "ONE_ROW_BLAS", True)
    assert torch.equal(cpu_gemm.matmul(x[:1], pw), x[:1] @ w)
    assert torch.count_nonzero(cpu_gemm.matmul(x[:1], bad)) == 0
    assert torch.count_nonzero(cpu_gemm.matmul(x, bad)) > 0
    many = torch.randn(cpu_gemm.MAX_ROWS_F32 + 1, 70, generator=g)  # a prefill: the BLAS
    assert torch.equal(cpu_gemm.matmul(many, pw), many @ w)
    assert torch.count_nonzero(cpu_gemm.matmul(many, bad)) == 0


@needs_kernel
def test_the_kernel_is_built_for_the_cpus_own_vector_width():
    """GCC lowers generic vectors wider than the hardware's through the stack: 16-float
    vectors on an AVX2 CPU made the kernel several times slower than torch. The library must be built
    for the width the CPU has."""
    from pathlib import Path

    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no x86 CPU flags in /proc/cpuinfo")
    want = 16 if "avx512f" in flags else 8 if "avx" in flags else 4
    assert cpu_gemm.vector_lanes() == want
    assert f"{want}-float vectors" in cpu_gemm.status()


@needs_kernel
@pytest.mark.parametrize("dtype,pairs", [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_a_row_of_the_kernel_does_not_depend_on_the_other_rows(dtype, pairs):
    """Each row's product is the same sequence of operations whatever M is, so decoding one
    token and verifying it among k + 1 candidates give bitwise the same result (the BLAS's
    one-row path does not: the negative control)."""
    if pairs and not cpu_gemm.bf16_pairs():
        pytest.skip("no AVX512_BF16 on this CPU (or ADAPTSPEC_CPU_BF16_DOT=0): no pair layout")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 200, generator=g).to(dtype)
    pw = cpu_gemm.pack(w, blas_copy=True, pairs=pairs)
    x = torch.randn(13, 576, generator=g)
    full = cpu_gemm.matmul(x, pw)
    for m in (1, 2, 5, 8, 9):
        assert torch.equal(cpu_gemm.matmul(x[:m], pw), full[:m])
    if dtype == torch.float32:
        assert not torch.equal(x[:1] @ w, full[:1])


@needs_kernel
def test_fp32_decoding_alone_and_verifying_among_candidates_give_bitwise_the_same_logits(tiny_dir, monkeypatch):
    """With one-row products on the kernel (the default) every decode/verify operation works
    row by row, so the same tokens fed one step at a time or as one 5-token verification
    (next to another request in the batch) give identical logits; with one row on the BLAS
    they differ in rounding (the negative control)."""
    from tests.conftest import SlotAdapter
    from tests.unit.test_llama_forward import _ours

    ids = torch.randint(0, 16, (1, 15), generator=torch.Generator().manual_seed(4))
    other = torch.randint(0, 16, (1, 15), generator=torch.Generator().manual_seed(5))

    def both(m):
        m.forward(ids[:, :10], [0], [0], [10])
        m.forward(ids[:, :10], [1], [0], [10])
        m.forward(other[:, :10], [2], [0], [10])
        one = torch.cat([m.forward(ids[:, 10 + t: 11 + t], [0], [10 + t], [1])[0] for t in range(5)])
        batch = torch.cat([ids[:, 10:15], other[:, 10:15]])
        many, _ = m.forward(batch, [1, 2], [10, 10], [5, 3])
        return one, many[:5]

    _, m = _ours(tiny_dir, "packed")
    one, many = both(m)
    assert torch.equal(one, many)
    monkeypatch.setattr(cpu_gemm, "ONE_ROW_BLAS", True)
    _, m = _ours(tiny_dir, "packed")
    one, many = both(m)
    assert not torch.equal(one, many) and (one - many).abs().max() < 1e-4


@needs_kernel
def test_into_huge_pages_moves_the_weights_without_changing_a_product(monkeypatch):
    """The packed weights move into one 2 MB-aligned buffer (one storage, in order, 64-byte
    aligned each) and every product stays bitwise the same; ADAPTSPEC_CPU_HUGE_PAGES=0 leaves
    them alone."""
    import sys

    g = torch.Generator().manual_seed(6)
    ws = [cpu_gemm.pack(torch.randn(i, o, generator=g).to(dt))
          for i, o, dt in ((70, 100, torch.float32), (33, 45, torch.bfloat16), (576, 200, torch.bfloat16))]
    xs = [torch.randn(5, w.in_features, generator=g) for w in ws]
    before = [cpu_gemm.matmul(x, w) for x, w in zip(xs, ws)]
    old = [w.blocks for w in ws]
    monkeypatch.setenv("ADAPTSPEC_CPU_HUGE_PAGES", "0")
    assert not cpu_gemm.into_huge_pages(ws) and all(w.blocks is b for w, b in zip(ws, old))
    monkeypatch.delenv("ADAPTSPEC_CPU_HUGE_PAGES")
    if not sys.platform.startswith("linux"):
        pytest.skip("transparent huge pages are Linux's")
    assert cpu_gemm.into_huge_pages(ws)
    assert len({w.blocks.untyped_storage().data_ptr() for w in ws}) == 1
    ptrs = [w.blocks.data_ptr() for w in ws]
    assert ptrs[0] % (2 << 20) == 0 and all(p % 64 == 0 for p in ptrs) and ptrs == sorted(ptrs)
    for x, w, b, o in zip(xs, ws, before, old):
        assert torch.equal(w.blocks, o) and w.blocks.data_ptr() != o.data_ptr()
        assert torch.equal(cpu_gemm.matmul(x, w), b)


@needs_kernel
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: the qkv bias
@pytest.mark.parametrize("dtype,pairs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_layers_in_one_c_call_equal_the_python_loop_bitwise(tmp_path, monkeypatch, model_type, dtype, pairs):
    """``CLayers`` (a step's decoder layers in one C call) makes the calls ``_forward_fused``'s
    Python loop makes: bitwise the same logits, hidden states and KV cache, for a prefill, a
    ragged step over non-contiguous slots, one row and more rows than MAX_ROWS_F32 (a whole
    step stays in C there; fp32's one row with ONE_ROW_BLAS stays on the Python loop)."""
    from tests.conftest import make_tiny_model
    from tests.conftest import SlotAdapter
    from tests.unit.test_llama_forward import _ours

    if pairs and not cpu_gemm._pairs_built:
        pytest.skip("the library has no pair kernel (no AVX512_BF16 at build time)")
    monkeypatch.setattr(cpu_gemm, "BF16_DOT", pairs)
    folder = make_tiny_model(tmp_path, vocab=40, seed=5, model_type=model_type)
    _, c = _ours(folder, "packed", dtype, max_len=256)
    _, py = _ours(folder, "packed", dtype, max_len=256)
    assert c.c_layers is not None and c.c_layers.layout == (2 if pairs else int(dtype == torch.bfloat16))
    assert (c.c_layers.bias is not None) == (model_type == "qwen2")
    py.c_layers = None
    calls = []
    run = c.c_layers.run
    monkeypatch.setattr(c.c_layers, "run", lambda *a: (calls.append(a[0].shape[0]), run(*a))[1])
    ids = torch.randint(0, 40, (3, 120), generator=torch.Generator().manual_seed(2))
    steps = [(ids[:, :20], [20, 20, 20], [0, 0, 0]),  # a prefill of 60 rows
             (ids[:, 20:25], [5, 1, 3], [20, 20, 20]),  # a ragged verification step
             (ids[:1, 25:26], [1], [25])]  # one row
    for x, n, lens in steps:
        slots = [3, 0, 1][:x.shape[0]]
        a, ha = c.forward(x, slots, lens, n)
        b, hb = py.forward(x, slots, lens, n)
        assert torch.equal(a, b) and torch.equal(ha, hb)
    assert all(torch.equal(k1, k2) for k1, k2 in zip(c.k_cache + c.v_cache, py.k_cache + py.v_cache))
    assert calls == [60, 9, 1]  # every step above ran in C
    # 75 rows, past MAX_ROWS_F32 too (fp32's single products there would be the BLAS's),
    # bitwise the Python loop on the kernel's products
    x = ids[:, 30:55]
    monkeypatch.setattr(cpu_gemm, "MAX_ROWS_F32", 10**6, raising=True)
    b, hb = py.forward(x, [3, 0, 1], [30, 30, 30], [25, 25, 25])
    monkeypatch.setattr(cpu_gemm, "MAX_ROWS_F32", 64, raising=True)
    a, ha = c.forward(x, [3, 0, 1], [30, 30, 30], [25, 25, 25])
    assert calls[-1] == 75 and torch.equal(a, b) and torch.equal(ha, hb)
    monkeypatch.setattr(cpu_gemm, "ONE_ROW_BLAS", True)
    assert c.c_layers.takes(1) == (dtype != torch.float32) and c.c_layers.takes(2)


@needs_kernel
def test_layers_in_c_only_where_every_layer_fits_the_loop(tiny_dir, monkeypatch):
    """The C loop takes layer 0's sizes and one layout for all layers: a model whose layers
    differ (or ADAPTSPEC_CPU_LAYER_LOOP=python) stays on the Python loop."""
    from tests.conftest import SlotAdapter
    from tests.unit.test_llama_forward import _ours

    _, m = _ours(tiny_dir, "packed")
    assert cpu_gemm.CLayers.applies(m.layers)
    odd = [list(lay) for lay in m.layers]
    odd[1][5] = cpu_gemm.pack(torch.randn(m.cfg.hidden_size, 2 * m.cfg.intermediate_size + 32))
    assert not cpu_gemm.CLayers.applies([tuple(lay) for lay in odd])
    mixed = [list(lay) for lay in m.layers]
    mixed[1][6] = cpu_gemm.pack(torch.randn(m.cfg.intermediate_size, m.cfg.hidden_size).bfloat16())
    assert not cpu_gemm.CLayers.applies([tuple(lay) for lay in mixed])
    monkeypatch.setattr(cpu_gemm, "LAYER_LOOP", "python")
    assert not cpu_gemm.CLayers.applies(m.layers)
