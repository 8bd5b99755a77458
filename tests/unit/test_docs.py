"""The docs stay true to the code: every `adaptspec ...` command in README.md and docs/*.md
parses (its subcommand's --help succeeds and knows every --option used), every
`python -m <module>` names a module that exists, every relative link resolves (to a file,
and to a heading where it names one), the generated references equal what their generator
writes now, and the scenario examples validate."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "docs" / "results" / "README.md", ROOT / "deploy" / "README.md"]
GENERATED = {"scenario": "docs/scenario-schema.md", "service": "docs/service-config.md"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _shell_lines(text: str) -> list[str]:
    """Logical lines of the shell blocks (continuations joined) and inline code spans."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang in SHELL_LANGS:
            out += [ln.strip().removeprefix("$ ") for ln in body.replace("\\\n", " ").splitlines()]
    prose = FENCE.sub("", text)
    out += [m for m in re.findall(r"`([^`\n]+)`", prose) if m.startswith(("adaptspec ", "python "))]
    return out


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in prose: take words as they are
        return line.split()


def _commands(tokens: list[str], head: str) -> list[list[str]]:
    """Each command that starts with ``head`` (or a path ending in /head): at a line's start or
    after a separator, past any env assignments or ``nice -n N`` / ``time``; up to a separator."""
    out, cur, at_start = [], None, True
    for t in tokens:
        if t in SEPARATORS:
            cur, at_start = None, True
        elif cur is not None:
            cur.append(t.strip("[]"))
        elif at_start and (t == head or t.endswith("/" + head)):
            cur = []
            out.append(cur)
        elif at_start and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", t) or t in ("nice", "-n", "time")
                           or t.lstrip("-").isdigit()):
            continue
        else:
            at_start = False
    return out


def _doc_commands(kind: str) -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for line in _shell_lines(path.read_text()):
            for args in _commands(_tokens(line), kind):
                found.append((_rel(path), args))
    return found


from adaptspec.cli import app as APP  # noqa: E402  (the one typer app)

ROOT_CMD = typer.main.get_command(APP)


def _resolve(args: list[str]) -> tuple[list[str], object, list[str]]:
    """(the subcommand path, its click command, the arguments after it)."""
    cmd, path, rest = ROOT_CMD, [], list(args)
    while hasattr(cmd, "list_commands") and rest and not rest[0].startswith("-"):  # a group (typer's own click)
        name = rest.pop(0)
        sub = cmd.get_command(cmd.context_class(cmd), name)
        if sub is None:
            raise LookupError(f"unknown command: adaptspec {' '.join(path + [name])}")
        cmd, path = sub, path + [name]
    return path, cmd, rest


def _placeholder(args: list[str]) -> bool:
    return not args or not re.fullmatch(r"[a-z][a-z0-9-]*", args[0])


def test_adaptspec_commands_in_docs_parse():
    runner = CliRunner()
    problems, helped = [], {}
    commands = [(f, a) for f, a in _doc_commands("adaptspec") if not _placeholder(a)]
    assert len(commands) > 20, "the README and docs show the CLI"
    for where, args in commands:
        try:
            path, cmd, rest = _resolve(args)
        except LookupError as exc:
            problems.append(f"{where}: {exc}")
            continue
        key = " ".join(path)
        if key not in helped:
            res = runner.invoke(APP, [*path, "--help"], env={"COLUMNS": "200"})
            helped[key] = (res.exit_code, res.output)
        code, help_text = helped[key]
        if code != 0:
            problems.append(f"{where}: adaptspec {key} --help exits {code}")
            continue
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for tok in rest:
            opt = tok.split("=", 1)[0]
            if opt.startswith("--") and len(opt) > 2 and opt not in known:
                problems.append(f"{where}: adaptspec {key}: unknown option {opt}")
            elif opt.startswith("--") and len(opt) > 2 and opt not in help_text:
                problems.append(f"{where}: adaptspec {key}: {opt} missing from --help")
    assert not problems, "\n".join(problems)


def test_python_modules_in_docs_exist():
    problems = []
    for where, args in _doc_commands("python"):
        if len(args) >= 2 and args[0] == "-m":
            if importlib.util.find_spec(args[1]) is None:
                problems.append(f"{where}: python -m {args[1]}: no such module")
        elif args and args[0].endswith(".py") and not (ROOT / args[0]).is_file():
            problems.append(f"{where}: python {args[0]}: no such file")
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M):
        s = _slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_relative_links_resolve():
    problems = []
    for path in LINKED:
        text = FENCE.sub("", path.read_text())
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{_rel(path)}: {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
                problems.append(f"{_rel(path)}: {target}: no heading #{frag} in {_rel(dest)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", sorted(GENERATED))
def test_generated_references_are_current(kind):
    from adaptspec.tools.schema_doc import render

    committed = (ROOT / GENERATED[kind]).read_text()
    assert committed == render(kind), (f"{GENERATED[kind]} is stale: run "
                                       f"`python -m adaptspec.tools.schema_doc {kind} > {GENERATED[kind]}`")


def test_scenario_examples_in_docs_validate():
    from adaptspec.sim.scenario import parse_scenario

    blocks = [(p, b) for p in DOCS for lang, b in FENCE.findall(p.read_text()) if lang == "yaml"
              and re.search(r"^policies:", b, re.M)]
    assert blocks, "the simulator guide shows a scenario"
    for path, body in blocks:
        parse_scenario(yaml.safe_load(body), source=_rel(path))


def test_the_checks_can_fail(tmp_path):
    """Negative controls: an unknown option, an unknown command, a broken link and a
    missing heading are caught by the helpers the tests above use."""
    _, cmd, rest = _resolve(["bench", "--no-such-option"])
    assert "--no-such-option" not in {o for p in cmd.params for o in p.opts}
    with pytest.raises(LookupError):
        _resolve(["no-such-command"])
    assert _commands(_tokens("make run && adaptspec serve --config x.yaml # a comment"), "adaptspec") == \
        [["serve", "--config", "x.yaml"]]
    assert _commands(_tokens("kubectl -n adaptspec get pods; nice -n 19 .venv/bin/adaptspec stats"), "adaptspec") == \
        [["stats"]]
    doc = tmp_path / "a.md"
    doc.write_text("# Title here\n\n## Second (`x`)\n")
    assert _anchors(doc) == {"title-here", "second-x"}
    assert "missing" not in _anchors(doc)
