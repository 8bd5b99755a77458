"""The feature-level draft head for a Llama-family target: two architectures.

Both draft from the target's own features. Entry ``j`` of the head's sequence takes the
target's feature at position ``j`` (which predicts token ``x_{j+1}``) and the embedding of
that next token ``x_{j+1}``; its output ``g_j`` predicts ``x_{j+2}``. ``embed`` is the
target's, frozen and never stored with the head.

``arch="adaptspec"`` (format 1, the first shipped head): the feature is the target's final
normed hidden state ``f_j``, and

    u_j = W_in [rmsnorm(f_j); rmsnorm(embed(x_{j+1}))]
    g_j = norm(decoder_layers(u_0..u_j))
    logits_j = g_j @ W_out[V]            # W_out: the target's output layer, rows V

``arch="eagle3"`` (EAGLE-3, the layout of the ``speculators`` format that vLLM serves): the
feature is the concatenation of several of the target's layers (``feature_layers``, see
``HeadConfig``), fused once by ``fc``; the first decoder layer attends over the token and
the hidden state side by side:

    h_j = fc(a_j)                                              # a_j: [nF * H_t] fused features
    layer 0: x = [rmsnorm_in(embed(x_{j+1})); rmsnorm_hidden(h_j)]   (2H wide q/k/v input)
             h = r + o_proj(attn(x)), r = h_j (or rmsnorm_hidden(h_j): norm_before_residual)
             h = h + mlp(rmsnorm_post(h))
    layers 1..: ordinary Llama layers;  g_j = norm(h);  logits_j = lm_head(g_j)

``V`` is a reduced draft vocabulary (the ``N`` most frequent tokens of the data: FR-Spec);
tokens outside it get draft probability 0, which keeps verification exact.

When it drafts the ``s``-th candidate of a step, the head has no target feature for the
positions it invented; it feeds its own output instead (adaptspec: the normed ``g``;
eagle3: the pre-norm ``h`` after the last layer, or ``g`` with ``norm_output``), which
skips ``W_in`` / ``fc``'s feature half (eagle3: skips ``fc``). Training therefore unrolls
``S`` such passes ("training-time test", EAGLE-3): pass ``s`` at entry ``j`` takes pass
``s-1``'s output at ``j-1`` as its feature and attends to pass 1's entries up to ``j-s+1``
plus the entries of passes ``2..s`` on the diagonal, exactly the context it has at
drafting time.

This module holds the trainable ``DraftHead`` (torch ``nn.Module``; with ``passes=k`` it is
also the reference forward of drafting ``k`` candidates) and writes the file format
(``draft.json`` + ``model.safetensors``); the format's config and reader, and ``HeadModel``,
the inference form on the engine's forward, live with the models (``adaptspec.models.head``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptspec.models.head import (ARCHS, FORMAT_VERSION, HEAD_FILE, READABLE_VERSIONS,  # noqa: F401  (the
                                   HeadConfig, HeadModel, default_feature_layers,  # file format and the
                                   is_head_folder, load_head_state, read_head_config)  # inference form)
from adaptspec.models.llama import _inv_freq

class _Layer(nn.Module):
    """A Llama decoder layer; ``eagle3_first``: q/k/v read [token; hidden] (2H) and a
    ``hidden_norm`` normalizes the hidden half."""

    def __init__(self, c: HeadConfig, eagle3_first: bool = False):
        super().__init__()
        H, nq, nkv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        din = 2 * H if eagle3_first else H
        self.eagle3_first = eagle3_first
        self.input_layernorm = nn.Parameter(torch.ones(H))
        if eagle3_first:
            self.hidden_norm = nn.Parameter(torch.ones(H))
        self.q_proj = nn.Linear(din, nq, bias=False)
        self.k_proj = nn.Linear(din, nkv, bias=False)
        self.v_proj = nn.Linear(din, nkv, bias=False)
        self.o_proj = nn.Linear(nq, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors under their Hugging Face names (``model.layers.i.`` + name)."""
        out = {"input_layernorm.weight": self.input_layernorm,
               "post_attention_layernorm.weight": self.post_attention_layernorm,
               **{f"self_attn.{n}.weight": getattr(self, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{f"mlp.{n}.weight": getattr(self, n).weight for n in ("gate_proj", "up_proj", "down_proj")}}
        if self.eagle3_first:
            out["hidden_norm.weight"] = self.hidden_norm
        return out

    @torch.no_grad()
    def copy_from(self, src: dict[str, torch.Tensor], prefix: str) -> None:
        for name, t in self.named_tensors().items():
            if src[prefix + name].shape != t.shape:
                raise ValueError(f"{prefix + name}: shape {tuple(src[prefix + name].shape)}, the head needs "
                                 f"{tuple(t.shape)}")
            t.copy_(src[prefix + name])


class DraftHead(nn.Module):
    """Trainable head. ``embed`` [vocab, H] is a frozen buffer taken from the target;
    ``out_weight`` [N, H] the output layer for the draft vocabulary (frozen unless
    ``cfg.own_lm_head``, then a parameter); ``vocab_ids`` [N] maps draft-vocabulary rows
    to target ids."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, out_weight: torch.Tensor,
                 vocab_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        if out_weight.shape != (cfg.draft_vocab_size, H) or vocab_ids.shape != (cfg.draft_vocab_size,):
            raise ValueError("draft vocabulary: out_weight / vocab_ids do not match draft_vocab_size")
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        if cfg.own_lm_head:
            self.out_weight = nn.Parameter(out_weight.detach().clone())
        else:
            self.register_buffer("out_weight", out_weight.detach().clone(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())
        eagle3 = cfg.arch == "eagle3"
        if eagle3:
            F_in = cfg.feature_size
            self.fc = nn.Linear(F_in, H, bias=False)
            self.input_norm = nn.Parameter(torch.ones(F_in)) if cfg.norm_before_fc else None
            self.fc_norm = (nn.ParameterList(nn.Parameter(torch.ones(F_in // cfg.num_features))
                                             for _ in range(cfg.num_features)) if cfg.fc_norm else None)
        else:
            self.feature_norm = nn.Parameter(torch.ones(H))
            self.token_norm = nn.Parameter(torch.ones(H))
            self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(_Layer(cfg, eagle3 and i == 0) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(H))
        inv = _inv_freq(cfg.llama_config())
        self.register_buffer("inv_freq", inv, persistent=False)

    # names in the saved file (HF-like, so LlamaModel loads the decoder part as is)
    def export_state(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "model.norm.weight": self.norm,
               "vocab_ids": self.vocab_ids.to(torch.int32)}
        if self.cfg.arch == "eagle3":
            if self.input_norm is not None:
                out["input_norm.weight"] = self.input_norm
            for i, w in enumerate(self.fc_norm or []):
                out[f"fc_norm.{i}.weight"] = w
        else:
            out.update({"feature_norm.weight": self.feature_norm, "token_norm.weight": self.token_norm})
        if self.cfg.own_lm_head:
            out["lm_head.weight"] = self.out_weight
        for i, L in enumerate(self.layers):
            out.update({f"model.layers.{i}.{k}": v for k, v in L.named_tensors().items()})
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}

    def load_exported(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.export_state()
        missing = set(mine) - set(state)
        if missing:
            raise ValueError(f"draft head weights lack {sorted(missing)[:4]}")
        if not torch.equal(state["vocab_ids"].to(torch.long).cpu(), self.vocab_ids.cpu()):
            raise ValueError("draft vocabulary: the saved head's vocab_ids differ from this module's "
                             "(build the module with the saved vocab_ids)")
        params = dict(self.named_parameters())
        names = {"fc.weight": "fc.weight", "model.norm.weight": "norm", "feature_norm.weight": "feature_norm",
                 "token_norm.weight": "token_norm", "input_norm.weight": "input_norm", "lm_head.weight": "out_weight",
                 **{f"fc_norm.{i}.weight": f"fc_norm.{i}" for i in range(self.cfg.num_features)}}
        with torch.no_grad():
            for key, pname in names.items():
                if key in mine:
                    params[pname].copy_(state[key])
        for i, L in enumerate(self.layers):
            L.copy_from(state, f"model.layers.{i}.")

    def init_from_target_layers(self, weights: dict[str, torch.Tensor], first_layer: int) -> None:
        """Start the decoder layers from the target's layers ``first_layer..`` (a warm start).

        eagle3: layer 0's q/k/v get the target's weights on their hidden half (the token
        half keeps its random init), ``hidden_norm`` the target layer's input norm; ``fc``
        starts as the identity on the last feature (the highest layer), the final norm as
        the target's."""
        for i, L in enumerate(self.layers):
            p = f"model.layers.{first_layer + i}."
            if not L.eagle3_first:
                L.copy_from(weights, p)
                continue
            H = self.cfg.hidden_size
            with torch.no_grad():
                for n in ("q_proj", "k_proj", "v_proj"):
                    w = getattr(L, n).weight
                    w[:, :H].mul_(0.1)
                    w[:, H:].copy_(weights[p + f"self_attn.{n}.weight"])
                L.hidden_norm.copy_(weights[p + "input_layernorm.weight"])
                for n in ("o_proj",):
                    getattr(L, n).weight.copy_(weights[p + f"self_attn.{n}.weight"])
                for n in ("gate_proj", "up_proj", "down_proj"):
                    getattr(L, n).weight.copy_(weights[p + f"mlp.{n}.weight"])
                L.post_attention_layernorm.copy_(weights[p + "post_attention_layernorm.weight"])
        if self.cfg.arch == "eagle3":
            with torch.no_grad():
                w = self.fc.weight
                Ht = w.shape[1] // self.cfg.num_features
                w.mul_(0.1)
                if Ht == self.cfg.hidden_size:
                    w[:, -Ht:] += torch.eye(Ht, dtype=w.dtype)
                self.norm.copy_(weights["model.norm.weight"])

    # ---- forward with training-time test --------------------------------------------
    def _rope(self, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(L, device=device, dtype=torch.float32)
        fr = torch.outer(pos, self.inv_freq.to(device))
        emb = torch.cat([fr, fr], -1)
        return emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, L, D]

    def input_proj(self, feats: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """adaptspec: ``W_in [rmsnorm(f); rmsnorm(embed(x))]``."""
        eps = self.cfg.rms_norm_eps
        e = F.embedding(next_tokens, self.embed).to(feats.dtype)
        x = torch.cat([_rms(feats, self.feature_norm, eps),
                       _rms(e, self.token_norm, eps)], -1)
        return self.fc(x)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """eagle3: the target features [.., nF * H_t] -> the hidden state [.., H] (``fc``)."""
        eps = self.cfg.rms_norm_eps
        if self.input_norm is not None:
            feats = _rms(feats, self.input_norm, eps)
        if self.fc_norm is not None:
            parts = feats.chunk(len(self.fc_norm), -1)
            feats = torch.cat([_rms(x, w, eps) for x, w in zip(parts, self.fc_norm)], -1)
        return self.fc(feats)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, passes: int = 1) -> list[torch.Tensor]:
        """Teacher-forced unroll. ``feats`` [B, L, F]: the target's features at positions
        0..L-1 (``cfg.feature_size`` wide); ``tokens`` [B, L]: x_0..x_{L-1}. Returns, per
        pass, the head's normed outputs g [B, L-1, H] at entries j = 0..L-2 (entry j
        predicts x_{j+2}); entries j < s-1 of pass s have no valid input and must be masked
        by the caller."""
        c = self.cfg
        B, L, _ = feats.shape
        H = c.hidden_size
        n = L - 1
        nxt = tokens[:, 1:]
        cos, sin = self._rope(n, feats.device)
        eagle3 = c.arch == "eagle3"
        cos, sin = cos.to(feats.dtype), sin.to(feats.dtype)
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]  # per layer, per pass
        outs: list[torch.Tensor] = []
        e = F.embedding(nxt, self.embed) if eagle3 else None
        h_in = self.fuse(feats[:, :n]) if eagle3 else feats[:, :n]
        for s in range(1, passes + 1):
            if s > 1:  # the feature of entry j is the previous pass's output at j - 1
                h_in = torch.cat([torch.zeros_like(fb[:, :1]), fb[:, :-1]], 1)
            h = h_in if eagle3 else self.input_proj(h_in, nxt)
            for li, Lr in enumerate(self.layers):
                h = self._layer(Lr, h, cos, sin, kv[li], s, e if Lr.eagle3_first else None)
            g = _rms(h, self.norm, c.rms_norm_eps)
            outs.append(g)
            fb = h if eagle3 and not c.norm_output else g
        return outs

    def _layer(self, Lr: _Layer, h, cos, sin, kv_passes: list, s: int, e: torch.Tensor | None) -> torch.Tensor:
        c = self.cfg
        B, n, H = h.shape
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        eps = c.rms_norm_eps
        if e is not None:  # eagle3's first layer: [token; hidden] in, the hidden part is the residual
            hn = _rms(h, Lr.hidden_norm, eps)
            x = torch.cat([_rms(e.to(h.dtype), Lr.input_layernorm, eps), hn], -1)
            if c.norm_before_residual:
                h = hn
        else:
            x = _rms(h, Lr.input_layernorm, eps)
        q = Lr.q_proj(x).view(B, n, nh, hd).transpose(1, 2)
        k = Lr.k_proj(x).view(B, n, nkv, hd).transpose(1, 2)
        v = Lr.v_proj(x).view(B, n, nkv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, nh, n, hd]
        kv_passes.append((k, v))
        scale = 1.0 / math.sqrt(hd)
        k1, v1 = kv_passes[0]
        scores = (q @ k1.transpose(-1, -2)) * scale  # [B, nh, n, n] against pass-1 entries
        j = torch.arange(n, device=h.device)
        visible = j[None, :] <= (j[:, None] - (s - 1))  # pass-1 keys up to j - s + 1
        scores = scores.masked_fill(~visible, float("-inf"))
        if s == 1:
            a = torch.softmax(scores.float(), -1).to(q.dtype) @ v1
        else:
            diag_s, diag_v = [], []
            for r in range(2, s + 1):  # pass r's entry at j - (s - r), on the diagonal
                kr, vr = kv_passes[r - 1]
                shift = s - r
                kr_sh = torch.roll(kr, shift, dims=2)
                vr_sh = torch.roll(vr, shift, dims=2)
                d = (q * kr_sh).sum(-1) * scale  # [B, nh, n]
                if shift:
                    d = d.masked_fill(j[None, None, :] < shift, float("-inf"))
                diag_s.append(d[..., None])
                diag_v.append(vr_sh)
            allsc = torch.cat([scores, *diag_s], -1).float()
            p = torch.softmax(allsc, -1).to(q.dtype)
            a = p[..., :n] @ v1
            for i, vr_sh in enumerate(diag_v):
                a = a + p[..., n + i:n + i + 1] * vr_sh
        h = h + Lr.o_proj(a.transpose(1, 2).reshape(B, n, nh * hd))
        x = _rms(h, Lr.post_attention_layernorm, eps)
        return h + Lr.down_proj(F.silu(Lr.gate_proj(x)) * Lr.up_proj(x))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] of head features."""
        return g @ self.out_weight.to(g.dtype).t()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; the weight in the input's dtype, so bf16 autocast takes
    the fused kernel rather than the slow mixed-dtype path."""
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def target_output_weight(weights: dict[str, torch.Tensor], tie: bool) -> torch.Tensor:
    return weights["model.embed_tokens.weight"] if tie else weights["lm_head.weight"]


def save_head(head: DraftHead, folder: Path, dtype=torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in head.export_state().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt", "kind": "adaptspec-draft-head"})
    (folder / HEAD_FILE).write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    return folder


def build_head(cfg: HeadConfig, state: dict[str, torch.Tensor], target_weights: dict[str, torch.Tensor],
               tie: bool) -> DraftHead:
    """A ``DraftHead`` from a saved head and its target's weights (the reference forward).
    A head that carries its own token embedding (``embed_tokens.weight``, as speculators
    checkpoints may) uses it; otherwise the target's."""
    ids = state["vocab_ids"].to(torch.long)
    out = state["lm_head.weight"] if cfg.own_lm_head else target_output_weight(target_weights, tie).index_select(0, ids)
    embed = state.get("embed_tokens.weight", target_weights["model.embed_tokens.weight"])
    head = DraftHead(cfg, embed.float(), out.float(), ids)
    head.load_exported({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head.float()


def save_head_state(cfg: HeadConfig, state: dict[str, torch.Tensor], folder: Path) -> Path:
    """``save_head`` for a config and a state in ``export_state`` names, without a module
    (a converted checkpoint)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", "kind": "adaptspec-draft-head"})
    (folder / HEAD_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return folder
