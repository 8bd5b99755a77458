"""The engine on CUDA against transformers, and the Triton verifier inside the engine.

Part of the CUDA test subset that ``make gpu-check`` runs (``adaptspec.tools.gpu_check``).
The CUDA cases skip on a machine without CUDA, with the reason; the CPU cases run the same
comparisons everywhere, so the comparison itself is tested where the suite runs (and its
negative control shows it can fail).

Greedy equality is checked two ways: fp32 output equal to transformers' greedy loop token for
token; and teacher-forced, each emitted token transformers' argmax given the tokens before
it, except where transformers scores it within ``tol`` of its best (a near tie that rounding
may decide either way). Teacher forcing keeps one near tie from turning the rest of the
sequence into a different, equally valid, continuation. For bf16 the reference is
transformers in fp32 on the same bf16-rounded weights, so only activation rounding is left:
measured on the CPU, a fully bf16 transformers run moves this model's logits by 0.05 on
average and up to 0.8, hence ``tol`` 1.0 there (a wrong token is typically several units
below the best: the control below).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaptspec import Engine, SamplingParams, SpecConfig
from tests.conftest import make_tiny_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on a GPU by `make gpu-check`)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
VOCAB, NEW = 128, 24
# a mixed batch: draft model, n-gram and plain rows verified in one flattened pass
SPECS = [SpecConfig("draft", 4), SpecConfig("ngram", 3), SpecConfig("none", 0), SpecConfig("draft", 2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # init 0.3: peaked logits, so exact ties are rare and near ties are few
    return make_tiny_model(tmp_path_factory.mktemp("cuda_tiny"), vocab=VOCAB, hidden=64, layers=3, init=0.3, seed=4)


@pytest.fixture(scope="module")
def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_bf16_weights(folder):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return hf


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 19, 3, 33)]
    out[1] = (out[1][:6] * 4)[:19]  # repetitive: n-gram lookup finds candidates
    return out


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = hf(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


@torch.no_grad()
def far_from_argmax(hf, prompt: list[int], output: list[int], tol: float) -> list[tuple[int, float]]:
    """(position, gap) of each output token that scores more than ``tol`` below the reference's
    best, given the prompt and the output before it."""
    ids = torch.tensor([prompt + output])
    logits = hf(ids).logits[0].float()  # [T, vocab]
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(output)]
    gap = rows.max(-1).values - rows.gather(1, torch.tensor(output)[:, None])[:, 0]
    return [(i, round(float(g), 4)) for i, g in enumerate(gap) if g > tol]


def _engine(folder, dtype, device, **kw):
    return Engine.from_pretrained(str(folder), draft=str(folder), dtype=dtype, device=device, max_num_seqs=8,
                                  max_model_len=256, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_greedy_with_speculation_equals_transformers(folder, reference, device):
    eng = _engine(folder, "float32", device)
    prompts = _prompts()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True), SPECS)
    assert sum(o.stats.accepted for o in outs) > 0  # speculation really ran (accepted candidates)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(reference, p, NEW)
        assert far_from_argmax(reference, p, o.token_ids, tol=1e-3) == []


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_greedy_with_speculation_is_transformers_argmax_up_to_near_ties(folder, reference_bf16_weights,
                                                                           device):
    eng = _engine(folder, "bfloat16", device)
    prompts = _prompts()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True), SPECS)
    assert sum(o.stats.accepted for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == NEW
        assert far_from_argmax(reference_bf16_weights, p, o.token_ids, tol=1.0) == [], o.token_ids


def test_the_teacher_forced_check_can_fail(folder, reference):
    """The control: the reference's own greedy output passes; the same output with one token
    swapped for a token the reference scores below its best by more than the bf16 ``tol``
    (its least likely one) fails, at that position."""
    p = _prompts()[0]
    good = hf_greedy(reference, p, 12)
    assert far_from_argmax(reference, p, good, tol=1e-3) == []
    with torch.no_grad():
        worst = int(reference(torch.tensor([p + good[:5]])).logits[0, -1].argmin())
    bad = good[:5] + [worst] + good[6:]
    flagged = far_from_argmax(reference, p, bad, tol=1.0)
    assert flagged and flagged[0][0] == 5


SAMPLED = [SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=1, ignore_eos=True),
           SamplingParams(max_new_tokens=NEW, temperature=1.2, top_k=20, seed=2, ignore_eos=True),
           SamplingParams(max_new_tokens=NEW, ignore_eos=True),
           SamplingParams(max_new_tokens=NEW, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_sampled_bf16_run_repeats_itself_draw_for_draw(folder, device):
    """The precondition of every draw-for-draw comparison: two engines of one configuration,
    given the same seeded requests, emit the same tokens (bf16, where a forward that rounded
    differently between runs would move a sampled token)."""
    runs = [[o.token_ids for o in _engine(folder, "bfloat16", device).generate(_prompts(), params, SPECS)]
            for params in (SAMPLED, SAMPLED, [replace(p, seed=p.seed + 100 if p.seed else None) for p in SAMPLED])]
    assert runs[0] == runs[1]
    assert runs[2] != runs[0]  # the control: other seeds draw other tokens (the runs do sample)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_verifier_in_the_engine_equals_torch_draw_for_draw(folder, dtype):
    """The same requests (seeded sampling with temperature, top-k, top-p; greedy rows beside
    them) through an engine verifying with the Triton kernels and one verifying with the torch
    reference: the same tokens, draw for draw."""
    params = SAMPLED
    runs = {}
    for backend in ("triton", "torch"):
        eng = _engine(folder, dtype, "cuda", verifier=backend)
        assert eng.verifier_backend == backend
        runs[backend] = [o.token_ids for o in eng.generate(_prompts(), params, SPECS)]
    assert runs["triton"] == runs["torch"]


@pytest.mark.cuda
@needs_cuda
def test_auto_verifier_on_cuda_is_triton(folder):
    pytest.importorskip("triton")
    assert _engine(folder, "bfloat16", "cuda").verifier_backend == "triton"
