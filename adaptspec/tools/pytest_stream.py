"""A pytest plugin (``-p adaptspec.tools.pytest_stream``) that appends each test's start,
results and finish to the JSON-lines file named by ``$ADAPTSPEC_PYTEST_STREAM`` as they
happen. A CUDA abort kills pytest before it writes its junit file or prints its failures;
from this file the GPU check still knows what finished, why each failure failed, and which
test the process died in (started, never finished), and can run the rest without it."""
from __future__ import annotations

import json
import os

ENV = "ADAPTSPEC_PYTEST_STREAM"


def _write(rec: dict) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:  # closed at once: the line is the kernel's before any crash
            f.write(json.dumps(rec) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return  # a passing setup / teardown says nothing
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    else:
        message = report.longreprtext if report.failed else ""
    _write({"event": "report", "test": report.nodeid, "when": report.when, "outcome": report.outcome,
            "message": message[-2000:]})


def pytest_runtest_logfinish(nodeid, location):
    _write({"event": "finish", "test": nodeid})


def read_stream(path) -> dict:
    """Counts, failures and skip reasons from a stream file, and the tests that started but
    never finished (``crashed``: the process died in them). A test that failed in any phase
    counts once, as failed (in its call) or as an error (in setup / teardown)."""
    started: list[str] = []
    finished: set[str] = set()
    outcome: dict[str, tuple[str, str]] = {}  # test -> (kind, message)
    try:
        lines = open(path).read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the crash
        test = rec.get("test", "")
        if rec.get("event") == "start":
            started.append(test)
        elif rec.get("event") == "finish":
            finished.add(test)
        elif rec.get("event") == "report":
            if rec["outcome"] == "failed":
                kind = "failed" if rec["when"] == "call" else "errors"
                if outcome.get(test, ("",))[0] not in ("failed", "errors"):
                    outcome[test] = (kind, rec.get("message", ""))
            elif rec["outcome"] == "skipped":
                outcome.setdefault(test, ("skipped", rec.get("message", "")))
            elif rec["when"] == "call":
                outcome.setdefault(test, ("passed", ""))
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {},
           "finished": sorted(finished), "crashed": [t for t in dict.fromkeys(started) if t not in finished]}
    for test in dict.fromkeys(started):
        if test not in finished:
            continue
        kind, message = outcome.get(test, ("passed", ""))
        out[kind] += 1
        if kind in ("failed", "errors"):
            out["failures"].append({"test": test, "kind": kind, "message": message[-1500:]})
        elif kind == "skipped":
            reason = message[:300]
            out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
    return out
