"""A compact Llama-family forward over a slot KV cache.

Covers Llama, SmolLM, Mistral (full attention) and Qwen2-style models (q/k/v bias):
RMSNorm, rotary embeddings (default and llama3 scaling), grouped-query attention,
SwiGLU, tied or untied output layer. Weights come from a transformers model
(``LlamaModel.from_hf``); nothing here downloads anything.

The KV cache is a preallocated tensor per layer, ``[num_slots, num_kv_heads, max_len,
head_dim]``: one slot per running sequence (padding tokens are never written). The
*length* of each slot lives with the caller; rolling back after a rejection is only setting
that length, nothing is copied.

On the CPU in fp32 compute, decode and verification steps (rows of up to
``FUSED_MAX_TOKENS`` new tokens) take ``_forward_fused``: the same layer with its norms,
rotary embedding, cache write, attention and SwiGLU in C (``cpu_gemm``, ``csrc/layer_ops.c``);
where every weight is on the matmul kernel, the whole layer loop is one C call
(``cpu_gemm.CLayers``, bitwise the same results).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptspec.models import cpu_gemm

# Rows (sequences) of up to this many new tokens take the fused CPU path; longer ones
# (prefills) stay on torch, whose attention is tiled for them.
FUSED_MAX_TOKENS = 32


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

    @classmethod
    def from_hf(cls, cfg) -> "LlamaConfig":
        if getattr(cfg, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"model_type={cfg.model_type!r} is not a Llama-family model "
                "(supported: llama, mistral, qwen2)"
            )
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
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [vocab, hidden]
        self.norm = w["model.norm.weight"].to(ct)
        if matmul == "packed":
            cpu_gemm.enabled()  # build/load once, before the first forward
        lay = self.lay_weight
        head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = lay(head)  # fast: [hidden, vocab]; reference: [vocab, hidden]; packed: PackedWeight
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                             w[p + "self_attn.v_proj.weight"]], 0)
            qkv_b = None
            if cfg.attention_bias:
                qkv_b = torch.cat([w[p + "self_attn.q_proj.bias"], w[p + "self_attn.k_proj.bias"],
                                   w[p + "self_attn.v_proj.bias"]], 0).to(ct)
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0)
            self.layers.append((w[p + "input_layernorm.weight"].to(ct), lay(qkv), qkv_b,
                                lay(w[p + "self_attn.o_proj.weight"]),
                                w[p + "post_attention_layernorm.weight"].to(ct), lay(gate_up),
                                lay(w[p + "mlp.down_proj.weight"])))
        if matmul == "packed":  # one buffer on transparent huge pages (cpu_gemm.into_huge_pages)
            cpu_gemm.into_huge_pages([x for x in (*(x for lay_ in self.layers for x in lay_), self.lm_head)
                                      if isinstance(x, cpu_gemm.PackedWeight)])
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, _inv_freq(cfg))  # [max_position, head_dim / 2]
        emb = torch.cat([freqs, freqs], -1)
        self.cos = emb.cos().to(self.device, ct)  # [max_position, head_dim]
        self.sin = emb.sin().to(self.device, ct)
        # decoding and verification (rows of up to FUSED_MAX_TOKENS tokens) run their norms,
        # rotary embedding, attention and SwiGLU in C (csrc/layer_ops.c) on the CPU in fp32
        self.fused = (self.device.type == "cpu" and self.fast and ct == torch.float32
                      and cpu_gemm.mode() != "0" and cpu_gemm.enabled())
        # the fused path's layers in one C call where every weight is on the kernel
        self.c_layers = (cpu_gemm.CLayers(self.layers, self.norm)
                         if self.fused and cpu_gemm.CLayers.applies(self.layers) else None)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.num_slots = 0
        self.max_len = 0

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

    # ---- KV cache --------------------------------------------------------------------
    def allocate_cache(self, num_slots: int, max_len: int) -> None:
        """Preallocate ``num_slots`` sequences of up to ``max_len`` tokens."""
        c = self.cfg
        shape = (num_slots, c.num_kv_heads, max_len, c.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in range(c.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in range(c.num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        if self.c_layers is not None:
            self.c_layers.set_caches(self.k_cache, self.v_cache)

    # ---- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] (padding anywhere past num_tokens[b])
        slots: list[int],  # [B] KV slot of each row
        cache_lens: list[int],  # [B] tokens already in each slot
        num_tokens: list[int],  # [B] real (non-padding) tokens of each row, >= 1
        logits_rows: torch.Tensor | None = None,  # [N] flat indices b*T+t wanting logits; None: all
        inputs_embeds: torch.Tensor | None = None,  # [B, T, hidden] instead of embedding input_ids
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the new tokens of each row over its cached prefix and extend the cache.

        Returns ``(logits, hidden)``: logits ``[N, vocab]`` for the requested rows and the
        final (normed) hidden states ``[B, T, hidden]`` of every position (zeros past a row's
        tokens), which a feature-level draft head can consume at no extra cost. A draft head
        passes its own ``inputs_embeds`` (``input_ids`` then only gives the shape).

        Rows of different lengths (prompts of different sizes, requests verifying different
        k) are not padded through the layers: the norms, projections and MLP run on the real
        tokens only, packed one after another, and only attention sees the [B, T] layout.
        A batch mixing k = 0 and k = 4 rows costs the tokens it has, not B x 5, which is what
        the controller's cost model (verify time by the step's total tokens) assumes.
        """
        c, dev = self.cfg, self.device
        B, T = input_ids.shape
        ctx = max(l + n for l, n in zip(cache_lens, num_tokens))
        if ctx > self.max_len:
            raise ValueError(f"context of {ctx} tokens exceeds the KV cache length {self.max_len}")
        if self.fused and max(num_tokens) <= FUSED_MAX_TOKENS:
            return self._forward_fused(input_ids, slots, cache_lens, num_tokens, ctx, logits_rows, inputs_embeds)
        lens = torch.tensor(cache_lens, device=dev)  # [B]
        ntok = torch.tensor(num_tokens, device=dev)  # [B]
        t = torch.arange(T, device=dev)
        positions = lens[:, None] + t[None, :]  # [B, T]
        real = t[None, :] < ntok[:, None]  # [B, T]
        padded = any(n != T for n in num_tokens)
        # the real tokens, packed: flat index b * T + t of each, and its slot and position
        flat_idx = real.reshape(-1).nonzero().squeeze(1) if padded else None
        pick = (lambda x: x.reshape(B * T, *x.shape[2:]).index_select(0, flat_idx)) if padded else (  # noqa: E731
            lambda x: x.reshape(B * T, *x.shape[2:]))
        slot_p = pick(torch.tensor(slots, device=dev)[:, None].expand(B, T))  # [N]
        pos_p = pick(positions)  # [N]
        N = pos_p.shape[0]
        contiguous = all(s == slots[0] + i for i, s in enumerate(slots))
        key_pos = torch.arange(ctx, device=dev)
        if T == 1 and len(set(cache_lens)) == 1:
            mask = None  # one new token per row, all rows the same length: nothing to hide
        else:  # [B, 1, T, ctx]: key j visible to the query at absolute position p iff j <= p
            mask = (key_pos[None, None, :] <= positions[:, :, None]) & real[:, :, None]
            mask = mask | ~real[:, :, None]  # padding queries see everything (outputs ignored)
            mask = mask[:, None]
        cos, sin = self.cos[pos_p][:, None], self.sin[pos_p][:, None]  # [N, 1, D]

        h = pick(F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds)  # [N, hidden]
        h = h.to(self.compute_dtype)
        nq, nkv, hd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        q_pad = torch.zeros(B * T, c.num_heads, hd, dtype=h.dtype, device=dev) if padded else None
        for li, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            x = F.rms_norm(h, (c.hidden_size,), ln1, c.rms_norm_eps)
            qkv = self._mm(x, qkv_w, qkv_b)
            q = qkv[:, :nq].view(N, c.num_heads, hd)  # [N, H, D]
            k = qkv[:, nq:nq + nkv].view(N, c.num_kv_heads, hd)
            v = qkv[:, nq + nkv:].view(N, c.num_kv_heads, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[slot_p, :, pos_p] = k  # [N, Hkv, D] into [slots, Hkv, L, D]
            vc[slot_p, :, pos_p] = v
            if contiguous:
                keys, values = kc[slots[0]:slots[0] + B, :, :ctx], vc[slots[0]:slots[0] + B, :, :ctx]
            else:
                idx = torch.tensor(slots, device=dev)
                keys, values = kc[idx, :, :ctx], vc[idx, :, :ctx]
            if padded:  # attention alone sees [B, T]; padding queries are zeros, their outputs dropped
                q = q_pad.index_copy_(0, flat_idx, q)
            a = F.scaled_dot_product_attention(q.view(B, T, c.num_heads, hd).transpose(1, 2), keys, values,
                                               attn_mask=mask, enable_gqa=c.num_kv_heads != c.num_heads)
            h = h + self._mm(pick(a.transpose(1, 2)).reshape(N, nq), o_w)
            x = F.rms_norm(h, (c.hidden_size,), ln2, c.rms_norm_eps)
            gu = self._mm(x, gate_up_w)
            h = h + self._mm(F.silu(gu[:, :c.intermediate_size]) * gu[:, c.intermediate_size:], down_w)
        hidden_p = F.rms_norm(h, (c.hidden_size,), self.norm, c.rms_norm_eps)  # [N, hidden]
        return self._output(hidden_p, B, T, flat_idx if padded else None, logits_rows)

    def _output(self, hidden_p, B: int, T: int, flat_idx, logits_rows):
        """Logits of the wanted rows and the hidden states back in the [B, T] layout."""
        if flat_idx is not None:
            hidden = torch.zeros(B * T, hidden_p.shape[1], dtype=hidden_p.dtype, device=self.device)
            hidden.index_copy_(0, flat_idx, hidden_p)
        else:
            hidden = hidden_p
        flat = hidden if logits_rows is None else hidden.index_select(0, logits_rows)
        return self._mm(flat, self.lm_head), hidden.view(B, T, hidden_p.shape[1])

    def _forward_fused(self, input_ids, slots, cache_lens, num_tokens, ctx, logits_rows, inputs_embeds):
        """``forward`` for rows of a few tokens (decoding, verification) on the CPU in fp32:
        the same computation, with everything but the matmuls in three C calls per layer
        (``cpu_gemm.attention`` / ``add_rms_norm`` / ``silu_mul``) instead of ~45 torch
        operations; only the real tokens, packed, are computed. With ``c_layers`` (every
        weight on the kernel, and the step's rows within its reach) the loop itself runs in C."""
        c = self.cfg
        B, T = input_ids.shape
        padded = any(n != T for n in num_tokens)
        src = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds  # [B, T, hidden]
        src = src.reshape(B * T, c.hidden_size)
        flat_idx = None
        if padded:
            flat_idx = torch.tensor([b * T + t for b, n in enumerate(num_tokens) for t in range(n)])
            src = src.index_select(0, flat_idx)
        # the residual stream, updated in place by the C calls: a contiguous copy, never the caller's
        h = src.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        starts = [0]
        for n in num_tokens:
            starts.append(starts[-1] + n)
        row_start = torch.tensor(starts, dtype=torch.int32)
        slots_t = torch.tensor(slots, dtype=torch.int32)
        lens_t = torch.tensor(cache_lens, dtype=torch.int32)
        eps, x, delta = c.rms_norm_eps, None, None
        if self.c_layers is not None and self.c_layers.takes(h.shape[0]):  # the loop below, in C
            hidden_p = self.c_layers.run(h, eps, row_start, slots_t, lens_t, self.cos, self.sin, c.num_heads, ctx)
            return self._output(hidden_p, B, T, flat_idx, logits_rows)
        for li, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            x = cpu_gemm.add_rms_norm(h, delta, ln1, eps, out=x)
            a = cpu_gemm.attention(self._mm(x, qkv_w, qkv_b), row_start, slots_t, lens_t, self.cos, self.sin,
                                   self.k_cache[li], self.v_cache[li], c.num_heads, ctx)
            x = cpu_gemm.add_rms_norm(h, self._mm(a, o_w), ln2, eps, out=x)
            delta = self._mm(cpu_gemm.silu_mul(self._mm(x, gate_up_w)), down_w)
        hidden_p = cpu_gemm.add_rms_norm(h, delta, self.norm, eps)
        return self._output(hidden_p, B, T, flat_idx, logits_rows)

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
