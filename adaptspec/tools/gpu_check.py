"""The GPU check (issue #23): the CUDA test subset, then a speed table, in one JSON.

    python -m adaptspec.tools.gpu_check                  # CUDA; `make gpu-check` runs this
    python -m adaptspec.tools.gpu_check --device cpu --tiny   # the check's own logic, seconds
    python -m adaptspec.tools.gpu_check --carry-check    # what a device run needs from the tree

Written for a CUDA machine that has torch and triton (pytest and transformers when present)
and can download nothing: it needs the source tree only (no virtual environment, no
install, no model), creates its model with random weights on the device, and maps
``kernels/`` to its import name ``adaptspec_kernels`` itself when the package is not
installed. Every section runs under a try/except that records the error and moves on,
each has a time estimate and a hard cap, and the whole run a time budget (default 420 s):
a section whose estimate no longer fits is skipped with the reason. The JSON is rewritten
after every section, so a run killed from outside still leaves what it measured.

Sections:

* ``env``: machine, GPU, torch / triton / transformers / pytest versions, git commit
  (``git``, else ``$ADAPTSPEC_GIT_COMMIT``) and a digest of the source it ran.
* ``tests`` (CUDA only): ``tests/unit/test_cuda_*.py`` (greedy equality with transformers
  with speculation on, the Triton verifier through the engine draw for draw, CUDA-graph
  replay equal to eager, for the target and for the drafting passes of a draft model and an
  EAGLE-3 head: the same candidates as the eager draft), ``test_kernels.py`` (the Triton verifier against the torch
  reference draw for draw) and ``test_triton_attention.py``, in a pytest subprocess with a
  timeout; skipped (with the reason) where pytest is not importable.
* ``bandwidth``: a large device-to-device copy; bytes read plus written per second.
* ``model``: a random-weight model with Llama-3.1-8B's shapes in bf16 (``--tiny``: a tiny
  shape in fp32).
* ``decode``: plain decode tokens/s at batch 1/8/32/64 through the engine, eager.
* ``graphs``: the same with CUDA graphs (``EngineConfig.cuda_graphs``), batch 1 first.
* ``verify_cost``: verifying 1..9 tokens at batch 1, relative to one: the model's forward
  alone (eager) and whole engine steps (a fixed drafter proposing k candidates).
* ``spec``: speculative decoding with a self-draft (the target as its own draft: greedy
  accepts nearly every token; its step against k + 1 plain steps) and with n-gram
  lookup on repetitive prompts (a random model need not repeat them: its acceptance is
  recorded, not judged); each eager and with CUDA graphs (``self_draft_graphs``: the
  target's steps and the draft's k passes replay graphs).
* ``long_context``: plain decode over a 4,096-token context at batch 1 and 8 (graphs where
  they run), each step against its floor with the KV cache it reads counted; with the
  attention's context split as the engine chooses and never split.
* ``profile``: where a batch-1 decode step's time goes (``torch.profiler`` over engine steps,
  with graphs and eager): wall per step, the device's busy time (its kernels and copies),
  the host's share, the top kernels and host ops.
* ``summary``: the decode step at batch 1 against the memory-bandwidth floor (bytes one
  decode step reads / the measured copy bandwidth), verify-5 / verify-1, graphs / eager,
  and the goals of issue #23 as met / missed.

Output: ``$OUT/gpu-check-<date>.json`` when ``$OUT`` is set (the device tool brings that
folder back), else ``docs/results/gpu-check-<date>.json``; ``--out`` overrides both.

This module is the runner (budget, sections, summary, table, CLI); the test part lives in
``gpu_tests``, the speed sections in ``gpu_speed``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from adaptspec.tools.gpu_speed import (  # noqa: F401  (re-exported: the check's surface)
    SectionTimeout, bandwidth_section, copy_bandwidth, decode_section, error_record, long_context_section,
    model_section, profile_section, relative, spec_section, verify_cost_section,
)
from adaptspec.tools.gpu_tests import (  # noqa: F401
    cuda_test_files, ensure_kernels_importable, parse_junit, parse_verbose, run_pytest, tests_section,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "adaptspec.gpu_check/1"
GOALS = {  # issue #23's goals, as recorded by this check
    "decode_b1_over_floor_max": 1.3,
    "verify5_over_verify1_max": 1.1,
    "graphs_over_eager_b1_min": 2.0,
}
# packages the device image lacks (KINDS.md of the device tool): the check must not need them
ABSENT_ON_DEVICE = ("pydantic", "ray", "gguf", "grpc_tools", "kubernetes", "promql_parser", "openai")


@dataclass
class Options:
    device: str = "cuda"
    tiny: bool = False
    budget_s: float | None = None  # None: 420 on CUDA, 120 tiny
    out: Path | None = None
    sections: tuple[str, ...] = ()  # empty: all
    batches: tuple[int, ...] = ()  # empty: 1, 8, 32, 64 (tiny: 1, 4)
    decode_steps: int = 0  # timed steps per batch; 0: 24 (tiny: 6)
    spec_k: int = 4
    test_timeout_s: float = 210.0
    commit: str | None = None
    # run the graph sections on the CPU too: the engine's padded static-buffer path without
    # capture (EngineConfig.cuda_graphs=True there), so their code runs before a GPU sees it
    graphs_on_cpu: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu, got {self.device!r}")
        if self.budget_s is None:
            self.budget_s = 120.0 if self.tiny else 420.0
        if self.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {self.budget_s}")
        if not self.batches:
            self.batches = (1, 4) if self.tiny else (1, 8, 32, 64)
        if any(b < 1 for b in self.batches):
            raise ValueError(f"--batches must be >= 1, got {self.batches}")
        if not self.decode_steps:
            self.decode_steps = 6 if self.tiny else 24
        if not 1 <= self.spec_k <= 8:
            raise ValueError(f"--spec-k must be in 1..8, got {self.spec_k}")
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"--sections: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")


@dataclass
class Budget:
    """The run's time budget: sections ask before they start."""

    total_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


@contextlib.contextmanager
def hard_cap(seconds: float):
    """Raise ``SectionTimeout`` in this (main) thread after ``seconds``; a no-op off the main
    thread or where SIGALRM does not exist."""
    usable = hasattr(signal, "setitimer") and _main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def _raise(signum, frame):
        raise SectionTimeout(f"hard cap of {seconds:.0f} s reached")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---- arithmetic (tested on the CPU) ------------------------------------------------------

def bandwidth_floor_s(weight_bytes: int, kv_bytes: int, bytes_per_s: float) -> float:
    """The least time one decode step can take: it must read every weight it multiplies by
    and the KV cache it attends over, at best at the measured copy bandwidth."""
    if not bytes_per_s > 0:
        raise ValueError("bandwidth_floor_s: bandwidth must be > 0")
    return (weight_bytes + kv_bytes) / bytes_per_s


def _goal(value, limit, at_most: bool) -> dict:
    if value is None or not isinstance(value, (int, float)) or value != value:
        return {"value": None, "limit": limit, "met": None}
    return {"value": round(value, 4), "limit": limit, "met": bool(value <= limit if at_most else value >= limit)}


def summarize(sections: dict) -> dict:
    """Headline numbers and the goals, from whatever sections produced (missing: None)."""
    def get(*path):
        x = sections
        for p in path:
            if not isinstance(x, dict) or p not in x:
                return None
            x = x[p]
        return x

    out: dict = {}
    bw = get("bandwidth", "bytes_per_s_best")
    per_step = get("model", "weight_bytes", "per_decode_step")
    kv_tok = get("model", "kv_bytes_per_token")
    ctx = get("decode", "context_tokens")
    eager_b1 = get("decode", "by_batch", "1", "step_ms")
    graphs_b1 = get("graphs", "by_batch", "1", "step_ms")
    best_b1 = min([x for x in (eager_b1, graphs_b1) if isinstance(x, (int, float))], default=None)
    if bw and per_step:
        floor_ms = 1e3 * bandwidth_floor_s(int(per_step), int((kv_tok or 0) * (ctx or 0)), float(bw))
        out["bandwidth_floor_ms"] = round(floor_ms, 4)
        out["decode_b1_step_ms"] = best_b1
        out["decode_b1_over_floor"] = round(best_b1 / floor_ms, 4) if best_b1 else None
    # the engine's steps as served (graphs where there are), else eager, else the model alone
    v5, v5_from = None, None
    for key in ("engine_graphs", "engine", "forward"):
        v5 = get("verify_cost", key, "relative", "5")
        if v5 is not None:
            v5_from = key
            break
    out["verify5_over_verify1"] = v5
    out["verify5_from"] = v5_from
    out["graphs_over_eager_b1"] = round(eager_b1 / graphs_b1, 4) if eager_b1 and graphs_b1 else None
    out["long_context_b1_over_floor"] = get("long_context", "by_batch", "1", "over_floor")
    out["tests"] = {k: get("tests", k) for k in ("passed", "failed", "errors", "skipped")} \
        if get("tests", "status") == "ok" else get("tests", "status")
    out["goals"] = {
        "decode_b1_over_floor": _goal(out.get("decode_b1_over_floor"), GOALS["decode_b1_over_floor_max"], True),
        "verify5_over_verify1": _goal(v5, GOALS["verify5_over_verify1_max"], True),
        "graphs_over_eager_b1": _goal(out["graphs_over_eager_b1"], GOALS["graphs_over_eager_b1_min"], False),
    }
    return out


# ---- environment ---------------------------------------------------------------------------

def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def source_digest(root: Path = REPO) -> str:
    """sha256 over the check's source (adaptspec/, kernels/, tests/), to match a run to a tree
    where git is not there."""
    h = hashlib.sha256()
    for sub in ("adaptspec", "kernels", "tests"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def git_commit(root: Path = REPO, given: str | None = None) -> dict:
    info = {"commit": None, "dirty": None, "source": None}
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            info.update(commit=r.stdout.strip(), source="git")
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
            info["dirty"] = bool(d.stdout.strip()) if d.returncode == 0 else None
    except Exception:
        pass
    given = given or os.environ.get("ADAPTSPEC_GIT_COMMIT")
    if given:  # said by the caller: a copied tree's .git (the device tool's) can lag its files
        info.update(git_head=info["commit"], commit=given, source="given")
    return info


def env_section(opts: Options) -> dict:
    import torch

    out = {
        "machine": {"node": platform.node(), "platform": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": _version("triton"),
                     "transformers": _version("transformers"), "pytest": _version("pytest"),
                     "numpy": _version("numpy")},
        "git": git_commit(given=opts.commit), "source_digest": source_digest(),
        "device": opts.device,
    }
    if opts.device == "cuda":
        try:
            p = torch.cuda.get_device_properties(0)
        except Exception as e:  # the rest of the environment is still worth recording
            out["gpu"] = {"error": f"{type(e).__name__}: {e}"}
            return out
        out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                      "memory_gib": round(p.total_memory / 2**30, 2), "count": torch.cuda.device_count()}
        with contextlib.suppress(Exception):
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            out["gpu"]["nvidia_smi"] = r.stdout.strip()
    return out


# ---- the run -------------------------------------------------------------------------------

SECTIONS = ("env", "tests", "bandwidth", "model", "decode", "graphs", "verify_cost", "spec", "long_context",
            "profile")
NEEDS_MODEL = ("decode", "graphs", "verify_cost", "spec", "long_context", "profile")


def estimates(opts: Options) -> dict[str, float]:
    """Seconds each section is expected to take (to skip what no longer fits) and its hard
    cap (a multiple, so a slow start is not cut off but a hang is)."""
    if opts.tiny or opts.device == "cpu":
        return {s: 2.0 for s in SECTIONS}
    return {"env": 5, "tests": 60, "bandwidth": 5, "model": 30, "decode": 45, "graphs": 60, "verify_cost": 25,
            "spec": 60, "long_context": 40, "profile": 30}


def _release_memory(device: str) -> None:
    """Engines hold themselves in cycles (scheduler callbacks): collect them, so their graphs
    and buffers leave the device before the next section builds its own."""
    import gc

    gc.collect()
    if device == "cuda":
        with contextlib.suppress(Exception):
            import torch

            torch.cuda.empty_cache()


def default_out(opts: Options, now: _dt.datetime | None = None) -> Path:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    name = f"gpu-check-{now:%Y-%m-%d}" + ("" if opts.device == "cuda" and not opts.tiny else f"-{opts.device}-tiny") \
        + ".json"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return REPO / "docs" / "results" / name


class Check:
    def __init__(self, opts: Options, *, clock: Callable[[], float] = time.monotonic,
                 runners: dict[str, Callable] | None = None):
        self.opts = opts
        self.budget = Budget(float(opts.budget_s), clock)
        self.out_path = opts.out or default_out(opts)
        self.state: dict = {}
        self.result: dict = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "options": {"device": opts.device, "tiny": opts.tiny, "budget_s": opts.budget_s,
                                         "batches": list(opts.batches), "decode_steps": opts.decode_steps,
                                         "spec_k": opts.spec_k},
                             "goals": GOALS, "sections": {}, "errors": [], "summary": {}}
        self.est = estimates(opts)
        self.shim: str | None = None
        self.needs_model = () if runners else NEEDS_MODEL
        self.runners = runners or {
            "env": lambda: env_section(self.opts),
            "tests": lambda: tests_section(self.opts, self._test_time(), self.shim,
                                           self.out_path.with_name(self.out_path.stem + "-pytest.log")),
            "bandwidth": lambda: bandwidth_section(self.opts),
            "model": lambda: model_section(self.opts, self.state),
            "decode": lambda: decode_section(self.opts, self.state, graphs=False),
            "graphs": lambda: decode_section(self.opts, self.state, graphs=True),
            "verify_cost": lambda: verify_cost_section(self.opts, self.state),
            "spec": lambda: spec_section(self.opts, self.state),
            "long_context": lambda: long_context_section(
                self.opts, {**self.state, "bytes_per_s": self.result["sections"].get("bandwidth", {}).get("bytes_per_s_best")}),
            "profile": lambda: profile_section(self.opts, self.state),
        }

    def _test_time(self) -> float:
        """The tests get what the budget leaves after the speed sections' estimates."""
        reserve = sum(self.est[s] for s in SECTIONS if s not in ("env", "tests"))
        return self.budget.left() - reserve

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.budget.elapsed(), 2)
        self.result["summary"] = summarize(self.result["sections"])
        try:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.result, indent=1, default=str))
            tmp.replace(self.out_path)
        except OSError as e:
            print(f"gpu_check: cannot write {self.out_path}: {e}", file=sys.stderr)

    def run_section(self, name: str) -> dict:
        est = self.est.get(name, 5.0)
        left = self.budget.left()
        if self.opts.sections and name not in self.opts.sections:
            rec = {"status": "skipped", "reason": "not selected (--sections)"}
        elif name in self.needs_model and "target" not in self.state:
            model = self.result["sections"].get("model", {}).get("status", "not run")
            rec = {"status": "skipped", "reason": f"needs the model (model section: {model})"}
        elif left < est:
            rec = {"status": "skipped", "reason": f"time budget: {left:.0f} s left, the section needs about {est:.0f} s"}
        else:
            t0 = time.monotonic()
            cap = left if name == "tests" else min(left, 4 * est + 30)
            try:
                with hard_cap(cap):
                    data = self.runners[name]()
                rec = {"status": "ok", **data} if "status" not in data else dict(data)
            except (Exception, SectionTimeout) as e:
                rec = {"status": "error", **error_record(e)}
            finally:
                _release_memory(self.opts.device)
            rec["elapsed_s"] = round(time.monotonic() - t0, 2)
        if rec["status"] == "error":
            self.result["errors"].append(f"{name}: {rec.get('error')}")
        for sub, e in (rec.get("errors") or {}).items():
            if isinstance(e, dict):
                self.result["errors"].append(f"{name}/{sub}: {e.get('error')}")
        self.result["sections"][name] = rec
        self.save()
        print(f"[gpu_check] {name}: {rec['status']}"
              + (f" ({rec.get('reason') or rec.get('error')})" if rec["status"] != "ok" else "")
              + f"  [{self.budget.elapsed():.0f} s of {self.opts.budget_s:.0f}]", flush=True)
        return rec

    def run(self) -> dict:
        try:
            self.shim = ensure_kernels_importable()
        except Exception as e:
            self.result["errors"].append(f"kernels import shim: {e}")
        if self.opts.device == "cuda":
            try:
                import torch

                if not torch.cuda.is_available():
                    self.result["errors"].append("device cuda: torch sees no CUDA device")
            except Exception as e:
                self.result["errors"].append(f"torch: {e}")
        for name in SECTIONS:
            self.run_section(name)
        self.state.clear()
        self.save()
        return self.result


# ---- printing ------------------------------------------------------------------------------

def table(result: dict) -> str:
    s = result.get("sections", {})
    lines = [f"GPU check ({result.get('options', {}).get('device')}) -> elapsed {result.get('elapsed_s')} s"]
    env = s.get("env", {})
    if env.get("status") == "ok":
        v = env.get("versions", {})
        lines.append(f"  {env.get('gpu', {}).get('name', env.get('machine', {}).get('processor'))}; torch {v.get('torch')}, "
                     f"triton {v.get('triton')}; commit {env.get('git', {}).get('commit')}")
    t = s.get("tests", {})
    if t:
        lines.append(f"  tests: {t.get('status')} passed={t.get('passed')} failed={t.get('failed')} "
                     f"errors={t.get('errors')} skipped={t.get('skipped')} {t.get('reason') or ''}".rstrip())
        for f in (t.get("failures") or [])[:10]:
            lines.append(f"    FAIL {f['test']}: {f['message'][:160]}")
    bw = s.get("bandwidth", {})
    if bw.get("status") == "ok":
        lines.append(f"  copy bandwidth: {bw['bytes_per_s_best'] / 1e12:.3f} TB/s (read + write, best of {bw['reps']})")
    m = s.get("model", {})
    if m.get("status") == "ok":
        lines.append(f"  model: {m['shape_of']} shapes, {m['dtype']}, {m['weight_bytes']['per_decode_step'] / 1e9:.2f} GB "
                     f"read per decode step, attention {m['attention']}")
    for key in ("decode", "graphs"):
        d = s.get(key, {})
        if d.get("status") == "ok":
            lines.append(f"  decode ({d['mode']}): batch  tokens/s  step ms")
            for b, r in d["by_batch"].items():
                lines.append(f"    {b:>5}  {r['tokens_per_s']!s:>9}  {r['step_ms']!s:>8}")
        elif d:
            lines.append(f"  {key}: {d.get('status')} {d.get('reason') or d.get('error') or ''}")
    vc = s.get("verify_cost", {})
    if vc.get("status") == "ok":
        for key in ("forward", "engine", "engine_graphs"):
            if isinstance(vc.get(key), dict) and "relative" in vc[key]:
                rel = " ".join(f"{n}:{x:.2f}" for n, x in vc[key]["relative"].items())
                lines.append(f"  verify n tokens / one ({key}): {rel}")
    sp = s.get("spec", {})
    if sp.get("status") == "ok":
        for name, r in sp.get("runs", {}).items():
            lines.append(f"  spec {name} k={sp['k']}: {r['tokens_per_s']} tok/s, accepted length "
                         f"{r['mean_accepted_length']}, acceptance {r['acceptance_rate']}, x{r.get('speedup_over_plain')} "
                         f"over plain" + (f", a step {r['step_over_k_plus_1_plain']}x k + 1 plain steps"
                                          if r.get("step_over_k_plus_1_plain") is not None else ""))
    lc = s.get("long_context", {})
    for split, rows in (lc.get("by_split") or {}).items():
        for b, r in rows.items():
            lines.append(f"  decode ({lc['mode']}) over {lc['context_tokens']} tokens, split {split}, batch {b}: "
                         f"{r['tokens_per_s']} tok/s, {r['step_ms']} ms a step"
                         + (f", {r['over_floor']}x its floor" if r.get("over_floor") else ""))
    pr = s.get("profile", {})
    for mode, p in (pr.get("modes") or {}).items():
        lines.append(f"  profile b1 ({mode}): {p['wall_ms_per_step']} ms/step, device busy {p['device_busy_ms_per_step']} ms, "
                     f"host {p['host_ms_per_step']} ms")
        for k in p.get("kernels", [])[:6]:
            lines.append(f"    {k['ms_per_step']:>8} ms  x{k['calls_per_step']:<6} {k['name'][:80]}")
        for k in p.get("host_ops", [])[:4]:
            lines.append(f"    host {k['self_ms_per_step']:>8} ms  x{k['calls_per_step']:<6} {k['name'][:70]}")
    sm = result.get("summary", {})
    lines.append(f"  floor: decode b1 {sm.get('decode_b1_step_ms')} ms vs {sm.get('bandwidth_floor_ms')} ms "
                 f"= {sm.get('decode_b1_over_floor')}x")
    for g, v in sm.get("goals", {}).items():
        lines.append(f"  goal {g}: {v['value']} (limit {v['limit']}): "
                     + {True: "met", False: "MISSED", None: "not measured"}[v["met"]])
    for e in result.get("errors", []):
        lines.append(f"  ERROR {e[:200]}")
    return "\n".join(lines)


# ---- what a device run needs --------------------------------------------------------------

BLOCKER = """
import sys, importlib.abc
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ImportError("absent on the device image: " + name)
sys.meta_path.insert(0, _Absent())
"""


def carry_check(root: Path = REPO) -> tuple[bool, list[str]]:
    """What a device run needs from this tree, checked: the source (adaptspec/, kernels/,
    tests/) within the device tool's 64 MiB, and the check's imports free of the packages
    the device image lacks (pydantic, ray, gguf, ...). No virtual environment travels."""
    lines, ok = [], True
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, timeout=30)
        files = [f for f in r.stdout.split("\0") if f]
        size = sum((root / f).stat().st_size for f in files if (root / f).is_file())
        lines.append(f"travels: {len(files)} files, {size / 2**20:.1f} MiB of the 64 MiB limit "
                     "(tracked + untracked-not-ignored; .venv is ignored and stays here)")
        ok &= size < 64 * 2**20
    except Exception as e:
        lines.append(f"travels: could not list the tree ({e})")
    code = BLOCKER.format(absent=set(ABSENT_ON_DEVICE)) + (
        # forget an editable install of this project: the device has none
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        "sys.path_hooks[:] = [h for h in sys.path_hooks if '__editable__' not in getattr(h, '__module__', '')]\n"
        "sys.path_importer_cache.clear()\n"
        "import adaptspec.tools.gpu_check as g, adaptspec.engine.engine, adaptspec.models.synthetic\n"
        "assert g.REPO.samefile('.'), g.REPO\n"
        "shim = g.ensure_kernels_importable()\n"
        "assert shim, 'adaptspec_kernels importable without the shim'\n"
        "import adaptspec_kernels.testing\n"
        "print('imports ok')\n")
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        lines.append(f"imports: ok without {', '.join(ABSENT_ON_DEVICE)} and without an install of adaptspec "
                     "(kernels/ mapped to adaptspec_kernels by the check)")
    else:
        ok = False
        lines.append("imports: FAIL without the packages the device lacks:\n" + r.stderr[-1500:])
    lines.append("command on the device: python3 -m adaptspec.tools.gpu_check (repo root; $OUT set by the tool)")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaptspec.tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model shape (fp32): the check's logic in seconds")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget of the whole run (default 420; tiny 120)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/ or docs/results/gpu-check-DATE.json)")
    ap.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--batches", default="", help="decode batch sizes, e.g. 1,8,32,64")
    ap.add_argument("--decode-steps", type=int, default=0, help="timed steps per batch size")
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--test-timeout-s", type=float, default=210.0)
    ap.add_argument("--commit", default=None, help="git commit to record where the tree has no .git")
    ap.add_argument("--carry-check", action="store_true", help="check what a device run needs from this tree; exit")
    ap.add_argument("--graphs-on-cpu", action="store_true", help=argparse.SUPPRESS)  # the graph sections' code, no GPU
    a = ap.parse_args(argv)
    if a.carry_check:
        ok, lines = carry_check()
        print("\n".join(lines))
        return 0 if ok else 1
    try:
        opts = Options(device=a.device, tiny=a.tiny, budget_s=a.budget_s, out=a.out,
                       sections=tuple(x for x in a.sections.split(",") if x),
                       batches=tuple(int(x) for x in a.batches.split(",") if x), decode_steps=a.decode_steps,
                       spec_k=a.spec_k, test_timeout_s=a.test_timeout_s, commit=a.commit, graphs_on_cpu=a.graphs_on_cpu)
    except ValueError as e:
        ap.error(str(e))
    check = Check(opts)
    print(f"[gpu_check] writing {check.out_path}", flush=True)
    result = check.run()
    print(table(result), flush=True)
    print(f"[gpu_check] wrote {check.out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
