"""Shared fixtures: tiny random Llama models (vocabulary of tens) and the real SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def make_tiny_model(folder: Path, *, vocab: int = 16, seed: int = 0, layers: int = 2, hidden: int = 32,
                    init: float = 0.3, model_type: str = "llama", tie: bool = False) -> Path:
    """Save a tiny random Llama-family model plus a word-level tokenizer ("t0".."tN")."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if model_type == "qwen3":
        cfg = Qwen3Config(**common, head_dim=hidden // 4, use_sliding_window=False)
    else:
        cfg = Qwen2Config(**common) if model_type == "qwen2" else LlamaConfig(**common)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def first_fresh_word(text: str, start: int = 1) -> int:
    """Index (from ``start``) of the first space-separated word of ``text`` whose first
    occurrence in the text, as a substring, is at its own position: a stop string that
    matches there and nowhere earlier."""
    words = text.split(" ")
    return next(i for i in range(start, len(words)) if text.find(words[i]) == len(" ".join(words[:i])) + 1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder (pulled once into $ADAPTSPEC_HOME by `make test`)."""
    from adaptspec.models.registry import alias_dir, is_complete, resolve

    if not is_complete(alias_dir("smollm2-135m")) and os.environ.get("CI"):
        pytest.fail("SmolLM2 is not in the cache: `make test` pulls it first (adaptspec models pull smollm2-135m)")
    try:
        return resolve("smollm2-135m", quiet=True)
    except RuntimeError as exc:  # the pull failed (no network, a plain pytest run): say why; code bugs still fail
        pytest.skip(f"SmolLM2 not available ({exc}); run `adaptspec models pull smollm2-135m`")


@pytest.fixture(scope="session")
def smollm_engine(smollm_dir):
    from adaptspec import Engine

    from adaptspec.models.registry import resolve

    resolve("smollm2-135m-first4", quiet=True)
    return Engine.from_pretrained(str(smollm_dir), draft="smollm2-135m-first4", dtype="float32",
                                  max_num_seqs=8, max_model_len=1024)


class SlotAdapter:
    """Drive a ``LlamaModel``'s paged forward the way a test thinks of it: ``slots`` of up to
    ``max_len`` positions, padded ``[B, T]`` inputs. Each slot gets its own blocks, shuffled
    so that no sequence's blocks are contiguous (the paging is exercised, not bypassed)."""

    BLOCK = 16

    def __init__(self, model, num_slots: int, max_len: int, seed: int = 0):
        import random

        self.model = model
        n = -(-max_len // self.BLOCK)
        ids = list(range(num_slots * n))
        random.Random(seed).shuffle(ids)
        self.tables = [ids[s * n:(s + 1) * n] for s in range(num_slots)]
        self.max_len = max_len
        model.allocate_kv(num_slots * n, self.BLOCK)

    def __getattr__(self, name):  # cfg, k_cache, ...: the model's
        return getattr(self.model, name)

    def forward(self, input_ids, slots, cache_lens, num_tokens, logits_rows=None, inputs_embeds=None):
        """Old-style call: logits ``[N, vocab]`` for the flat indices ``b * T + t`` in
        ``logits_rows`` (None: every real token, in order) and hidden ``[B, T, H]`` (zeros past
        each row's tokens)."""
        import torch

        from adaptspec.models.batch import FlatBatch

        B, T = input_ids.shape
        if max(l + n for l, n in zip(cache_lens, num_tokens)) > self.max_len:
            raise ValueError("context exceeds the KV cache length")
        rows = [input_ids[b, :num_tokens[b]].tolist() for b in range(B)]
        flat_of = {}
        at = 0
        for b in range(B):
            for t in range(num_tokens[b]):
                flat_of[b * T + t] = at
                at += 1
        want = list(flat_of.values()) if logits_rows is None else [flat_of[int(i)] for i in logits_rows]
        batch = FlatBatch.build(rows, list(cache_lens), [self.tables[s] for s in slots], want, self.BLOCK,
                                self.model.device)
        emb = None
        if inputs_embeds is not None:
            emb = torch.cat([inputs_embeds[b, :num_tokens[b]] for b in range(B)])
        logits, hidden = self.model.forward(batch, inputs_embeds=emb)
        out = torch.zeros(B * T, hidden.shape[1], dtype=hidden.dtype)
        out[torch.tensor(list(flat_of.keys()), dtype=torch.long)] = hidden
        return logits, out.view(B, T, -1)
