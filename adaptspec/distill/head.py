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
also the reference forward of drafting ``k`` candidates), its file format (``draft.json``
+ ``model.safetensors``) and ``HeadModel``, the inference form on the engine's forward.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptspec.models.llama import LlamaConfig, LlamaModel, _inv_freq

HEAD_FILE = "draft.json"
FORMAT_VERSION = 2  # 2: arch, feature_layers, eagle3 norms, own lm_head (1 reads as adaptspec)
READABLE_VERSIONS = (1, 2)
ARCHS = ("adaptspec", "eagle3")


@dataclass(slots=True)
class HeadConfig:
    """A draft head's shape and what it reads from the target.

    ``feature_layers``: the target features the head takes, as indices into Hugging Face's
    ``output_hidden_states`` tuple of the target (``hidden_states[0]`` is the token
    embedding, ``hidden_states[i]`` the residual stream entering decoder layer ``i``, i.e.
    before the final norm; these are also vLLM's ``eagle_aux_hidden_state_layer_ids``). The
    feature at position ``j`` is the concatenation, in ``feature_layers`` order, of
    ``hidden_states[i][j]``: ``[len(feature_layers) * target_hidden_size]``. An empty list
    means the target's final NORMED hidden state (what the engine's verification pass
    returns; ``hidden_states[num_layers]`` in transformers' tuple) and is the only choice
    for ``arch="adaptspec"``.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    target_vocab_size: int
    draft_vocab_size: int  # len(V); == target_vocab_size when not reduced
    rope_scaling: dict | None = None
    kind: str = "head"
    format_version: int = FORMAT_VERSION
    target: dict = field(default_factory=dict)  # what it was trained for (name, layers, sha of embed)
    training: dict = field(default_factory=dict)  # how (filled by the trainer)
    arch: str = "adaptspec"  # adaptspec | eagle3
    feature_layers: list[int] = field(default_factory=list)  # see the class docstring
    target_hidden_size: int | None = None  # eagle3: width of one target feature (None: hidden_size)
    # eagle3 options, named and defined as in the speculators format
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    fc_norm: bool = False  # one RMSNorm per feature before fc
    norm_before_residual: bool = False  # layer 0's residual is hidden_norm(h) instead of h
    norm_output: bool = False  # feed the normed output back (else the pre-norm one)
    own_lm_head: bool = False  # the file carries lm_head.weight [N, H] (else the target's rows V)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch: must be one of {ARCHS}, got {self.arch!r}")
        self.feature_layers = [int(i) for i in self.feature_layers]
        if self.arch == "adaptspec":
            if self.feature_layers:
                raise ValueError("feature_layers: the adaptspec head reads the final normed hidden state "
                                 "only (use arch='eagle3' for fused layers)")
            if self.norm_before_fc or self.fc_norm or self.norm_before_residual or self.norm_output:
                raise ValueError("norm_before_fc / fc_norm / norm_before_residual / norm_output: eagle3 options")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(i < 0 for i in self.feature_layers):
            raise ValueError(f"feature_layers: distinct indices >= 0, got {self.feature_layers}")

    @property
    def num_features(self) -> int:
        return max(1, len(self.feature_layers))

    @property
    def feature_size(self) -> int:
        """Width of the feature the head takes per position."""
        if self.arch == "adaptspec":
            return self.hidden_size
        return self.num_features * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def for_target(cls, tcfg: LlamaConfig, num_layers: int = 1, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None, *, arch: str = "adaptspec",
                   feature_layers: list[int] | None = None, **eagle3) -> "HeadConfig":
        if num_layers < 1:
            raise ValueError(f"layers: a head needs at least 1 decoder layer, got {num_layers}")
        n = draft_vocab_size or tcfg.vocab_size
        if not 1 <= n <= tcfg.vocab_size:
            raise ValueError(f"vocab_top: must be in 1..{tcfg.vocab_size}, got {n}")
        layers = list(feature_layers or [])
        if any(i > tcfg.num_layers for i in layers):
            raise ValueError(f"feature_layers: the target has hidden states 0..{tcfg.num_layers}, got {layers}")
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=intermediate_size or tcfg.intermediate_size,
                   num_layers=num_layers, num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads,
                   head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                   max_position=tcfg.max_position, target_vocab_size=tcfg.vocab_size,
                   draft_vocab_size=n, rope_scaling=tcfg.rope_scaling, arch=arch, feature_layers=layers, **eagle3)

    def llama_config(self) -> LlamaConfig:
        """The decoder part as a LlamaConfig (its vocabulary is the draft vocabulary)."""
        return LlamaConfig(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position=self.max_position, tie_word_embeddings=False,
                           rope_scaling=self.rope_scaling)


def default_feature_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high choice (vLLM's default aux layers): 2, L // 2, L - 3."""
    L = num_target_layers
    return sorted({min(2, L - 1), L // 2, max(L - 3, 0)})


def is_head_folder(path: Path) -> bool:
    p = path / HEAD_FILE
    if not p.is_file():
        return False
    return json.loads(p.read_text()).get("kind") == "head"


def read_head_config(folder: Path) -> HeadConfig:
    raw = json.loads((folder / HEAD_FILE).read_text())
    if raw.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(f"{folder / HEAD_FILE}: format_version {raw.get('format_version')} is not one of "
                         f"{READABLE_VERSIONS}")
    known = set(HeadConfig.__dataclass_fields__)
    return HeadConfig(**{k: v for k, v in raw.items() if k in known})


# ---- training module ------------------------------------------------------------------
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
        x = torch.cat([F.rms_norm(feats, (feats.shape[-1],), self.feature_norm, eps),
                       F.rms_norm(e, (e.shape[-1],), self.token_norm, eps)], -1)
        return self.fc(x)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """eagle3: the target features [.., nF * H_t] -> the hidden state [.., H] (``fc``)."""
        eps = self.cfg.rms_norm_eps
        if self.input_norm is not None:
            feats = F.rms_norm(feats, (feats.shape[-1],), self.input_norm, eps)
        if self.fc_norm is not None:
            parts = feats.chunk(len(self.fc_norm), -1)
            feats = torch.cat([F.rms_norm(x, (x.shape[-1],), w, eps) for x, w in zip(parts, self.fc_norm)], -1)
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
            g = F.rms_norm(h, (H,), self.norm, c.rms_norm_eps)
            outs.append(g)
            fb = h if eagle3 and not c.norm_output else g
        return outs

    def _layer(self, Lr: _Layer, h, cos, sin, kv_passes: list, s: int, e: torch.Tensor | None) -> torch.Tensor:
        c = self.cfg
        B, n, H = h.shape
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        eps = c.rms_norm_eps
        if e is not None:  # eagle3's first layer: [token; hidden] in, the hidden part is the residual
            hn = F.rms_norm(h, (H,), Lr.hidden_norm, eps)
            x = torch.cat([F.rms_norm(e.to(h.dtype), (H,), Lr.input_layernorm, eps), hn], -1)
            if c.norm_before_residual:
                h = hn
        else:
            x = F.rms_norm(h, (H,), Lr.input_layernorm, eps)
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
        x = F.rms_norm(h, (H,), Lr.post_attention_layernorm, eps)
        return h + Lr.down_proj(F.silu(Lr.gate_proj(x)) * Lr.up_proj(x))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] of head features."""
        return g @ self.out_weight.to(g.dtype).t()


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


def load_head_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


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


# ---- inference form -------------------------------------------------------------------
class HeadModel:
    """A trained head on the engine's paged-KV forward (both architectures). Shares the
    target's embedding (unless the file carries its own) and output layer rows ``vocab_ids``
    (unless ``own_lm_head``); its KV pool uses the target's block ids.

    ``forward(x, batch, from_target)`` feeds entries: ``x`` is the target's features
    (``from_target``) or the head's own output fed back for an invented position; it returns
    the draft-vocabulary logits of ``batch.logits_indices`` and the output to feed back
    (adaptspec: the normed g; eagle3: the pre-norm h, or g with ``norm_output``).
    ``logits_of(out)`` gives the logits of such an output."""

    def __init__(self, cfg: HeadConfig, state: dict[str, torch.Tensor], target: LlamaModel):
        tc = target.cfg
        if cfg.target_vocab_size != tc.vocab_size or (cfg.target_hidden_size or cfg.hidden_size) != tc.hidden_size:
            raise ValueError(f"draft: this head was built for a target with vocabulary {cfg.target_vocab_size} "
                             f"and hidden size {cfg.target_hidden_size or cfg.hidden_size}; the target has "
                             f"{tc.vocab_size} / {tc.hidden_size}")
        if cfg.arch == "eagle3" and any(i > tc.num_layers for i in cfg.feature_layers):
            raise ValueError(f"draft: feature_layers {cfg.feature_layers} go past the target's {tc.num_layers} layers")
        self.cfg = cfg
        dt, dev = target.dtype, target.device
        self.dtype, self.device = dt, dev
        self.vocab_ids = state["vocab_ids"].to(torch.long).to(dev)
        self.reduced = cfg.draft_vocab_size < cfg.target_vocab_size
        self._vocab_list: list[int] | None = None  # vocab_ids on the host, made on first use
        if cfg.own_lm_head:
            out_v = state["lm_head.weight"]
        else:  # the target's output rows for V
            out_v = target.output_rows().index_select(0, self.vocab_ids)
        w = {k: v for k, v in state.items() if k.startswith("model.")}
        self.embed = state["embed_tokens.weight"].to(dev, dt) if "embed_tokens.weight" in state else target.embed
        w["model.embed_tokens.weight"] = self.embed  # only for LlamaModel's bookkeeping
        w["lm_head.weight"] = out_v
        self.decoder = LlamaModel(cfg.llama_config(), w, dt, dev, target.matmul)
        ct = self.compute_dtype = self.decoder.compute_dtype  # fp32 for bf16 weights on the CPU kernel
        # the input layer, laid out like the decoder's weights (on the CPU kernel: packed)
        self.fc = self.decoder.lay_weight(state["fc.weight"].to(dev, dt))
        if cfg.arch == "eagle3":
            self.hidden_norm = state["model.layers.0.hidden_norm.weight"].to(dev, ct)
            self.input_norm = state["input_norm.weight"].to(dev, ct) if cfg.norm_before_fc else None
            self.fc_norms = ([state[f"fc_norm.{i}.weight"].to(dev, ct) for i in range(cfg.num_features)]
                             if cfg.fc_norm else None)
        else:
            self.feature_norm = state["feature_norm.weight"].to(dev, ct)
            self.token_norm = state["token_norm.weight"].to(dev, ct)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.decoder.kv_bytes_per_block(block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.decoder.allocate_kv(num_blocks, block_size)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, batch, from_target: bool = True):
        """``x`` [num_tokens, F] target features (``from_target``) or [num_tokens, H] the
        head's own fed-back outputs, with ``batch.input_ids`` the next tokens -> (draft-vocab
        logits [num_logits, len(V)] or None, the output to feed back [num_tokens, H])."""
        eps, H = self.cfg.rms_norm_eps, self.cfg.hidden_size
        x = x.to(self.compute_dtype)
        if self.cfg.arch == "eagle3":
            return self._eagle3(self._fuse(x) if from_target else x, batch)
        e = F.embedding(batch.input_ids, self.embed).to(self.compute_dtype)
        u = self.decoder._mm(torch.cat([F.rms_norm(x, (H,), self.feature_norm, eps),
                                        F.rms_norm(e, (H,), self.token_norm, eps)], -1), self.fc)
        return self.decoder.forward(batch, inputs_embeds=u)

    def logits_of(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [R, len(V)] of fed-back outputs ``out`` [R, H]."""
        dec = self.decoder
        g = out
        if self.cfg.arch == "eagle3" and not self.cfg.norm_output:
            g = F.rms_norm(out, (self.cfg.hidden_size,), dec.norm, self.cfg.rms_norm_eps)
        return dec._mm(g.contiguous(), dec.lm_head)

    def _fuse(self, feats: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        if self.input_norm is not None:
            feats = F.rms_norm(feats, (feats.shape[-1],), self.input_norm, eps)
        if self.fc_norms is not None:
            parts = feats.chunk(len(self.fc_norms), -1)
            feats = torch.cat([F.rms_norm(p, (p.shape[-1],), w, eps) for p, w in zip(parts, self.fc_norms)], -1)
        return self.decoder._mm(feats.contiguous(), self.fc)

    def _eagle3(self, h: torch.Tensor, batch):
        """EAGLE-3's layers: layer 0 takes [token; hidden] (2H wide q/k/v input) with the
        hidden state as its residual, the others are Llama layers (``DraftHead._layer``)."""
        c, dec = self.cfg, self.decoder
        H, I, eps = c.hidden_size, c.intermediate_size, c.rms_norm_eps
        e = F.embedding(batch.input_ids, self.embed).to(self.compute_dtype)
        meta = dec.attn.prepare(batch)
        for li, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(dec.layers):
            if li == 0:
                hn = F.rms_norm(h, (H,), self.hidden_norm, eps)
                x = torch.cat([F.rms_norm(e, (H,), ln1, eps), hn], -1)
                if c.norm_before_residual:
                    h = hn
            else:
                x = F.rms_norm(h, (H,), ln1, eps)
            a = dec.attn.attend(dec._mm(x.contiguous(), qkv_w, qkv_b), dec.k_cache[li], dec.v_cache[li], batch, meta)
            h = h + dec._mm(a, o_w)
            gu = dec._mm(F.rms_norm(h, (H,), ln2, eps).contiguous(), gate_up_w)
            h = h + dec._mm((F.silu(gu[:, :I]) * gu[:, I:]).contiguous(), down_w)
        g = F.rms_norm(h, (H,), dec.norm, eps)
        logits = (dec._mm(g.index_select(0, batch.logits_indices).contiguous(), dec.lm_head)
                  if batch.logits_indices.numel() else None)
        return logits, (g if c.norm_output else h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[draft_ids] if self.reduced else draft_ids

    def vocab_list_ids(self, draft_ids: list[int]) -> list[int]:
        """``to_target_ids`` for a list of draft-vocabulary indices (host side, no tensors)."""
        if not self.reduced:
            return list(draft_ids)
        if self._vocab_list is None:
            self._vocab_list = self.vocab_ids.tolist()
        return [self._vocab_list[i] for i in draft_ids]

    def full_probs(self, probs_v: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary probabilities into the target's vocabulary (0 outside V)."""
        if not self.reduced:
            return probs_v
        out = torch.zeros(probs_v.shape[0], self.cfg.target_vocab_size, dtype=probs_v.dtype, device=probs_v.device)
        return out.index_copy_(1, self.vocab_ids, probs_v)
