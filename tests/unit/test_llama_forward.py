"""Our compact Llama forward against transformers' own, over the paged KV cache."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaptspec.models.llama import LlamaModel
from adaptspec.models.loader import load_weights
from tests.conftest import SlotAdapter, make_tiny_model


def _ours(folder, matmul, dtype=torch.float32, slots=4, max_len=128):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    m = LlamaModel.from_hf(hf, dtype=dtype, matmul=matmul)
    return hf, SlotAdapter(m, slots, max_len)


def _prefill_then_ragged(hf, m, vocab, tol):
    torch.manual_seed(3)
    ids = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        ref = hf(ids).logits  # [2, 24, vocab]
    lg, _ = m.forward(ids[:, :16], [2, 0], [0, 0], [16, 16])  # non-contiguous slots
    assert (lg.view(2, 16, -1) - ref[:, :16]).abs().max() <= tol
    # a ragged continuation: row 0 adds 8 tokens, row 1 only 5 (3 padding columns)
    lg2, hidden = m.forward(ids[:, 16:24], [2, 0], [16, 16], [8, 5])  # logits of the 13 real tokens
    assert lg2.shape[0] == 13
    assert (lg2[:8] - ref[0, 16:24]).abs().max() <= tol
    assert (lg2[8:] - ref[1, 16:21]).abs().max() <= tol
    assert hidden.shape == (2, 8, m.cfg.hidden_size)
    assert (hidden[1, 5:] == 0).all()  # padding positions carry no features


def test_padding_never_reaches_the_matmuls(tiny_dir):
    """Rows of different lengths run their real tokens only through the projections and the
    MLP (a batch mixing k = 0 and k = 4 costs its tokens, not rows x 5); the results are the
    rows run one at a time."""
    _, m = _ours(tiny_dir, "fast")
    seen = []
    mm = m.model._mm
    m.model._mm = lambda x, w, b=None: (seen.append(x.shape[0]), mm(x, w, b))[1]
    torch.manual_seed(1)
    ids = torch.randint(0, m.cfg.vocab_size, (3, 12))
    m.forward(ids[:, :7], [0, 1, 2], [0, 0, 0], [7, 7, 7])
    seen.clear()
    lg, _ = m.forward(ids[:, 7:12], [0, 1, 2], [7, 7, 7], [1, 5, 2], torch.tensor([0, 5, 6, 7, 8, 9, 10, 11]))
    assert set(seen[:-1]) == {1 + 5 + 2}  # every layer's matmuls: 8 real tokens, not 3 x 5
    for r, (n, rows) in enumerate([(1, [0]), (5, [1, 2, 3, 4, 5]), (2, [6, 7])]):
        _, alone = _ours(tiny_dir, "fast")
        alone.forward(ids[r:r + 1, :7], [0], [0], [7])
        lg1, _ = alone.forward(ids[r:r + 1, 7:7 + n], [0], [7], [n])
        assert (lg[rows] - lg1).abs().max() <= 1e-5


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)])
def test_tiny_logits_match_transformers(tmp_path, model_type, tie):
    folder = make_tiny_model(tmp_path, vocab=40, seed=5, model_type=model_type, tie=tie)
    hf, m = _ours(folder, "reference")
    _prefill_then_ragged(hf, m, 40, 1e-4)
    hf, m = _ours(folder, "fast")
    _prefill_then_ragged(hf, m, 40, 1e-4)


def test_rollback_is_setting_the_length(tiny_dir):
    """Write 4 speculative tokens, keep 1 (length set back), continue: same as never drafting."""
    hf, m = _ours(tiny_dir, "reference")
    ids = torch.tensor([[1, 5, 7, 2, 9, 3]])
    m.forward(ids[:, :3], [1], [0], [3])
    m.forward(torch.tensor([[11, 12, 13, 14]]), [1], [3], [4])  # drafted, then 3 rejected
    # roll back: the slot's length becomes 4, keeping the accepted token 11 at position 3;
    # positions 4..6 still hold 12, 13, 14 but are overwritten and never attended to
    lg, _ = m.forward(ids[:, 4:6], [1], [4], [2])
    ref_ids = torch.tensor([[1, 5, 7, 11, 9, 3]])
    with torch.no_grad():
        ref = hf(ref_ids).logits[0, 4:6]
    assert (lg - ref).abs().max() <= 1e-4


def test_smollm2_logits_match_transformers(smollm_dir):
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    from transformers import AutoConfig

    from adaptspec.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(smollm_dir))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    m = SlotAdapter(LlamaModel(cfg, load_weights(smollm_dir), torch.float32, "cpu", "reference"), 4, 64)
    _prefill_then_ragged(hf, m, cfg.vocab_size, 1e-4)


def test_smollm2_fast_layout_close(smollm_dir):
    """The transposed-weight layout only changes fp32 rounding (about 1e-3 on logits of ~20)."""
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    m = SlotAdapter(LlamaModel.from_hf(hf, matmul="fast"), 2, 64)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    lg, _ = m.forward(ids, [0], [0], [12])
    assert (lg - ref).abs().max() <= 5e-3
    assert torch.equal(lg.argmax(-1), ref.argmax(-1))


def test_bfloat16_runs_and_agrees_roughly(tiny_dir):
    hf, m = _ours(tiny_dir, "fast", dtype=torch.bfloat16)
    ids = torch.randint(0, 16, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    lg, _ = m.forward(ids, [0], [0], [10])
    assert lg.dtype == m.model.compute_dtype
    assert (lg.float() - ref).abs().max() < 0.25


def test_context_past_the_positions_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path, vocab=16, seed=2)
    _, m = _ours(folder, "fast", max_len=600)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        m.forward(torch.zeros(1, 513, dtype=torch.long), [0], [0], [513])


@pytest.mark.parametrize("hidden", [32, 256, 512])  # head_dim 8 (the generic C loops), 64, 128
@pytest.mark.parametrize("dtype,matmul", [(torch.float32, "fast"), (torch.bfloat16, "packed")])
def test_fused_cpu_layer_ops_match_the_torch_ops(tmp_path, monkeypatch, hidden, dtype, matmul):
    """On the CPU the layer's norms, rotary embedding, paged-cache write, attention and SwiGLU
    run in C; the same forward on torch ops (the reference attention backend) gives the same
    logits, hidden states and KV cache to fp32 rounding: a prefill, then ragged steps over
    shuffled blocks with contexts that cross KV blocks and the C code's 8-key runs. (bf16 weights in the widened layout: the pair layout rounds each matmul's
    input to bf16, which turns an fp32 rounding into a bf16 one now and then; its own test is
    in test_cpu_gemm.py.)"""
    from adaptspec.models import cpu_gemm

    FUSED_MAX_TOKENS = 32
    if not cpu_gemm.enabled():
        pytest.skip(f"CPU kernels unavailable: {cpu_gemm.status()}")
    monkeypatch.setattr(cpu_gemm, "BF16_DOT", False)
    folder = make_tiny_model(tmp_path, vocab=64, seed=7, hidden=hidden, model_type="qwen2" if hidden == 256 else "llama")
    _, fused = _ours(folder, matmul, dtype)
    _, plain = _ours(folder, matmul, dtype)
    assert fused.model.fused
    plain.model.fused = False
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (3, FUSED_MAX_TOKENS + 5), generator=g)
    for m in (fused, plain):  # a prefill
        m.forward(prompt, [3, 0, 1], [0, 0, 0], [prompt.shape[1]] * 3)
    lens = [prompt.shape[1]] * 3
    for step, ntok in enumerate(([1, 1, 1], [5, 1, 3], [2, 9, 1], [FUSED_MAX_TOKENS, 4, 1])):
        ids = torch.randint(0, 64, (3, max(ntok)), generator=g)
        (lf, hf_), (lp, hp) = (m.forward(ids, [3, 0, 1], lens, ntok) for m in (fused, plain))
        assert _rel_err(lf, lp) <= 5e-5 and _rel_err(hf_, hp) <= 5e-5, step
        lens = [n + t - (step % 2) for n, t in zip(lens, ntok)]  # odd steps roll a token back
    for kf, kp in zip(fused.model.k_cache + fused.model.v_cache, plain.model.k_cache + plain.model.v_cache):
        assert _rel_err(kf, kp) <= 5e-5
    # the comparison can fail: attending one key short (a wrong cache length) is caught
    ids = torch.randint(0, 64, (3, 2), generator=g)
    lf, _ = fused.forward(ids, [3, 0, 1], lens, [2, 2, 2])
    lp, _ = plain.forward(ids, [3, 0, 1], [lens[0] - 1, *lens[1:]], [2, 2, 2])
    assert _rel_err(lf, lp) > 1e-3


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (fp32 rounding: 1e-6 to 1e-5 here)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
