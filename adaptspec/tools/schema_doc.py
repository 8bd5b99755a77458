"""Markdown references of the pydantic models users write, generated so they cannot drift.

    python -m adaptspec.tools.schema_doc scenario > docs/scenario-schema.md
    python -m adaptspec.tools.schema_doc service > docs/service-config.md

One section per model, reached from the root (``Scenario`` or ``ServiceConfig``) in the
order its fields name them; each field with its type (a link where it is another model),
constraints, default and description, all read from the models. ``tests/unit/test_docs.py``
checks the committed files equal this output.
"""
from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOTS = {
    "scenario": ("adaptspec.sim.scenario", "Scenario", "Simulator scenario schema",
                 "A scenario file (`adaptspec simulate <file>.yaml`) is one `Scenario`. Unknown keys are errors, and "
                 "an error names the key. Guide: [simulator.md](simulator.md)."),
    "service": ("adaptspec.serve.config", "ServiceConfig", "Service configuration reference",
                "The service config (`adaptspec serve --config <file>.yaml`, `deploy/adaptspec.yaml`, the `service:` "
                "part of a Kubernetes profile) is one `ServiceConfig`. Unknown keys are errors, and an error names "
                "the key. Guide: [operations.md](operations.md)."),
}
_CONSTRAINTS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("multiple_of", "multiple of"),
                ("min_length", "min length"), ("max_length", "max length"), ("pattern", "matches"))


def _anchor(name: str) -> str:
    return name.lower()


def _constraints(metadata: list) -> list[str]:
    out = []
    for m in metadata:
        for attr, word in _CONSTRAINTS:
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{word} `{v}`")
    return out


def _type(tp: Any, models: list[type[BaseModel]]) -> str:
    """A readable type; every model met is appended to ``models`` (documented later)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        inner, meta = args[0], list(args[1:])
        cons = _constraints([m for m in meta if not isinstance(m, FieldInfo)])
        for m in meta:
            if isinstance(m, FieldInfo):
                cons += _constraints(m.metadata)
        text = _type(inner, models)
        return f"{text} ({', '.join(cons)})" if cons else text
    if origin is Literal:
        return " | ".join(f'`{a!r}`'.replace("'", '"') for a in args)
    if origin in (Union, types.UnionType):
        parts = [a for a in args if a is not type(None)]
        text = " | ".join(_type(a, models) for a in parts)
        return text + (" | null" if len(parts) < len(args) else "")
    if origin in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "[" + ", ".join(_type(a, models) for a in args) + "]"
        return f"list of {_type(args[0], models)}" if args else "list"
    if origin is dict:
        return f"map {_type(args[0], models)} -> {_type(args[1], models)}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp not in models:
            models.append(tp)
        return f"[{tp.__name__}](#{_anchor(tp.__name__)})"
    return f"`{getattr(tp, '__name__', str(tp))}`"


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    if f.default_factory is not None:
        v = f.default_factory()
        if isinstance(v, BaseModel):
            return "defaults"
        return f"`{json.dumps(_plain(v))}`"
    v = f.default
    if v is PydanticUndefined:
        return "required"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    return f"`{v!r}`".replace("'", '"')


def _plain(v: Any) -> Any:
    """A default as YAML/JSON would write it (models by their non-default fields)."""
    if isinstance(v, BaseModel):
        return v.model_dump(mode="json", exclude_defaults=True)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(kind: str) -> str:
    module, root_name, title, intro = ROOTS[kind]
    import importlib

    root = getattr(importlib.import_module(module), root_name)
    models: list[type[BaseModel]] = [root]
    lines = [f"# {title}", "", f"Generated from `{module}` by `python -m adaptspec.tools.schema_doc {kind}`; "
             "do not edit by hand (`tests/unit/test_docs.py` checks it is current).", "", intro, ""]
    i = 0
    while i < len(models):  # breadth first: models are appended as fields reach them
        m = models[i]
        i += 1
        lines += [f"## {m.__name__}", ""]
        doc = (m.__doc__ or "").strip()
        if doc and not doc.startswith(("A base class", "Usage docs")):
            lines += [_cell(doc), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, f in m.model_fields.items():
            ty = _type(f.annotation, models)
            cons = _constraints(f.metadata)
            if cons:
                ty += f" ({', '.join(cons)})"
            lines.append(f"| `{name}` | {_cell(ty)} | {_cell(_default(f))} | {_cell(f.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", nargs="?", default="scenario", choices=sorted(ROOTS))
    args = ap.parse_args(argv)
    sys.stdout.write(render(args.kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
