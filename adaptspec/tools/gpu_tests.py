"""The GPU check's test part: the CUDA test subset in a pytest subprocess, from a source
tree with no install (``adaptspec.tools.gpu_check`` runs it)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ensure_kernels_importable(root: Path = REPO) -> str | None:
    """Make ``import adaptspec_kernels`` work from a source tree (``kernels/`` installs under
    that name; a device run has no install): a temp folder holding a link named so, put on
    ``sys.path``. Returns that folder (for a subprocess's PYTHONPATH), None when installed."""
    if importlib.util.find_spec("adaptspec_kernels") is not None:
        return None
    shim = Path(tempfile.mkdtemp(prefix="adaptspec-kernels-"))
    try:
        (shim / "adaptspec_kernels").symlink_to(root / "kernels", target_is_directory=True)
    except OSError:
        import shutil

        shutil.copytree(root / "kernels", shim / "adaptspec_kernels")
    sys.path.insert(0, str(shim))
    importlib.invalidate_caches()
    return str(shim)


def cuda_test_files(root: Path = REPO) -> list[str]:
    """tests/unit/test_cuda_*.py, every test file using the ``cuda`` marker, and the Triton
    kernel tests (which run compiled where CUDA is)."""
    unit = root / "tests" / "unit"
    marked = [f for f in sorted((root / "tests").rglob("test_*.py")) if "pytest.mark.cuda" in f.read_text()]
    # the engine-level checks first: a run stopped at its timeout has done those
    files = [*sorted(unit.glob("test_cuda_*.py")), *marked, unit / "test_triton_attention.py", unit / "test_kernels.py"]
    return list(dict.fromkeys(str(f.relative_to(root)) for f in files if f.is_file()))


def parse_junit(path: Path) -> dict:
    """Counts and the failures / skips of a pytest junit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag: child for child in case}
            if "failure" in kinds or "error" in kinds:
                tag = "failure" if "failure" in kinds else "error"
                out["failed" if tag == "failure" else "errors"] += 1
                el = kinds[tag]
                out["failures"].append({"test": name, "kind": tag,
                                        "message": (el.get("message") or el.text or "")[:600]})
            elif "skipped" in kinds:
                out["skipped"] += 1
                reason = (kinds["skipped"].get("message") or "")[:300]
                out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
            else:
                out["passed"] += 1
    return out


_VERBOSE_LINE = re.compile(r"^(\S+::\S+(?:\[.*?\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def parse_verbose(text: str) -> dict:
    """Counts from pytest -v lines (``path::test PASSED``): what a run stopped at its timeout
    had finished, where no junit file was written."""
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    seen: dict[str, str] = {}
    for test, outcome in _VERBOSE_LINE.findall(text):
        seen[test] = outcome  # a teardown ERROR after PASSED counts as the error
    for test, outcome in seen.items():
        key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
               "SKIPPED": "skipped", "XFAIL": "skipped"}[outcome]
        out[key] += 1
        if key in ("failed", "errors"):
            out["failures"].append({"test": test, "kind": key, "message": "(see output_tail)"})
    return out


_EXT_LIST = re.compile(r"^Extension modules:.*$", re.M)


def crash_trace(stderr: str) -> str:
    """The part of a crashed pytest's stderr that says where it died: from faulthandler's
    'Fatal Python error' on, without its list of loaded extension modules."""
    i = stderr.rfind("Fatal Python error")
    text = stderr[i:] if i >= 0 else stderr[-3000:]
    return _EXT_LIST.sub("Extension modules: (left out)", text)[:3000]


def _attempt(files, timeout_s, *, cwd, env, xml, deselect, per_test_timeout_s):
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-p",
           "adaptspec.tools.pytest_stream", f"--junitxml={xml}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={per_test_timeout_s:.0f}")
    for test in deselect:
        cmd += ["--deselect", test]
    cmd += files
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return r.returncode, r.stdout, r.stderr, False
    except subprocess.TimeoutExpired as e:
        out, err = ("".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")) for x in
                    (e.stdout, e.stderr))
        return None, out, err, True


def run_pytest(files: list[str], timeout_s: float, *, cwd: Path = REPO, extra_path: str | None = None,
               per_test_timeout_s: float = 120.0, log_path: Path | None = None, max_crashes: int = 4) -> dict:
    """The files in a pytest subprocess (so a crash or a hang stays there), with a timeout.
    Each test's start and result stream to a file as they happen (``pytest_stream``), so a
    run that dies in a test (a CUDA abort) keeps what finished, names the test it died in,
    and runs again without that test and what had finished (``max_crashes`` times at most).
    Counts come from the stream; the junit file or the verbose lines where it is empty.
    ``log_path``: where the whole output of every attempt goes (the result keeps its tail)."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not importable on this machine"}
    if not files:
        return {"status": "skipped", "reason": "no test files found"}
    from adaptspec.tools.pytest_stream import ENV, read_stream

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        xml, stream = Path(tmp) / "junit.xml", Path(tmp) / "stream.jsonl"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (extra_path, str(cwd), str(REPO), env.get("PYTHONPATH")) if x)
        env[ENV] = str(stream)
        crashes: list[dict] = []
        text, rc, timed_out, deselect, attempts = "", None, False, [], 0
        while True:
            attempts += 1
            left = timeout_s - (time.monotonic() - t0)
            rc, stdout, stderr, timed_out = _attempt(files, max(1.0, left), cwd=cwd, env=env, xml=xml,
                                                     deselect=deselect, per_test_timeout_s=per_test_timeout_s)
            text += stdout + stderr
            if log_path is not None:
                with contextlib.suppress(OSError), open(log_path, "a") as f:
                    f.write(f"===== pytest attempt {attempts} (rc {rc}, deselected {len(deselect)})\n")
                    f.write(stdout + "\n----- stderr\n" + stderr + "\n")
            seen = read_stream(stream)
            if timed_out or xml.is_file() or not seen["crashed"] or rc is None or rc >= 0:
                break
            crashes.append({"test": seen["crashed"][0], "returncode": rc, "trace": crash_trace(stderr)})
            if len(crashes) >= max_crashes or timeout_s - (time.monotonic() - t0) < 5:
                break
            deselect = [*seen["finished"], *(c["test"] for c in crashes)]
        out = {"files": files, "returncode": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1),
               "output_tail": _EXT_LIST.sub("Extension modules: (left out)", text)[-3000:],
               "attempts": attempts}
        if seen["finished"] or seen["crashed"]:
            counts = {k: seen[k] for k in ("passed", "failed", "errors", "skipped", "failures", "skip_reasons")}
            out.update(counts, counted_from="stream")
        elif xml.is_file():
            out.update(parse_junit(xml), counted_from="junit")
        else:
            out.update(parse_verbose(text), counted_from="verbose output (no junit file: the run did not finish)")
        for c in crashes:
            out["errors"] += 1
            out["failures"].append({"test": c["test"], "kind": "crash",
                                    "message": f"the process died in it (returncode {c['returncode']}): {c['trace']}"})
        out["crashes"] = crashes
        out["unfinished"] = seen["crashed"]  # stopped at the timeout (or a last crash) inside these
        # ok: the last attempt ran to its end (crashes before it are counted as errors above)
        done = xml.is_file()
        out["status"] = "ok" if done else "error"
        if timed_out:
            out["error"] = f"pytest ran past {timeout_s:.0f} s and was stopped"
        elif not done:
            out["error"] = f"pytest exited {rc} without a junit file" + (
                f" after {len(crashes)} crash(es)" if crashes else "")
        return out


def tests_section(opts, left_s: float, shim: str | None, log_path: Path | None = None) -> dict:
    """The CUDA subset; ``log_path``: the whole pytest output (beside the JSON)."""
    if opts.device != "cuda":
        return {"status": "skipped", "reason": "CUDA-only: the CUDA test subset runs on a CUDA device"}
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "torch sees no CUDA device"}
    timeout = max(10.0, min(opts.test_timeout_s, left_s))
    return run_pytest(cuda_test_files(), timeout, extra_path=shim, log_path=log_path)


