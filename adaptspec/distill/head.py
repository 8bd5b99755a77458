"""The feature-level draft head (EAGLE-style) for a Llama-family target.

A head drafts from the target's own final hidden states. Entry ``j`` of its sequence takes
the target's feature ``f_j`` (the normed final hidden state at position ``j``, which
predicts token ``x_{j+1}``) and the embedding of that next token ``x_{j+1}``:

    u_j = W_in [rmsnorm(f_j); rmsnorm(embed(x_{j+1}))]
    g_j = norm(decoder_layers(u_0..u_j))          # the head's own feature for position j+1
    logits_j = g_j @ W_out[V]                      # predicts x_{j+2}

``embed`` and ``W_out`` are the target's, frozen and not stored with the head; ``V`` is an
optional reduced draft vocabulary (the ``N`` most frequent tokens of the target's own
output: FR-Spec), so the draft's output layer costs ``N / vocab`` of the target's. Tokens
outside ``V`` get draft probability 0, which keeps verification exact.

When it drafts the ``s``-th candidate of a step, the head has no target feature for the
positions it invented; it feeds its own ``g`` instead. Training therefore unrolls ``S``
such passes ("training-time test", EAGLE-3): pass ``s`` at position ``j`` takes
``g^{(s-1)}_{j-1}`` as its feature and attends to pass 1's entries up to ``j-s+1`` plus the
entries of passes ``2..s`` on the diagonal, exactly the context it has at drafting time.

This module holds the trainable ``DraftHead`` (torch ``nn.Module``), its file format
(``draft.json`` + ``model.safetensors``) and ``HeadModel``, the inference form that runs
on the engine's slot-KV forward (``LlamaModel`` with ``inputs_embeds``).
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
FORMAT_VERSION = 1


@dataclass(slots=True)
class HeadConfig:
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

    @classmethod
    def for_target(cls, tcfg: LlamaConfig, num_layers: int = 1, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> "HeadConfig":
        if num_layers < 1:
            raise ValueError(f"layers: a head needs at least 1 decoder layer, got {num_layers}")
        n = draft_vocab_size or tcfg.vocab_size
        if not 1 <= n <= tcfg.vocab_size:
            raise ValueError(f"vocab_top: must be in 1..{tcfg.vocab_size}, got {n}")
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=intermediate_size or tcfg.intermediate_size,
                   num_layers=num_layers, num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads,
                   head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                   max_position=tcfg.max_position, target_vocab_size=tcfg.vocab_size,
                   draft_vocab_size=n, rope_scaling=tcfg.rope_scaling)

    def llama_config(self) -> LlamaConfig:
        """The decoder part as a LlamaConfig (its vocabulary is the draft vocabulary)."""
        return LlamaConfig(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position=self.max_position, tie_word_embeddings=False,
                           rope_scaling=self.rope_scaling)


def is_head_folder(path: Path) -> bool:
    p = path / HEAD_FILE
    if not p.is_file():
        return False
    return json.loads(p.read_text()).get("kind") == "head"


def read_head_config(folder: Path) -> HeadConfig:
    raw = json.loads((folder / HEAD_FILE).read_text())
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{folder / HEAD_FILE}: format_version {raw.get('format_version')} is not "
                         f"{FORMAT_VERSION}")
    known = set(HeadConfig.__dataclass_fields__)
    return HeadConfig(**{k: v for k, v in raw.items() if k in known})


# ---- training module ------------------------------------------------------------------
class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        H, nq, nkv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.q_proj = nn.Linear(H, nq, bias=False)
        self.k_proj = nn.Linear(H, nkv, bias=False)
        self.v_proj = nn.Linear(H, nkv, bias=False)
        self.o_proj = nn.Linear(nq, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors under their Hugging Face names (``model.layers.i.`` + name)."""
        return {"input_layernorm.weight": self.input_layernorm,
                "post_attention_layernorm.weight": self.post_attention_layernorm,
                **{f"self_attn.{n}.weight": getattr(self, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{f"mlp.{n}.weight": getattr(self, n).weight for n in ("gate_proj", "up_proj", "down_proj")}}

    @torch.no_grad()
    def copy_from(self, src: dict[str, torch.Tensor], prefix: str) -> None:
        for name, t in self.named_tensors().items():
            t.copy_(src[prefix + name])


class DraftHead(nn.Module):
    """Trainable head. ``embed`` [vocab, H] and ``out_weight`` [N, H] are frozen buffers
    taken from the target; ``vocab_ids`` [N] maps draft-vocabulary rows to target ids."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, out_weight: torch.Tensor,
                 vocab_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        if out_weight.shape != (cfg.draft_vocab_size, H) or vocab_ids.shape != (cfg.draft_vocab_size,):
            raise ValueError("draft vocabulary: out_weight / vocab_ids do not match draft_vocab_size")
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("out_weight", out_weight.detach().clone(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())
        self.feature_norm = nn.Parameter(torch.ones(H))
        self.token_norm = nn.Parameter(torch.ones(H))
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(H))
        inv = _inv_freq(cfg.llama_config())
        self.register_buffer("inv_freq", inv, persistent=False)

    # names in the saved file (HF-like, so LlamaModel loads the decoder part as is)
    def export_state(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "feature_norm.weight": self.feature_norm,
               "token_norm.weight": self.token_norm, "model.norm.weight": self.norm,
               "vocab_ids": self.vocab_ids.to(torch.int32)}
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
        with torch.no_grad():
            self.fc.weight.copy_(state["fc.weight"])
            self.feature_norm.copy_(state["feature_norm.weight"])
            self.token_norm.copy_(state["token_norm.weight"])
            self.norm.copy_(state["model.norm.weight"])
        for i, L in enumerate(self.layers):
            L.copy_from(state, f"model.layers.{i}.")

    def init_from_target_layers(self, weights: dict[str, torch.Tensor], first_layer: int) -> None:
        """Start the decoder layers from the target's layers ``first_layer..`` (a warm start)."""
        for i, L in enumerate(self.layers):
            L.copy_from(weights, f"model.layers.{first_layer + i}.")

    # ---- forward with training-time test --------------------------------------------
    def _rope(self, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(L, device=device, dtype=torch.float32)
        fr = torch.outer(pos, self.inv_freq.to(device))
        emb = torch.cat([fr, fr], -1)
        return emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, L, D]

    def input_proj(self, feats: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        e = F.embedding(next_tokens, self.embed).to(feats.dtype)
        x = torch.cat([F.rms_norm(feats, (feats.shape[-1],), self.feature_norm, eps),
                       F.rms_norm(e, (e.shape[-1],), self.token_norm, eps)], -1)
        return self.fc(x)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, passes: int = 1) -> list[torch.Tensor]:
        """Teacher-forced unroll. ``feats`` [B, L, H]: the target's features f_0..f_{L-1};
        ``tokens`` [B, L]: x_0..x_{L-1}. Returns, per pass, the head features g [B, L-1, H]
        at entries j = 0..L-2 (entry j predicts x_{j+2}); entries j < s-1 of pass s have no
        valid input and must be masked by the caller."""
        c = self.cfg
        B, L, H = feats.shape
        n = L - 1
        nxt = tokens[:, 1:]
        cos, sin = self._rope(n, feats.device)
        cos, sin = cos.to(feats.dtype), sin.to(feats.dtype)
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]  # per layer, per pass
        outs: list[torch.Tensor] = []
        f_in = feats[:, :n]
        for s in range(1, passes + 1):
            if s > 1:  # feature of entry j = previous pass's output at j - 1
                prev = outs[-1]
                f_in = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
            h = self.input_proj(f_in, nxt)
            for li, Lr in enumerate(self.layers):
                h = self._layer(Lr, h, cos, sin, kv[li], s)
            outs.append(F.rms_norm(h, (H,), self.norm, c.rms_norm_eps))
        return outs

    def _layer(self, Lr: _Layer, h, cos, sin, kv_passes: list, s: int) -> torch.Tensor:
        c = self.cfg
        B, n, H = h.shape
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        x = F.rms_norm(h, (H,), Lr.input_layernorm, c.rms_norm_eps)
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
        x = F.rms_norm(h, (H,), Lr.post_attention_layernorm, c.rms_norm_eps)
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


# ---- inference form -------------------------------------------------------------------
class HeadModel:
    """A trained head on the engine's slot-KV forward. Shares the target's embedding and
    output layer (rows ``vocab_ids``); has its own KV slots (same slot ids as the target)."""

    def __init__(self, cfg: HeadConfig, state: dict[str, torch.Tensor], target: LlamaModel):
        tc = target.cfg
        if cfg.target_vocab_size != tc.vocab_size or cfg.hidden_size != tc.hidden_size:
            raise ValueError(f"draft: this head was built for a target with vocabulary {cfg.target_vocab_size} "
                             f"and hidden size {cfg.hidden_size}; the target has {tc.vocab_size} / {tc.hidden_size}")
        self.cfg = cfg
        dt, dev = target.dtype, target.device
        self.dtype, self.device = dt, dev
        self.vocab_ids = state["vocab_ids"].to(torch.long).to(dev)
        self.reduced = cfg.draft_vocab_size < cfg.target_vocab_size
        self._vocab_list: list[int] | None = None  # vocab_ids on the host, made on first use
        # the target's output rows for V
        out = target.output_rows()  # [vocab, hidden]
        out_v = out.index_select(0, self.vocab_ids)
        w = {k: v for k, v in state.items() if k.startswith("model.")}
        w["model.embed_tokens.weight"] = target.embed  # only for LlamaModel's bookkeeping
        w["lm_head.weight"] = out_v
        self.decoder = LlamaModel(cfg.llama_config(), w, dt, dev, target.matmul)
        self.embed = target.embed  # [vocab, hidden], shared
        ct = self.compute_dtype = self.decoder.compute_dtype  # fp32 for bf16 weights on the CPU kernel
        # the input layer, laid out like the decoder's weights (on the CPU kernel: packed; on
        # torch it took 0.2-0.5 ms of a 0.45-1.15 ms bf16 drafting position, packed the
        # positions took 0.30-0.88 ms: SmolLM2's head, batch 1, code edits at k = 4)
        self.fc = self.decoder.lay_weight(state["fc.weight"].to(dev, dt))
        self.feature_norm = state["feature_norm.weight"].to(dev, ct)
        self.token_norm = state["token_norm.weight"].to(dev, ct)

    def allocate_cache(self, num_slots: int, max_len: int) -> None:
        self.decoder.allocate_cache(num_slots, max_len)

    @torch.inference_mode()
    def forward(self, feats: torch.Tensor, next_tokens: torch.Tensor, slots: list[int], cache_lens: list[int],
                num_tokens: list[int], logits_rows: torch.Tensor | None = None):
        """``feats`` [B, T, H], ``next_tokens`` [B, T] -> (draft-vocab logits [N_rows, len(V)], g [B, T, H])."""
        eps, H = self.cfg.rms_norm_eps, self.cfg.hidden_size
        e = F.embedding(next_tokens, self.embed).to(self.compute_dtype)
        x = torch.cat([F.rms_norm(feats.to(self.compute_dtype), (H,), self.feature_norm, eps),
                       F.rms_norm(e, (H,), self.token_norm, eps)], -1)
        u = self.decoder._mm(x, self.fc)
        return self.decoder.forward(next_tokens, slots, cache_lens, num_tokens, logits_rows, inputs_embeds=u)

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
