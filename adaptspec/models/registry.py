"""Model specs: a built-in alias, a local HF folder, a local .gguf file, or a hub id.

``resolve(spec)`` turns any of them into a local folder holding ``config.json``,
``*.safetensors`` and the tokenizer, pulling built-in aliases into the cache root
(``$ADAPTSPEC_HOME``, default ``~/.cache/adaptspec``) on first use.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path


class HubUnreachableError(RuntimeError):
    """A hub id was given but the Hugging Face Hub cannot be reached."""


# the catalogue (aliases, cache folders) lives in ``catalog``, which ``pull`` also reads
from adaptspec.models.catalog import (BUILTIN, DEFAULT_DRAFT, DEFAULT_TARGET, BuiltinModel, alias_dir,  # noqa: F401
                                      home, is_complete, models_dir, packaged_dir)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(spec: str, *, pull_missing: bool = True, quiet: bool = False) -> Path:
    """Return a local model folder for ``spec`` (alias, folder, .gguf file or hub id)."""
    if not spec or not str(spec).strip():
        raise ValueError("model: empty model name")
    spec = str(spec)
    if spec in BUILTIN and BUILTIN[spec].packaged:
        return packaged_dir(spec)
    if spec in BUILTIN:
        folder = alias_dir(spec)
        if not is_complete(folder):
            if not pull_missing:
                raise ValueError(f"model {spec!r} is not pulled yet: run `adaptspec models pull {spec}`")
            from adaptspec.models.pull import pull

            pull(spec, quiet=quiet)
        return folder
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "draft.json").is_file():
            raise ValueError(f"model folder {spec!r} has no config.json (expected a Hugging Face model folder) "
                             "and no draft.json (an adaptspec draft head)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        from adaptspec.models.pull import convert_gguf_file

        return convert_gguf_file(path, quiet=quiet)
    if path.exists():
        raise ValueError(f"model {spec!r} is a file but not a .gguf file")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return _from_hub(spec)
    known = ", ".join(sorted(BUILTIN))
    raise ValueError(f"model {spec!r} is not a built-in alias ({known}), a local folder or a .gguf file")


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(repo_id: str) -> Path:
    msg = (
        f"model {repo_id!r} looks like a Hugging Face Hub id, but the hub is unreachable from this machine; "
        "download it elsewhere and pass its local folder (config.json + *.safetensors + tokenizer), "
        f"a local .gguf file, or a built-in alias ({', '.join(sorted(BUILTIN))})"
    )
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise HubUnreachableError(msg)
    try:
        from huggingface_hub import snapshot_download

        target = models_dir() / "hub" / repo_id.replace("/", "--")
        return Path(snapshot_download(repo_id, local_dir=target,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as exc:  # any hub failure becomes one clear line
        raise HubUnreachableError(f"{msg} ({type(exc).__name__})") from None


def list_cached() -> list[tuple[str, Path, int]]:
    """(name, folder, size in bytes) of every complete model folder in the cache."""
    out = []
    root = models_dir()
    if not root.is_dir():
        return out
    for folder in sorted(p for p in root.rglob("config.json")):
        d = folder.parent
        if is_complete(d):
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            out.append((str(d.relative_to(root)), d, size))
    return out
