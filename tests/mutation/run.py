"""Mutation check: plant one known bug at a time in a copy of the repo and confirm the tests
meant to guard against it fail.

Each entry of ``mutations.toml`` names a file, an exact ``old`` snippet (it must occur
exactly once), its ``new`` replacement, a one-line description and the test node ids that
must catch it. For every mutation this script copies the working tree (tracked files and
untracked ones git does not ignore) into a temporary folder, applies the mutation there,
runs the listed tests with ``pytest -x -q`` and records whether they failed. The working
tree is never written to, so other people's edits are safe and nothing mutated is left
behind.

    .venv/bin/python tests/mutation/run.py                 # every mutation
    .venv/bin/python tests/mutation/run.py -k bonus        # names containing "bonus"
    .venv/bin/python tests/mutation/run.py --rev HEAD      # the committed code, not the tree
    .venv/bin/python tests/mutation/run.py --list

Exit status: 0 when every mutation is caught; 1 when one survived, its ``old`` snippet is
not found (the code changed: update the entry), or its tests could not run; 2 when the
listed tests fail on the unmutated copy (nothing can be judged). Not part of ``make test``;
``make mutation-check`` runs it.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_LIST = HERE / "mutations.toml"
# kernel tests skip without triton: a mutation must be caught by the default suite without them
KERNEL_TESTS = re.compile(r"tests/(unit|statistical)/test_kernels")


@dataclass
class Mutation:
    name: str
    file: str
    old: str
    new: str
    description: str
    tests: list[str]
    target: str = ""  # what the snippet depends on (e.g. "engine internals"): for whoever updates it


@dataclass
class Result:
    name: str
    status: str  # caught | SURVIVED | NOT FOUND | ERROR
    detail: str = ""
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)


def load(path: Path) -> list[Mutation]:
    data = tomllib.loads(path.read_text())
    out, seen = [], set()
    for i, m in enumerate(data.get("mutation", [])):
        missing = [k for k in ("name", "file", "old", "new", "description", "tests") if k not in m]
        if missing:
            raise SystemExit(f"{path}: mutation #{i + 1} lacks {', '.join(missing)}")
        if m["name"] in seen:
            raise SystemExit(f"{path}: duplicate mutation name {m['name']!r}")
        seen.add(m["name"])
        if m["old"] == m["new"]:
            raise SystemExit(f"{path}: mutation {m['name']!r}: old and new are the same")
        bad = [t for t in m["tests"] if KERNEL_TESTS.search(t)]
        if bad or not m["tests"]:
            raise SystemExit(f"{path}: mutation {m['name']!r}: list non-kernel tests (kernel tests skip "
                             f"without triton), got {m['tests']}")
        out.append(Mutation(m["name"], m["file"], m["old"], m["new"], m["description"], list(m["tests"]),
                            m.get("target", "")))
    return out


def copy_tree(dest: Path, rev: str | None, source: Path | None = None) -> None:
    """The working tree (or ``rev``, or the folder ``source``) into ``dest``: files git tracks
    or would track."""
    if source is not None:
        shutil.copytree(source, dest, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache"))
        return
    if rev:
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "archive", rev], cwd=REPO, stdout=tar, check=True)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as tf:
                tf.extractall(dest, filter="data")
        return
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if not src.is_file():  # deleted in the tree but still in the index
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)


def pytest_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_the_copy(root: Path, python: str) -> None:
    """The copy's ``adaptspec`` must shadow the editable install, or nothing is tested."""
    r = subprocess.run([python, "-c", "import adaptspec; print(adaptspec.__file__)"], cwd=root,
                       env=pytest_env(root), capture_output=True, text=True)
    where = r.stdout.strip()
    if r.returncode != 0 or not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the copy in {root} does not import its own adaptspec (got {where!r}; {r.stderr[-500:]})")


def run_tests(root: Path, tests: list[str], python: str, timeout: float) -> tuple[int, str, float]:
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=root, env=pytest_env(root), capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out, time.perf_counter() - t0


def failures(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def apply(root: Path, m: Mutation) -> str | None:
    """Apply ``m`` in the copy; the original text, or None when ``old`` is not found exactly once."""
    path = root / m.file
    if not path.is_file():
        return None
    text = path.read_text()
    if text.count(m.old) != 1:
        return None
    path.write_text(text.replace(m.old, m.new))
    return text


def judge(m: Mutation, rc: int, output: str, seconds: float) -> Result:
    failed = failures(output)
    if rc == 0:
        return Result(m.name, "SURVIVED", "every listed test passed", seconds)
    if rc == 1:
        return Result(m.name, "caught", failed[0] if failed else "(a test failed)", seconds, failed)
    if rc == 2:  # interrupted: a collection/import error the mutation caused also fails `make test`
        return Result(m.name, "caught", "collection error: " + (failed[0] if failed else "see output"), seconds, failed)
    if rc == -1:
        return Result(m.name, "ERROR", "timed out (a hang is not a clean catch: look at it)", seconds)
    return Result(m.name, "ERROR", f"pytest exit {rc} (a listed test id does not exist?)", seconds)


def row(r: Result, w: int) -> str:
    return f"{r.name:<{w}}  {r.status:<9}  {r.seconds:5.0f}  {r.detail}"


def table(results: list[Result], w: int) -> str:
    lines = [f"{'mutation':<{w}}  {'result':<9}  {'s':>5}  failing test / why", "-" * (w + 60)]
    return "\n".join(lines + [row(r, w) for r in results])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list-file", type=Path, default=DEFAULT_LIST, help="the mutations (TOML)")
    ap.add_argument("-k", dest="only", default=None, help="only mutations whose name contains this")
    ap.add_argument("--rev", default=None, help="test this git revision instead of the working tree")
    ap.add_argument("--from", dest="source", type=Path, default=None,
                    help="test a copy of this folder (a checkout elsewhere) instead of the working tree")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("--skip-baseline", action="store_true", help="do not run the tests on the unmutated copy first")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output for each mutation")
    args = ap.parse_args(argv)

    muts = load(args.list_file)
    if args.only:
        muts = [m for m in muts if args.only in m.name]
    if not muts:
        print("no mutations selected")
        return 1
    if args.list:
        for m in muts:
            print(f"{m.name}: {m.file}: {m.description}" + (f" [{m.target}]" if m.target else ""))
            for t in m.tests:
                print(f"    {t}")
        return 0
    try:
        os.nice(10)  # a shared machine: the tests of others come first
    except OSError:
        pass

    with tempfile.TemporaryDirectory(prefix="adaptspec-mutation-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        copy_tree(root, args.rev, args.source)
        check_imports_the_copy(root, args.python)
        what = args.source or args.rev or "the working tree"
        print(f"copy of {what} in {root}; {len(muts)} mutations", flush=True)

        all_tests = list(dict.fromkeys(t for m in muts for t in m.tests))
        if not args.skip_baseline:
            rc, out, s = run_tests(root, all_tests, args.python, args.timeout * 2)
            print(f"baseline (no mutation): {len(all_tests)} test ids, exit {rc}, {s:.0f} s", flush=True)
            if rc != 0:
                print(out[-6000:])
                print("the listed tests fail WITHOUT any mutation: fix them (or the code) first")
                return 2

        results = []
        w = max(len(m.name) for m in muts + [Mutation("mutation", "", "", "", "", [])])
        for m in muts:
            original = apply(root, m)
            if original is None:
                results.append(Result(m.name, "NOT FOUND", f"old snippet not found exactly once in {m.file}: "
                                                           "the code changed, update this entry"))
                print(row(results[-1], w), flush=True)
                continue
            try:
                rc, out, s = run_tests(root, m.tests, args.python, args.timeout)
            finally:
                (root / m.file).write_text(original)
            results.append(judge(m, rc, out, s))
            if args.verbose or results[-1].status == "ERROR":
                print(out[-4000:])
            print(row(results[-1], w), flush=True)

    print()
    print(table(results, w))
    bad = [r for r in results if r.status != "caught"]
    print(f"\n{len(results) - len(bad)} of {len(results)} caught"
          + (f"; not caught: {', '.join(r.name + ' (' + r.status + ')' for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
