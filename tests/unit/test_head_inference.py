"""EAGLE-3 heads at inference: the engine's ``HeadModel`` on the paged cache computes what the
training module ``DraftHead`` (itself checked against the speculators format's reference in
test_speculators.py) computes, pass by pass; and an engine drafting with one stays exact."""
from __future__ import annotations

import pytest
import torch

from adaptspec import Engine, SamplingParams, SpecConfig
from adaptspec.distill.head import DraftHead, HeadConfig, save_head
from adaptspec.models.batch import FlatBatch
from adaptspec.models.llama import LlamaConfig
from adaptspec.models.loader import load_draft, load_model, load_weights
from tests.conftest import make_tiny_model

V = 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e3_target"), vocab=V, seed=3, layers=3)


def _eagle3_head(target_dir, folder, **opts):
    from transformers import AutoConfig

    tcfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(target_dir))
    cfg = HeadConfig.for_target(tcfg, num_layers=2, draft_vocab_size=30, arch="eagle3", feature_layers=[1, 2, 3],
                                **opts)
    w = load_weights(target_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g)[:30].sort().values
    head = DraftHead(cfg, w["model.embed_tokens.weight"], w["lm_head.weight"][ids], ids)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    save_head(head, folder, dtype=torch.float32)
    return head, cfg


@pytest.mark.parametrize("opts", [{}, {"norm_before_residual": True, "fc_norm": True, "norm_output": True}])
def test_eagle3_head_model_equals_the_training_module(target_dir, tmp_path, opts):
    from transformers import AutoModelForCausalLM

    head, cfg = _eagle3_head(target_dir, tmp_path / "head", **opts)
    t = load_model(str(target_dir), matmul="reference")
    hm = load_draft(str(tmp_path / "head"), t).model
    hm.allocate_kv(4, 16)
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in cfg.feature_layers], -1)  # [1, 14, 3H]
        outs = head(feats, ids, passes=3)

    def run(x, toks, start, from_target):
        toks = toks[0].tolist()
        b = FlatBatch.build([toks], [start], [[0, 1, 2, 3]], list(range(len(toks))), 16, "cpu")
        return hm.forward(x[0], b, from_target)

    lg, _ = run(feats[:, :13], ids[:, 1:], 0, True)
    torch.testing.assert_close(head.logits(outs[0])[0], lg, atol=1e-4, rtol=1e-4)
    j = 7  # pass 3 at entry j: target entries < j-1, then the head's own outputs twice
    run(feats[:, :j - 1], ids[:, 1:j], 0, True)
    _, o1 = run(feats[:, j - 2:j - 1], ids[:, j - 1:j], j - 2, True)
    lg2, o2 = run(o1[None], ids[:, j:j + 1], j - 1, False)
    lg3, _ = run(o2[None], ids[:, j + 1:j + 2], j, False)
    torch.testing.assert_close(head.logits(outs[1])[0, j - 1], lg2[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head.logits(outs[2])[0, j], lg3[0], atol=1e-4, rtol=1e-4)
    # the control: feeding the normed output where the pre-norm one belongs (or back) differs
    other = torch.nn.functional.rms_norm(o1, (cfg.hidden_size,), hm.decoder.norm, cfg.rms_norm_eps) \
        if not cfg.norm_output else o1.flip(-1)
    lg2_bad, _ = run(other[None], ids[:, j:j + 1], j - 1, False)
    assert (lg2_bad - lg2).abs().max() > 1e-3


def test_an_engine_drafting_with_an_eagle3_head_is_exact(target_dir, tmp_path):
    _eagle3_head(target_dir, tmp_path / "head")
    eng = Engine.from_pretrained(str(target_dir), draft=str(tmp_path / "head"))
    assert eng.feature_layers == (1, 2, 3)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 40, 19)]
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in eng.generate(prompts, greedy)]
    got = eng.generate(prompts, greedy, SpecConfig("draft", 3))
    assert [o.token_ids for o in got] == want
    assert eng.drafter_errors == 0 and sum(o.stats.drafted for o in got) > 0


def test_a_speculators_folder_loads_as_a_draft_and_drafts_exactly(target_dir, tmp_path):
    """What a vLLM user brings: an EAGLE-3 head in the speculators format, given as the draft."""
    from adaptspec.distill.head import load_head_state
    from adaptspec.models.speculators import save_speculators

    head, cfg = _eagle3_head(target_dir, tmp_path / "head")
    out = save_speculators(cfg, load_head_state(tmp_path / "head"), tmp_path / "spec",
                           target_output=load_weights(target_dir)["lm_head.weight"], dtype=torch.float32)
    eng = Engine.from_pretrained(str(target_dir), draft=str(out))
    ref = Engine.from_pretrained(str(target_dir), draft=str(tmp_path / "head"))
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 33)]
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    a = eng.generate(prompts, greedy, SpecConfig("draft", 3))
    b = ref.generate(prompts, greedy, SpecConfig("draft", 3))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in eng.generate(prompts, greedy)]
    # the same head in either format drafts the same candidates, so accepts the same counts
    assert [o.stats.accepted for o in a] == [o.stats.accepted for o in b]
