"""Load a resolved model folder into our Llama forward plus its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adaptspec.models.llama import LlamaConfig, LlamaModel
from adaptspec.models.registry import resolve

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype, device="cpu") -> torch.dtype:
    """A dtype name; ``"auto"``: bfloat16 on CUDA (what GPUs serve in), float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def parse_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be cpu or cuda")
    return dev


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    model: LlamaModel
    tokenizer: object  # a transformers tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def load_model(spec: str, dtype="float32", device="cpu", matmul: str | None = None,
               quiet: bool = False) -> LoadedModel:
    """Resolve ``spec`` (alias, folder, .gguf, hub id) and load it for inference."""
    from transformers import AutoConfig, AutoTokenizer

    dt, dev = parse_dtype(dtype, device), parse_device(device)
    folder = resolve(spec, quiet=quiet)
    cfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(folder))
    # On the CPU: our small-M kernel on packed weights (bf16 and fp32; see cpu_gemm) or the
    # transposed "fast" layout for the BLAS; on CUDA cuBLAS handles F.linear well.
    if matmul is None:
        from adaptspec.models import cpu_gemm

        matmul = cpu_gemm.default_matmul(dt, dev)
    model = LlamaModel(cfg, load_weights(folder), dt, dev, matmul)
    tok = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(name=str(spec), path=folder, model=model, tokenizer=tok)


@dataclass(slots=True)
class LoadedHead:
    """A feature-level draft head bound to its target (``adaptspec.models.head``)."""

    name: str
    path: Path
    model: object  # HeadModel
    tokenizer: object  # the target's

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.target_vocab_size


def load_draft(spec: str, target: LoadedModel, dtype="float32", device="cpu",
               quiet: bool = False) -> LoadedModel | LoadedHead:
    """A draft for ``target``: an independent model (any spec ``load_model`` takes) or a
    draft head folder (``draft.json`` with kind "head"), which shares the target's
    embedding and output layer, or an EAGLE-3 head in the ``speculators`` format (the
    format vLLM serves: ``config.json`` with ``speculators_model_type``)."""
    from adaptspec.models.head import HeadModel, is_head_folder, load_head_state, read_head_config
    from adaptspec.models.speculators import is_speculators_folder, load_speculators

    if Path(spec).is_dir() and is_speculators_folder(Path(spec)):
        cfg, state = load_speculators(Path(spec), target.model.cfg.num_layers)
        return LoadedHead(name=str(spec), path=Path(spec), model=HeadModel(cfg, state, target.model),
                          tokenizer=target.tokenizer)
    folder = resolve(spec, quiet=quiet)
    if is_head_folder(folder):
        head = HeadModel(read_head_config(folder), load_head_state(folder), target.model)
        return LoadedHead(name=str(spec), path=folder, model=head, tokenizer=target.tokenizer)
    return load_model(spec, dtype=dtype, device=device, quiet=quiet)
