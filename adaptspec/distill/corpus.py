"""An offline, licence-clean prompt corpus for on-policy distillation.

Three request classes, the ones `adaptspec bench` measures:

* ``chat``: the hand-written prompts in ``prompts.json`` plus questions about the Python
  standard library built from its module and function docstrings;
* ``code_edit``: edit requests over functions taken from the standard library's own source
  (the Python Software Foundation licence), plus the hand-written snippets;
* ``extraction``: summary / key-point / extraction requests over passages of the Python
  reference documentation shipped with the interpreter (``pydoc_data.topics``) and long
  docstrings, plus the hand-written ones.

Nothing is downloaded. Every prompt that shares an 8-word run with a benchmark prompt is
dropped, so the benchmark stays held out. The split into train and held-out prompts is
deterministic for a seed.
"""
from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from adaptspec import bench_prompts

CLASSES = ("chat", "code_edit", "extraction")

_CODE_EDITS = (
    "Rename the parameter `{arg}` to `{arg}_value` everywhere in this function. Return the whole updated function.",
    "Add type hints to this function's parameters and return value. Return the full function.",
    "Add a concise docstring to this function and return the complete code.",
    "Add a short comment above each non-trivial line of this function. Return the whole function.",
    "Rewrite this function so that it uses clearer local variable names, without changing behaviour. "
    "Show the full code.",
    "Reformat this function to follow PEP 8 and return it unchanged otherwise.",
    "Rename the function `{name}` to `{name}_v2` and return the full code.",
    "Add a guard at the top of this function that raises ValueError for invalid input, then return the "
    "full function.",
)
_PROSE = (
    "Summarize the following passage in three sentences:\n\n{text}",
    "List the key points of this text as short bullet points:\n\n{text}",
    "Extract every technical term that this passage defines and give a one-line definition of each:\n\n{text}",
    "Write a TL;DR of this documentation excerpt:\n\n{text}",
    "Read the text below and answer: what is its main rule or idea?\n\n{text}",
    "Extract the names of all functions, keywords or statements mentioned in this text as a JSON list:\n\n{text}",
)
_DOC_CHAT = (
    "What does `{qual}` in Python's `{mod}` module do? Explain briefly.",
    "When would I use `{qual}` from the `{mod}` module? Give an example.",
    "Explain in plain words what the Python module `{mod}` is for.",
)


@dataclass(slots=True)
class Corpus:
    train: dict[str, list[str]]
    held_out: dict[str, list[str]]

    def sizes(self) -> dict[str, tuple[int, int]]:
        return {c: (len(self.train[c]), len(self.held_out[c])) for c in CLASSES}


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i:i + n]) for i in range(max(0, len(w) - n + 1))}


def _bench_shingles() -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for ps in bench_prompts().values():
        for p in ps:
            out |= _shingles(p)
    return out


def _stdlib_files(limit: int, rng: random.Random) -> list[Path]:
    import os

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__", "ensurepip"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # pruned: never walk into site-packages
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files.sort()
    rng.shuffle(files)
    return files[:limit]


def _code_prompts(files: list[Path], rng: random.Random, cap: int) -> tuple[list[str], list[str], list[str]]:
    code, chat, prose = [], [], []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        lines = src.splitlines()  # once per file: ast.get_source_segment re-splits on every call
        mod = f.stem if f.stem != "__init__" else f.parent.name
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 400:
            prose.append(rng.choice(_PROSE).format(text=doc[:1500]))
        if doc:
            chat.append(_DOC_CHAT[2].format(mod=mod))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.decorator_list or node.end_lineno is None:
                continue
            seg = "\n".join(lines[node.lineno - 1:node.end_lineno])
            n_lines = seg.count("\n") + 1
            if 5 <= n_lines <= 30 and len(seg) < 1400 and len(code) < cap:
                args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                tmpl = rng.choice(_CODE_EDITS if args else [t for t in _CODE_EDITS if "{arg}" not in t])
                instr = tmpl.format(arg=args[0] if args else "", name=node.name)
                code.append(f"{instr}\n\n```python\n{textwrap.dedent(seg)}\n```")
            fdoc = ast.get_docstring(node)
            if fdoc and not node.name.startswith("_") and len(fdoc) > 60:
                chat.append(rng.choice(_DOC_CHAT[:2]).format(qual=node.name, mod=mod))
                if len(fdoc) > 500:
                    prose.append(rng.choice(_PROSE).format(text=fdoc[:1500]))
    return code, chat, prose


def _topic_prompts(rng: random.Random) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    out = []
    for name in sorted(topics):
        paras = [p.strip() for p in re.split(r"\n\s*\n", topics[name]) if len(p.strip()) > 200]
        for i in range(0, len(paras), 2):
            text = "\n\n".join(paras[i:i + 2])[:1500]
            out.append(rng.choice(_PROSE).format(text=text))
    return out


def build_corpus(seed: int = 0, held_out_frac: float = 0.06, max_files: int = 700,
                 per_class: int | None = None) -> Corpus:
    """All three classes, benchmark prompts excluded, split into train / held-out."""
    rng = random.Random(seed)
    hand = json.loads(resources.files("adaptspec").joinpath("distill/prompts.json").read_text())
    code, doc_chat, doc_prose = _code_prompts(_stdlib_files(max_files, rng), rng, cap=6000)
    pools = {
        "chat": list(hand.get("chat", [])) + doc_chat,
        "code_edit": list(hand.get("code_edit", [])) + code,
        "extraction": list(hand.get("extraction", [])) + doc_prose + _topic_prompts(rng),
    }
    bench = _bench_shingles()
    train, held = {}, {}
    for c in CLASSES:
        seen, keep = set(), []
        for p in pools[c]:
            if p in seen or (_shingles(p) & bench):
                continue
            seen.add(p)
            keep.append(p)
        rng.shuffle(keep)
        if per_class:
            keep = keep[:per_class]
        n_held = max(1, int(round(len(keep) * held_out_frac)))
        held[c], train[c] = keep[:n_held], keep[n_held:]
    return Corpus(train, held)


def interleave(by_class: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(class, prompt) pairs, round-robin over classes so any prefix is class-balanced."""
    out, i = [], 0
    longest = max((len(v) for v in by_class.values()), default=0)
    while i < longest:
        for c in CLASSES:
            if i < len(by_class.get(c, [])):
                out.append((c, by_class[c][i]))
        i += 1
    return out
