"""Random-weight models built in memory: no download, no file, no tokenizer folder.

For checks that need a model's shapes but not its knowledge: the GPU check's speed table on
a model with Llama-3.1-8B's shapes (``adaptspec.tools.gpu_check``), logic tests on tiny
shapes. Weights are drawn directly on the target device in the target dtype, so an 8B-shaped
model costs one pass of random fills there and never 16 GB of host memory or disk.
"""
from __future__ import annotations

from pathlib import Path

import torch

from adaptspec.models.llama import LlamaConfig, LlamaModel
from adaptspec.models.loader import LoadedModel, parse_device, parse_dtype

# Llama-3.1-8B's shapes (rope scaling left out: it changes no cost; positions capped so the
# rotary tables stay small)
LLAMA31_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position=8192, tie_word_embeddings=False)
# a shape that runs in milliseconds on the CPU (the check's own logic, tests)
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=1024,
                   tie_word_embeddings=False)


class IdTokenizer:
    """What the engine asks of a tokenizer, for a model without one: token ids are text
    ("t12 t7"), no end-of-sequence token (generation runs to max_new_tokens)."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        try:
            return {"input_ids": [int(w[1:]) for w in text.split()]}
        except ValueError:
            raise ValueError("prompt: this model has no tokenizer; give token ids (or 't12 t7' text)") from None

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab_size)}


def random_weights(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, *, seed: int = 0,
                   init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """A state dict under transformers' Llama names: normal(0, init_std) matrices, norms near 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, D = cfg.hidden_size, cfg.head_dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype).mul_(init_std)

    def norm(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen, device=device, dtype=dtype).mul_(0.05).add_(1.0)

    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, H), "model.norm.weight": norm(H)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = mat(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = mat(cfg.num_heads * D, H)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.num_kv_heads * D, H)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.num_kv_heads * D, H)
        w[p + "self_attn.o_proj.weight"] = mat(H, cfg.num_heads * D)
        w[p + "mlp.gate_proj.weight"] = mat(cfg.intermediate_size, H)
        w[p + "mlp.up_proj.weight"] = mat(cfg.intermediate_size, H)
        w[p + "mlp.down_proj.weight"] = mat(H, cfg.intermediate_size)
        if cfg.attention_bias:
            for name, n in (("q", cfg.num_heads * D), ("k", cfg.num_kv_heads * D), ("v", cfg.num_kv_heads * D)):
                w[p + f"self_attn.{name}_proj.bias"] = torch.randn(n, generator=gen, device=device,
                                                                   dtype=dtype).mul_(init_std)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
    return w


def random_model(cfg: LlamaConfig, dtype="bf16", device="cpu", *, seed: int = 0, init_std: float = 0.02,
                 matmul: str | None = None, name: str = "random") -> LoadedModel:
    """A ``LoadedModel`` with random weights of ``cfg``'s shapes and an ``IdTokenizer``."""
    dev = parse_device(device)
    dt = parse_dtype(dtype, dev)
    if matmul is None:
        from adaptspec.models import cpu_gemm

        matmul = cpu_gemm.default_matmul(dt, dev)
    weights = random_weights(cfg, dt, dev, seed=seed, init_std=init_std)
    model = LlamaModel(cfg, weights, dt, dev, matmul)
    del weights  # the model holds its own (concatenated / laid-out) tensors now
    return LoadedModel(name=name, path=Path(f"<{name}>"), model=model, tokenizer=IdTokenizer(cfg.vocab_size))


def weight_bytes(model: LlamaModel) -> dict[str, int]:
    """Bytes of the weights: ``total`` (as stored), ``per_decode_step`` (what one decode
    step must read: every layer's matrices and norms, the final norm and the output layer;
    the embedding only gives one row per token unless it is also the output layer)."""
    seen: set[int] = set()

    def nbytes(t) -> int:
        if not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
            return 0
        seen.add(t.data_ptr())
        return t.numel() * t.element_size()

    layers = sum(nbytes(x) for lay in model.layers for x in lay)
    if model.qk_norms:
        layers += sum(nbytes(x) for pair in model.qk_norms for x in pair)
    head = nbytes(model.lm_head) + nbytes(model.norm)
    embed = nbytes(model.embed)  # 0 when tied (already counted as the output layer)
    return {"total": layers + head + embed, "per_decode_step": layers + head}
