"""Draft heads at inference: the head file format and ``HeadModel`` on the engine's forward.

A feature-level draft head (EAGLE-style; ``arch`` "adaptspec" or "eagle3") drafts from the
target's own features; how heads are trained, and the math of both architectures, is in
``adaptspec.distill.head`` (``DraftHead``, the training module and reference forward).
This module holds what serving needs: ``HeadConfig`` and the reader of a head folder
(``draft.json`` + ``model.safetensors``), and ``HeadModel``, the head on the paged KV cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from adaptspec.models.llama import LlamaConfig, LlamaModel

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
def load_head_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


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
        return self.step(self.input_of(x, from_target), batch)

    @torch.inference_mode()
    def input_of(self, x: torch.Tensor, from_target: bool) -> torch.Tensor:
        """What ``step`` takes, [num_tokens, H] in the compute dtype: eagle3 fuses the
        target's features into one H-wide vector (fc); fed-back outputs and the adaptspec
        head's features go in as they are. Split off so that ``step`` has one input width
        whatever the rows are (one CUDA graph serves both kinds of pass)."""
        x = x.to(self.compute_dtype)
        return self._fuse(x) if from_target and self.cfg.arch == "eagle3" else x

    @torch.inference_mode()
    def step(self, x: torch.Tensor, batch):  # x [num_tokens, H] from input_of
        """The head's layers over the paged cache: ``forward`` after its input layer."""
        if self.cfg.arch == "eagle3":
            return self._eagle3(x, batch)
        eps, H = self.cfg.rms_norm_eps, self.cfg.hidden_size
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
