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
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
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
