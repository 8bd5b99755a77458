"""A compact Llama-family forward over a paged KV cache.

Covers Llama, SmolLM, Mistral (full attention) and Qwen2-style models (q/k/v bias):
RMSNorm, rotary embeddings (default and llama3 scaling), grouped-query attention,
SwiGLU, tied or untied output layer. Weights come from a transformers model
(``LlamaModel.from_hf``); nothing here downloads anything.

``forward`` takes one ``FlatBatch``: every sequence's new tokens one after another (prefill
chunks, decode tokens, verification rows alike), never padded; norms, projections and MLP
run on exactly those rows, and attention (``adaptspec.models.attention``) reads each
sequence's keys through its block table. The KV cache is paged: per layer ``[num_blocks,
num_kv_heads, block_size, head_dim]``; which blocks a sequence owns and how many positions
hold committed tokens live with the engine, so rolling back after a rejection is only a
length (and freeing tail blocks).

On the CPU in fp32 compute the norms, rotary embedding, cache write, attention and SwiGLU
run in C (``cpu_gemm``, ``csrc/layer_ops.c``); where every weight is on the matmul kernel and
the step has few rows, the whole layer loop is one C call (``cpu_gemm.CLayers``, bitwise
the same results as the per-layer loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptspec.models import cpu_gemm
from adaptspec.models.attention import CpuAttention, TorchAttention, TritonAttention
from adaptspec.models.batch import FlatBatch

@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary embedding

    @classmethod
    def from_hf(cls, cfg) -> "LlamaConfig":
        mtype = getattr(cfg, "model_type", "llama")
        if mtype not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(
                f"model_type={cfg.model_type!r} is not a Llama-family model "
                "(supported: llama, mistral, qwen2, qwen3)"
            )
        window = getattr(cfg, "sliding_window", None)
        if window and mtype in ("mistral", "qwen2", "qwen3") and getattr(cfg, "use_sliding_window", True) \
                and window < cfg.max_position_embeddings:
            raise ValueError(f"sliding_window={window}: sliding-window attention is not supported "
                             "(full attention only)")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only silu / SwiGLU)")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") not in ("default", None) else None
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        qwen_bias = getattr(cfg, "model_type", "") == "qwen2"
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", False) or qwen_bias),
            rope_scaling=dict(scaling) if scaling else None,
            qk_norm=mtype == "qwen3",
        )


def _inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type") == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    elif sc and sc.get("rope_type") == "linear":
        inv = inv / sc["factor"]
    elif sc:
        raise ValueError(f"rope_scaling type {sc.get('rope_type')!r} is not supported")
    return inv.float()


class LlamaModel:
    """Weights and the batched forward. Not an nn.Module: inference only, no autograd."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], dtype, device,
                 matmul: str = "fast"):
        if matmul not in ("packed", "fast", "reference"):
            raise ValueError(f"matmul={matmul!r} must be 'packed', 'fast' or 'reference'")
        if matmul == "packed" and torch.device(device).type != "cpu":
            raise ValueError("matmul='packed' is the CPU kernel; use 'reference' on other devices")
        self.cfg = cfg
        # "fast": weights stored transposed ([in, out], contiguous), `x @ w_t`; on this CPU's
        # BLAS that stays flat from 1 to ~8 rows where F.linear doubles past 3 rows
        # (measured: 190 us vs 330 us at 5 rows for a 576x3072 layer), at the price of
        # ordinary fp32 rounding (about 5e-5 per matmul instead of 1.5e-5).
        # "reference": F.linear on [out, in] weights, exactly as transformers computes.
        # "packed": the CPU small-M kernel (adaptspec.models.cpu_gemm) on weights packed in
        # column blocks; it streams each weight once for up to 8 rows, so verifying k + 1
        # tokens costs about what decoding one does (long prefills still go to torch).
        self.matmul = matmul
        self.fast = matmul != "reference"  # weights [in, out]: x @ w
        self.dtype = dtype  # of the weights
        # bf16 weights on the CPU kernel compute in fp32: the kernel accumulates in fp32 anyway,
        # and torch's bf16 elementwise ops, norms and attention on the CPU cost more than fp32
        # ones (each converts). Measured on SmolLM2-135M, one sequence over 200 cached tokens: a
        # 1 / 5 / 9-token forward 39.1 / 41.3 / 51.6 ms with bf16 activations, 32.1 / 35.3 /
        # 40.4 ms with fp32 ones. The KV cache, norms, hidden states and logits are then fp32;
        # only the matmuls' inputs are rounded to bf16 where the weights are packed in pairs
        # (CPUs with AVX512_BF16, cpu_gemm.bf16_pairs(); elsewhere the kernel widens the
        # weights and multiplies fp32 inputs: weight-only bf16).
        self.compute_dtype = torch.float32 if matmul == "packed" and dtype == torch.bfloat16 else dtype
        ct = self.compute_dtype
        self.device = torch.device(device)
        # Loading: every tensor is converted and laid out (concatenated, transposed) where the
        # checkpoint put it (the host), and only final tensors are moved, one at a time
        # (``_place``), so the device never holds a wider dtype, a concatenation's sources or
        # a second copy: it peaks at the weights' own bytes. The sources are dropped as used.
        w = {k: v.to(dtype) for k, v in weights.items()}
        put, take = self._place, w.pop
        self.embed = put(take("model.embed_tokens.weight"))  # [vocab, hidden]
        self.norm = put(take("model.norm.weight").to(ct))
        if matmul == "packed":
            cpu_gemm.enabled()  # build/load once, before the first forward
        lay = self.lay_weight

        def laid(x: torch.Tensor):  # an [out, in] weight laid out for _mm, on the device
            y = lay(x)
            return y if matmul == "packed" else put(y)

        # tied: the output layer is the embedding already on the device (laid out there)
        self.lm_head = lay(self.embed) if cfg.tie_word_embeddings else laid(take("lm_head.weight"))
        self.layers = []  # fast: [hidden, vocab]; reference: [vocab, hidden]; packed: PackedWeight
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                             take(p + "self_attn.v_proj.weight")], 0)
            qkv_b = None
            if cfg.attention_bias:
                qkv_b = put(torch.cat([take(p + "self_attn.q_proj.bias"), take(p + "self_attn.k_proj.bias"),
                                       take(p + "self_attn.v_proj.bias")], 0).to(ct))
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            self.layers.append((put(take(p + "input_layernorm.weight").to(ct)), laid(qkv), qkv_b,
                                laid(take(p + "self_attn.o_proj.weight")),
                                put(take(p + "post_attention_layernorm.weight").to(ct)), laid(gate_up),
                                laid(take(p + "mlp.down_proj.weight"))))
            del qkv, gate_up
        self.qk_norms = ([(put(take(f"model.layers.{i}.self_attn.q_norm.weight").to(ct)),
                           put(take(f"model.layers.{i}.self_attn.k_norm.weight").to(ct)))
                          for i in range(cfg.num_layers)] if cfg.qk_norm else None)
        del w
        if matmul == "packed":  # one buffer on transparent huge pages (cpu_gemm.into_huge_pages)
            cpu_gemm.into_huge_pages([x for x in (*(x for lay_ in self.layers for x in lay_), self.lm_head)
                                      if isinstance(x, cpu_gemm.PackedWeight)])
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, _inv_freq(cfg))  # [max_position, head_dim / 2]
        emb = torch.cat([freqs, freqs], -1)
        self.cos = put(emb.cos().to(ct))  # [max_position, head_dim]
        self.sin = put(emb.sin().to(ct))
        # norms, rotary embedding, attention and SwiGLU in C (csrc/layer_ops.c) on the CPU in fp32
        self.fused = (self.device.type == "cpu" and self.fast and ct == torch.float32
                      and cpu_gemm.mode() != "0" and cpu_gemm.enabled())
        # the fused path's layers in one C call where every weight is on the kernel
        self.c_layers = (cpu_gemm.CLayers(self.layers, self.norm)
                         if self.fused and not cfg.qk_norm and cpu_gemm.CLayers.applies(self.layers) else None)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.cos, self.sin)
        self._cpu_attn = CpuAttention(*heads) if self.fused else None
        self._torch_attn = TorchAttention(*heads)
        # on CUDA the Triton kernel (only torch + triton needed); the torch reference elsewhere
        # (the kernel's tl.dot needs a power-of-two head_dim of at least 16; smaller test shapes
        # get the torch reference)
        D = cfg.head_dim
        self._cuda_attn = (TritonAttention(*heads) if self.device.type == "cuda" and _triton_ok()
                           and D >= 16 and not D & (D - 1) else None)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.num_blocks = 0
        self.block_size = 0

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        """A final tensor onto the model's device (the one way weights get there while
        loading; nothing on the CPU)."""
        return t.to(self.device)

    def lay_weight(self, w: torch.Tensor):
        """An [out, in] weight (in the model's dtype and device) laid out for ``_mm``: packed
        for the CPU kernel, [in, out] contiguous for "fast", as it is for "reference". Packed
        fp32 also keeps the weight as torch has it, for prefills (the BLAS's GEMM) and, with
        ADAPTSPEC_CPU_ONE_ROW=blas, one-row products (cpu_gemm's docstring): twice the weight
        memory."""
        if self.matmul == "packed":
            return cpu_gemm.pack(w.t(), blas_copy=self.dtype == torch.float32)
        return w.t().contiguous() if self.fast else w

    @classmethod
    def from_hf(cls, hf_model, dtype=torch.float32, device="cpu", matmul: str = "fast") -> "LlamaModel":
        cfg = LlamaConfig.from_hf(hf_model.config)
        return cls(cfg, dict(hf_model.state_dict()), dtype, device, matmul)

    @property
    def attn(self):
        """The attention backend: the C kernel with the fused CPU path, torch otherwise."""
        if self.fused:
            return self._cpu_attn
        return self._cuda_attn or self._torch_attn

    # ---- KV cache --------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.cfg
        return 2 * c.num_layers * c.num_kv_heads * block_size * c.head_dim * self.compute_dtype.itemsize

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """The paged cache: per layer ``[num_blocks, Hkv, block_size, D]`` keys and values.
        Block ids come from the engine's ``BlockPool`` (the same ids for every model)."""
        c = self.cfg
        if self.fused and block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 for the CPU kernels, got {block_size}")
        shape = (num_blocks, c.num_kv_heads, block_size, c.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in range(c.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in range(c.num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        if self.c_layers is not None:
            self.c_layers.set_caches(self.k_cache, self.v_cache)

    # ---- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: FlatBatch, inputs_embeds: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's new tokens (all sequences, flattened) over their cached prefixes,
        writing their keys and values into the paged cache.

        Returns ``(logits, hidden)``: logits ``[num_logits, vocab]`` for
        ``batch.logits_indices`` and the final normed hidden states ``[num_tokens, hidden]``
        of every row, which a feature-level draft head consumes at no extra cost; with
        ``feature_layers`` (indices as transformers' ``output_hidden_states``: 0 = the
        embeddings, i = the residual stream entering layer i, num_layers = the final normed
        state), ``hidden`` is those states concatenated, ``[num_tokens, len * hidden]``. A
        draft head passes its own ``inputs_embeds`` ``[num_tokens, hidden]``.
        """
        c = self.cfg
        if batch.max_ctx > c.max_position:
            raise ValueError(f"context of {batch.max_ctx} tokens exceeds the model's {c.max_position} positions")
        src = F.embedding(batch.input_ids, self.embed) if inputs_embeds is None else inputs_embeds  # [N, hidden]
        # the residual stream, updated in place: a contiguous copy, never the caller's tensor
        h = src.to(self.compute_dtype, memory_format=torch.contiguous_format, copy=True)
        N = h.shape[0]
        if self.fused and self.c_layers is not None and not feature_layers and self.c_layers.takes(N):
            hb = batch.host
            hidden = self.c_layers.run(h, c.rms_norm_eps, torch.from_numpy(hb["cu"]), torch.from_numpy(hb["bt"]),
                                       torch.from_numpy(hb["ctx"]), self.cos, self.sin, c.num_heads, batch.max_ctx)
        else:
            hidden = self._layers(h, batch, feature_layers)
        rows = hidden if not feature_layers else hidden[:, -c.hidden_size:] if feature_layers[-1] == c.num_layers \
            else None
        logits = None
        if batch.logits_indices.numel():
            if rows is None:
                raise ValueError("feature_layers must end with num_layers when logits are wanted")
            logits = self._mm(rows.index_select(0, batch.logits_indices), self.lm_head)
        return logits, hidden

    def _layers(self, h: torch.Tensor, batch: FlatBatch, feature_layers: tuple[int, ...]) -> torch.Tensor:
        """The decoder layers one by one (prefill-sized steps, torch backends, feature taps)."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        meta = self.attn.prepare(batch)
        taps: dict[int, torch.Tensor] = {}
        delta, x = None, None
        for li, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            x = self._add_norm(h, delta, ln1, eps, x)
            if li in feature_layers:  # the residual stream entering layer li (delta added above)
                taps[li] = h.clone()
            qkv = self._mm(x, qkv_w, qkv_b)
            if self.qk_norms is not None:
                qkv = self._qk_norm(qkv, *self.qk_norms[li])
            a = self.attn.attend(qkv, self.k_cache[li], self.v_cache[li], batch, meta)
            x = self._add_norm(h, self._mm(a, o_w), ln2, eps, x)
            gu = self._mm(x, gate_up_w)
            if self.fused:
                delta = self._mm(cpu_gemm.silu_mul(gu), down_w)
            else:
                delta = self._mm(F.silu(gu[:, :c.intermediate_size]) * gu[:, c.intermediate_size:], down_w)
        out = self._add_norm(h, delta, self.norm, eps, None)
        if not feature_layers:
            return out
        taps[c.num_layers] = out
        return torch.cat([taps[i] for i in feature_layers], 1)

    def _qk_norm(self, qkv: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of q and k (v untouched), before the rotary embedding."""
        c = self.cfg
        N, D = qkv.shape[0], c.head_dim
        nq, nk = c.num_heads * D, c.num_kv_heads * D
        q = F.rms_norm(qkv[:, :nq].reshape(N, c.num_heads, D), (D,), qn, c.rms_norm_eps).reshape(N, nq)
        k = F.rms_norm(qkv[:, nq:nq + nk].reshape(N, c.num_kv_heads, D), (D,), kn, c.rms_norm_eps).reshape(N, nk)
        return torch.cat([q, k, qkv[:, nq + nk:]], 1).contiguous()

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                  out: torch.Tensor | None) -> torch.Tensor:
        """``h += delta`` in place, then RMSNorm(h) * w."""
        if self.fused:
            return cpu_gemm.add_rms_norm(h, delta, w, eps, out=out)
        if delta is not None:
            h += delta
        return F.rms_norm(h, (self.cfg.hidden_size,), w, eps)

    def _mm(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fast:
            return F.linear(x, w, b)
        if self.matmul == "packed":
            y = cpu_gemm.matmul(x, w)
        else:
            y = x @ w
        return y if b is None else y + b

    def output_rows(self) -> torch.Tensor:
        """The output layer as [vocab, hidden] (a view or, for packed weights, a copy)."""
        if self.matmul == "packed":
            return self.lm_head.unpacked().t()
        return self.lm_head.t() if self.fast else self.lm_head


def _triton_ok() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
