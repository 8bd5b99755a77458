"""EAGLE-3 heads in the ``speculators`` format (the one vLLM serves), in and out.

A speculators folder holds ``config.json`` and ``*.safetensors``:

* config: ``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (a Llama
  config of the draft's decoder: hidden size, heads, ``num_hidden_layers``, rope,
  ``vocab_size`` = the target's vocabulary), ``draft_vocab_size``,
  ``eagle_aux_hidden_state_layer_ids`` (the target layers fused; vLLM's default when
  absent: 2, L // 2, L - 3), ``target_hidden_size``, the flags ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, and ``speculators_config`` (algorithm,
  proposal method, the verifier's name);
* weights: ``fc.weight`` [H, nF * H_t]; ``layers.{i}.*`` (Llama names; layer 0's
  ``self_attn.{q,k,v}_proj`` read 2H and it has ``hidden_norm``; older checkpoints say
  ``midlayer.``); ``norm.weight``; ``lm_head.weight`` [N, H]; ``d2t`` [N] int64 (target id of
  draft id ``i`` is ``i + d2t[i]``) and ``t2d`` [V] bool when the draft vocabulary is
  reduced; optionally ``embed_tokens.weight`` (else the target's), ``input_norm.weight``
  (``norm_before_fc``), ``fc_norm.{i}.weight`` (``fc_norm``).

``load_speculators`` turns one into our head (``HeadConfig`` with ``arch="eagle3"`` and the
state ``DraftHead`` / ``save_head`` use); ``save_speculators`` writes ours out. Only Llama
decoder layers without biases are taken; anything else is refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from adaptspec.models.head import HeadConfig, default_feature_layers

SPECULATORS_VERSION = "0.9.0"  # the format version written (speculators' own package version)


def is_speculators_folder(folder: Path) -> bool:
    p = Path(folder) / "config.json"
    if not p.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(p.read_text())
    except json.JSONDecodeError:
        return False


def _rope(tl: dict) -> tuple[float, dict | None]:
    params = tl.get("rope_parameters") or tl.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", tl.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if kind not in ("default", None) else None
    if scaling is not None:
        scaling.setdefault("rope_type", kind)
    return theta, scaling


def load_speculators(folder: Path, target_num_layers: int | None = None) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """(config, state) of an EAGLE-3 head saved in the speculators format.

    ``target_num_layers`` is needed only when the config does not list the fused layers
    (``eagle_aux_hidden_state_layer_ids``), to apply vLLM's default."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not is_speculators_folder(folder):
        raise ValueError(f"speculators: {folder} has no config.json with speculators_model_type")
    cfg = json.loads((folder / "config.json").read_text())
    kind = cfg["speculators_model_type"]
    if kind != "eagle3":
        raise ValueError(f"speculators_model_type: only 'eagle3' is supported, got {kind!r}")
    tl = cfg.get("transformer_layer_config") or {}
    mt = tl.get("model_type", "llama")
    if mt != "llama":
        raise ValueError(f"transformer_layer_config.model_type: only 'llama' decoder layers are supported, got {mt!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if tl.get(flag):
            raise ValueError(f"transformer_layer_config.{flag}: biases are not supported")
    if tl.get("hidden_act", "silu") != "silu":
        raise ValueError(f"transformer_layer_config.hidden_act: only silu, got {tl.get('hidden_act')!r}")
    H, nh = int(tl["hidden_size"]), int(tl["num_attention_heads"])
    layers = cfg.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        if target_num_layers is None:
            raise ValueError("eagle_aux_hidden_state_layer_ids: not in the config; pass target_num_layers for "
                             "vLLM's default (2, L // 2, L - 3)")
        layers = default_feature_layers(target_num_layers)
    theta, scaling = _rope(tl)
    V = int(tl["vocab_size"])
    N = int(cfg.get("draft_vocab_size") or V)
    hc = HeadConfig(hidden_size=H, intermediate_size=int(tl["intermediate_size"]),
                    num_layers=int(tl.get("num_hidden_layers", 1)), num_heads=nh,
                    num_kv_heads=int(tl.get("num_key_value_heads") or nh),
                    head_dim=int(tl.get("head_dim") or H // nh), rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
                    rope_theta=theta, max_position=int(tl.get("max_position_embeddings", 4096)),
                    target_vocab_size=V, draft_vocab_size=N, rope_scaling=scaling, arch="eagle3",
                    feature_layers=list(layers), target_hidden_size=cfg.get("target_hidden_size"),
                    norm_before_fc=bool(cfg.get("norm_before_fc", False)), fc_norm=bool(cfg.get("fc_norm", False)),
                    norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                    norm_output=bool(cfg.get("norm_output", False)), own_lm_head=True,
                    target={"name": ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"),
                            "vocab_size": V},
                    training={"source": "speculators", "speculators_version": cfg.get("speculators_version")})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculators: {folder} has no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    state: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        if k.startswith("layers."):
            state["model." + k] = v
        elif k == "norm.weight":
            state["model.norm.weight"] = v
        elif k in ("fc.weight", "lm_head.weight", "input_norm.weight", "embed_tokens.weight") or k.startswith("fc_norm."):
            state[k] = v
        elif k in ("d2t", "t2d") or k.startswith("verifier_"):
            continue
        else:
            raise ValueError(f"speculators: unexpected weight {k!r} in {folder}")
    if N < V:
        if "d2t" not in raw:
            raise ValueError(f"speculators: draft_vocab_size {N} < vocab_size {V} but the weights have no d2t")
        d2t = raw["d2t"].to(torch.long)
        if d2t.shape != (N,):
            raise ValueError(f"d2t: shape {tuple(d2t.shape)}, expected ({N},)")
        ids = torch.arange(N) + d2t
        if "t2d" in raw and not torch.equal(raw["t2d"].to(torch.bool).nonzero().squeeze(1), ids.sort().values):
            raise ValueError("t2d: does not mark the same target tokens as d2t")
    else:
        ids = torch.arange(V)
    if ids.min() < 0 or ids.max() >= V or ids.unique().numel() != N:
        raise ValueError("d2t: draft ids must map to distinct target ids in range")
    state["vocab_ids"] = ids.to(torch.int32)
    for need in ("fc.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.hidden_norm.weight"):
        if need not in state:
            raise ValueError(f"speculators: {folder} lacks {need.replace('model.', '', 1)!r}")
    return hc, state


def save_speculators(cfg: HeadConfig, state: dict[str, torch.Tensor], folder: Path, *,
                     target_output: torch.Tensor | None = None, verifier: str | None = None,
                     verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write an eagle3 head (ours: ``export_state`` / ``load_head_state``) in the speculators
    format. A head that uses the target's output rows needs ``target_output`` [V, H]."""
    from safetensors.torch import save_file

    if cfg.arch != "eagle3":
        raise ValueError(f"arch: only eagle3 heads have a speculators form, this one is {cfg.arch!r}")
    ids = state["vocab_ids"].to(torch.long)
    if cfg.own_lm_head:
        lm_head = state["lm_head.weight"]
    elif target_output is None:
        raise ValueError("target_output: this head uses the target's output layer; pass it ([vocab, hidden])")
    else:
        lm_head = target_output.index_select(0, ids)
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.startswith("model.layers."):
            out[k[len("model."):]] = v
        elif k == "model.norm.weight":
            out["norm.weight"] = v
        elif k in ("fc.weight", "input_norm.weight", "embed_tokens.weight") or k.startswith("fc_norm."):
            out[k] = v
    out["lm_head.weight"] = lm_head
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    N, V = cfg.draft_vocab_size, cfg.target_vocab_size
    if N < V:
        out["d2t"] = (ids - torch.arange(N)).to(torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    rope = {"rope_theta": cfg.rope_theta, **({"rope_scaling": cfg.rope_scaling} if cfg.rope_scaling else {})}
    tl = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
          "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.rms_norm_eps,
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
          "torch_dtype": str(dtype).replace("torch.", ""), **rope}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl,
        "draft_vocab_size": N,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers) or None,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or (cfg.target or {}).get("name"),
                         "architectures": verifier_architectures or ["LlamaForCausalLM"]},
        },
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m adaptspec.models.speculators export HEAD_FOLDER OUT --target T`` writes our
    eagle3 head in the speculators format; ``... import SPEC_FOLDER OUT [--target-layers L]``
    turns a speculators checkpoint into an adaptspec head folder."""
    import argparse

    from adaptspec.distill.head import load_head_state, read_head_config, save_head_state  # noqa: I001

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("action", choices=("export", "import"))
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", default="smollm2-135m", help="export: the target whose output layer the head uses")
    ap.add_argument("--target-layers", type=int, default=None, help="import: the target's layer count, when the "
                                                                     "checkpoint does not list its fused layers")
    a = ap.parse_args(argv)
    if a.action == "export":
        cfg, state = read_head_config(a.src), load_head_state(a.src)
        out = None
        if not cfg.own_lm_head:
            from adaptspec.distill.head import target_output_weight
            from adaptspec.models.loader import load_weights
            from adaptspec.models.registry import resolve

            w = load_weights(resolve(a.target, quiet=True))
            out = target_output_weight(w, "lm_head.weight" not in w)
        save_speculators(cfg, state, a.out, target_output=out, verifier=a.target)
    else:
        cfg, state = load_speculators(a.src, a.target_layers)
        save_head_state(cfg, state, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
