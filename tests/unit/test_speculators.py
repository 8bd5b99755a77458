"""EAGLE-3 heads in the speculators format: round trip, and our forward equal to an
independent reference written from the format's definition.

The ``speculators`` package itself cannot be the reference here: installing it pulls a
CUDA build of torch (and torchaudio / torchvision) in place of the CPU torch this project
pins (checked with ``pip install --dry-run speculators``). The reference below follows
speculators' ``Eagle3DraftModel.forward`` (dense-mask path) literally: all drafting
steps' keys concatenated into one sequence, a causal block for step 0 and a diagonal block
per later step, positions starting at 1 and advancing by one per step, the step's tokens
shifted left by one, the hidden state carried from the previous step at the same index.
Our ``DraftHead`` instead indexes entries by the position they predict and rolls the
diagonal keys; the two agree only if both are right."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adaptspec.distill.head import DraftHead, HeadConfig, build_head
from adaptspec.models.speculators import is_speculators_folder, load_speculators, save_speculators

V, H, NH, NKV, HD, I = 50, 16, 4, 2, 4, 24  # target vocabulary, head width, heads, MLP


def _cfg(**kw) -> HeadConfig:
    base = dict(hidden_size=H, intermediate_size=I, num_layers=1, num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position=256, target_vocab_size=V, draft_vocab_size=30,
                arch="eagle3", feature_layers=[1, 3, 5])
    base.update(kw)
    return HeadConfig(**base)


def _random_head(cfg: HeadConfig, seed: int = 0) -> tuple[DraftHead, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    target_out = torch.randn(V, H, generator=g)
    ids = torch.randperm(V, generator=g)[:cfg.draft_vocab_size].sort().values
    head = DraftHead(cfg, embed, target_out[ids], ids)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.4 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return head, embed, target_out


# ---- the reference ------------------------------------------------------------------
def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def reference_forward(folder: Path, target_embed: torch.Tensor, hidden_states: torch.Tensor,
                      input_ids: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits per step, [L, N] each, of the folder's head for
    ``hidden_states`` [L, nF * H_t] (the target's features at x_0..x_{L-1}) and
    ``input_ids`` [L] (x_1..x_L, already shifted by one as speculators' data does)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tl = cfg["transformer_layer_config"]
    w = {k.replace("midlayer.", "layers.0."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    eps, nh, nkv = tl["rms_norm_eps"], tl["num_attention_heads"], tl["num_key_value_heads"]
    hd = tl.get("head_dim") or tl["hidden_size"] // nh
    embed = w.get("embed_tokens.weight", target_embed)
    L = hidden_states.shape[0]
    hs = hidden_states.float()
    if cfg.get("norm_before_fc"):
        hs = _rms(hs, w["input_norm.weight"], eps)
    if cfg.get("fc_norm"):
        parts = hs.chunk(len(cfg["eagle_aux_hidden_state_layer_ids"]), -1)
        hs = torch.cat([_rms(x, w[f"fc_norm.{i}.weight"], eps) for i, x in enumerate(parts)], -1)
    hs = hs @ w["fc.weight"].t()
    inv = 1.0 / (tl["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    position_ids = 1 + torch.arange(L)
    keys = [[] for _ in range(tl["num_hidden_layers"])]
    vals = [[] for _ in range(tl["num_hidden_layers"])]
    ids = input_ids.clone()
    out = []
    for step in range(ttt_steps):
        e = embed[ids]
        fr = torch.outer(position_ids.double(), inv)
        cos, sin = torch.cat([fr, fr], -1).cos().float(), torch.cat([fr, fr], -1).sin().float()
        # the dense mask: step-0 block causal, one diagonal block per later step
        blocks = [torch.tril(torch.ones(L, L, dtype=torch.bool))] + [torch.eye(L, dtype=torch.bool)] * step
        mask = torch.cat(blocks, -1)
        h = hs
        for li in range(tl["num_hidden_layers"]):
            p = f"layers.{li}."
            if li == 0:
                hid = _rms(h, w[p + "hidden_norm.weight"], eps)
                x = torch.cat([_rms(e, w[p + "input_layernorm.weight"], eps), hid], -1)
                residual = hid if cfg.get("norm_before_residual") else h
            else:
                x, residual = _rms(h, w[p + "input_layernorm.weight"], eps), h
            q = (x @ w[p + "self_attn.q_proj.weight"].t()).view(L, nh, hd).transpose(0, 1)
            k = (x @ w[p + "self_attn.k_proj.weight"].t()).view(L, nkv, hd).transpose(0, 1)
            v = (x @ w[p + "self_attn.v_proj.weight"].t()).view(L, nkv, hd).transpose(0, 1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            keys[li].append(k)
            vals[li].append(v)
            K = torch.cat(keys[li], 1).repeat_interleave(nh // nkv, 0)
            Vv = torch.cat(vals[li], 1).repeat_interleave(nh // nkv, 0)
            a = F.scaled_dot_product_attention(q, K, Vv, attn_mask=mask)  # [nh, L, hd]
            h = residual + a.transpose(0, 1).reshape(L, nh * hd) @ w[p + "self_attn.o_proj.weight"].t()
            y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].t()) * (y @ w[p + "mlp.up_proj.weight"].t())) \
                @ w[p + "mlp.down_proj.weight"].t()
        normed = _rms(h, w["norm.weight"], eps)
        out.append(normed @ w["lm_head.weight"].t())
        hs = normed if cfg.get("norm_output") else h
        ids = torch.cat([input_ids[1 + step:], input_ids.new_zeros(1 + step)])
        position_ids = position_ids + 1
    return out


def _compare(head: DraftHead, folder: Path, embed: torch.Tensor, steps: int = 3, L: int = 11, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (1, L + 1), generator=g)
    feats = torch.randn(1, L + 1, head.cfg.feature_size, generator=g) * 2
    with torch.no_grad():
        ours = [head.logits(x)[0] for x in head(feats, tokens, passes=steps)]  # pass s: [L, N]
    ref = reference_forward(folder, embed, feats[0, :L], tokens[0, 1:], steps)
    for s in range(steps):
        # speculators' step s at index j drafts what our pass s + 1 drafts at entry j + s
        torch.testing.assert_close(ours[s][s:], ref[s][:L - s], atol=2e-4, rtol=2e-4)
    return ours, ref


@pytest.mark.parametrize("flags", [
    {},
    {"norm_before_fc": True, "norm_before_residual": True},
    {"fc_norm": True, "norm_output": True, "num_layers": 2},
])
def test_our_head_saved_as_speculators_equals_the_reference(tmp_path, flags):
    cfg = _cfg(**flags)
    head, embed, target_out = _random_head(cfg)
    folder = save_speculators(cfg, head.export_state(), tmp_path / "spec", target_output=target_out,
                              verifier="tiny-target", dtype=torch.float32)
    assert is_speculators_folder(folder)
    _compare(head, folder, embed)


def test_round_trip_keeps_config_and_weights(tmp_path):
    cfg = _cfg(norm_before_fc=True)
    head, embed, target_out = _random_head(cfg, seed=1)
    folder = save_speculators(cfg, head.export_state(), tmp_path / "a", target_output=target_out, dtype=torch.float32)
    cfg2, state2 = load_speculators(folder)
    for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
              "target_vocab_size", "draft_vocab_size", "feature_layers", "norm_before_fc", "fc_norm",
              "norm_before_residual", "norm_output", "arch"):
        assert getattr(cfg2, f) == getattr(cfg, f), f
    assert cfg2.own_lm_head  # the file carries lm_head; ours took the target's rows V
    mine = head.export_state()
    assert torch.equal(state2["vocab_ids"].long(), mine["vocab_ids"].long())
    torch.testing.assert_close(state2["lm_head.weight"], target_out[mine["vocab_ids"].long()])
    for k, v in mine.items():
        torch.testing.assert_close(state2[k].to(v.dtype), v, msg=k)
    # and back out: the second file equals the first
    folder2 = save_speculators(cfg2, state2, tmp_path / "b", dtype=torch.float32)
    from safetensors.torch import load_file

    a, b = load_file(str(folder / "model.safetensors")), load_file(str(folder2 / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a DraftHead built from the loaded state drafts exactly what the original does
    loaded = build_head(cfg2, state2, {"model.embed_tokens.weight": embed, "lm_head.weight": target_out}, tie=False)
    feats, tokens = torch.randn(1, 9, cfg.feature_size), torch.randint(0, V, (1, 9))
    with torch.no_grad():
        for x, y in zip(head(feats, tokens, 3), loaded(feats, tokens, 3)):
            torch.testing.assert_close(head.logits(x), loaded.logits(y))


def _foreign_folder(folder: Path, seed: int = 3) -> Path:
    """A checkpoint as the ecosystem writes it: ``midlayer.`` names, its own embedding,
    d2t / t2d, a verifier name, no aux layer ids (vLLM's default applies)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    N, Ht = 20, H
    ids = torch.randperm(V, generator=g)[:N].sort().values

    def r(*shape, scale=0.4):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": r(H, 3 * Ht), "norm.weight": 1 + r(H, scale=0.1), "lm_head.weight": r(N, H),
         "embed_tokens.weight": r(V, H, scale=1.0), "d2t": ids - torch.arange(N),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)}
    for n, shape in {"input_layernorm": (H,), "hidden_norm": (H,), "post_attention_layernorm": (H,)}.items():
        w[f"midlayer.{n}.weight"] = 1 + r(*shape, scale=0.1)
    for n, o in (("q_proj", NH * HD), ("k_proj", NKV * HD), ("v_proj", NKV * HD)):
        w[f"midlayer.self_attn.{n}.weight"] = r(o, 2 * H)
    w["midlayer.self_attn.o_proj.weight"] = r(H, NH * HD)
    w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"] = r(I, H), r(I, H)
    w["midlayer.mlp.down_proj.weight"] = r(H, I)
    folder.mkdir(parents=True)
    save_file(w, str(folder / "model.safetensors"))
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": N,
           "norm_before_residual": True, "target_hidden_size": None,
           "transformer_layer_config": {"model_type": "llama", "vocab_size": V, "hidden_size": H,
                                        "intermediate_size": I, "num_hidden_layers": 1, "num_attention_heads": NH,
                                        "num_key_value_heads": NKV, "head_dim": HD, "rms_norm_eps": 1e-5,
                                        "rope_theta": 500000.0, "max_position_embeddings": 2048},
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_an_ecosystem_checkpoint_loads_and_drafts_like_the_reference(tmp_path):
    folder = _foreign_folder(tmp_path / "foreign")
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_speculators(folder)
    cfg, state = load_speculators(folder, target_num_layers=8)
    assert cfg.feature_layers == [2, 4, 5] and cfg.norm_before_residual and cfg.target["name"] == "some/target"
    target_embed = torch.randn(V, H)  # differs from the checkpoint's own: the checkpoint's is used
    head = build_head(cfg, state, {"model.embed_tokens.weight": target_embed}, tie=True)
    _compare(head, folder, target_embed)


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    folder = _foreign_folder(tmp_path / "f")
    raw = json.loads((folder / "config.json").read_text())
    for patch, match in (({"speculators_model_type": "mlp"}, "speculators_model_type"),
                         ({"transformer_layer_config": {**raw["transformer_layer_config"], "model_type": "qwen3"}},
                          "model_type"),
                         ({"transformer_layer_config": {**raw["transformer_layer_config"], "attention_bias": True}},
                          "attention_bias")):
        (folder / "config.json").write_text(json.dumps({**raw, **patch}))
        with pytest.raises(ValueError, match=match):
            load_speculators(folder, target_num_layers=8)
    with pytest.raises(ValueError, match="speculators_model_type"):
        load_speculators(tmp_path)  # no config at all
    plain = HeadConfig(hidden_size=H, intermediate_size=I, num_layers=1, num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position=64, target_vocab_size=V, draft_vocab_size=V)
    with pytest.raises(ValueError, match="arch"):
        save_speculators(plain, {}, tmp_path / "x")  # the first head's layout has no speculators form


def test_the_comparison_can_fail(tmp_path):
    """Negative controls: the same weights under a config that differs in one flag, or our
    passes read one entry off, do not match the reference (the check is not vacuous)."""
    cfg = _cfg()
    head, embed, target_out = _random_head(cfg, seed=2)
    folder = save_speculators(cfg, head.export_state(), tmp_path / "s", target_output=target_out, dtype=torch.float32)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "norm_before_residual": True}))
    with pytest.raises(AssertionError):
        _compare(head, folder, embed)
    (folder / "config.json").write_text(json.dumps(raw))
    ours, ref = _compare(head, folder, embed)
    assert not torch.allclose(ours[1][:-1], ref[1][:-1], atol=1e-2)  # pass 2 against step 1 unshifted


def test_the_command_converts_both_ways(tmp_path):
    """``python -m adaptspec.models.speculators import`` then ``export``: the checkpoint's
    weights come back unchanged (our head folder in between reads as an eagle3 head)."""
    from safetensors.torch import load_file

    from adaptspec.distill.head import read_head_config
    from adaptspec.models.speculators import main

    src = _foreign_folder(tmp_path / "src")
    main(["import", str(src), str(tmp_path / "ours"), "--target-layers", "8"])
    assert read_head_config(tmp_path / "ours").arch == "eagle3"
    main(["export", str(tmp_path / "ours"), str(tmp_path / "back")])
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    a = {k.replace("midlayer.", "layers.0."): v for k, v in a.items()}
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].to(b[k].dtype), b[k]) or torch.equal(a[k], b[k].to(a[k].dtype)), k
