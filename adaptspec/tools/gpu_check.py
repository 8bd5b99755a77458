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
  replay equal to eager), ``test_kernels.py`` (the Triton verifier against the torch
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
  accepts nearly every token, so what is left is the engine's overhead) and with n-gram
  lookup on repetitive prompts (a random model need not repeat them: its acceptance is
  recorded, not judged).
* ``summary``: the decode step at batch 1 against the memory-bandwidth floor (bytes one
  decode step reads / the measured copy bandwidth), verify-5 / verify-1, graphs / eager,
  and the goals of issue #23 as met / missed.

Output: ``$OUT/gpu-check-<date>.json`` when ``$OUT`` is set (the device tool brings that
folder back), else ``docs/results/gpu-check-<date>.json``; ``--out`` overrides both.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "adaptspec.gpu_check/1"
GOALS = {  # issue #23's goals, as recorded by this check
    "decode_b1_over_floor_max": 1.3,
    "verify5_over_verify1_max": 1.1,
    "graphs_over_eager_b1_min": 2.0,
}
# packages the device image lacks (KINDS.md of the device tool): the check must not need them
ABSENT_ON_DEVICE = ("pydantic", "ray", "gguf", "grpc_tools", "kubernetes", "promql_parser", "openai")


class SectionTimeout(Exception):
    """A section ran past its hard cap."""


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

def relative(costs: dict[int, float], base: int = 1) -> dict[int, float]:
    """Each cost over the cost at ``base`` (e.g. verifying n tokens over verifying one)."""
    if base not in costs or not costs[base] > 0:
        raise ValueError(f"relative: no positive cost at {base}")
    return {n: c / costs[base] for n, c in sorted(costs.items())}


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second a copy of ``nbytes`` moved: it reads them and writes them."""
    if nbytes <= 0 or not seconds > 0:
        raise ValueError(f"copy_bandwidth: needs bytes > 0 and seconds > 0, got {nbytes}, {seconds}")
    return 2.0 * nbytes / seconds


def bandwidth_floor_s(weight_bytes: int, kv_bytes: int, bytes_per_s: float) -> float:
    """The least time one decode step can take: it must read every weight it multiplies by
    and the KV cache it attends over, at best at the measured copy bandwidth."""
    if not bytes_per_s > 0:
        raise ValueError("bandwidth_floor_s: bandwidth must be > 0")
    return (weight_bytes + kv_bytes) / bytes_per_s


def tokens_per_s(batch: int, steps: int, seconds: float) -> float:
    """Plain decode: every request gains one token a step."""
    return batch * steps / seconds if seconds > 0 else float("nan")


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
    if info["commit"] is None and given:
        info.update(commit=given, source="given")
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


# ---- the CUDA test subset -----------------------------------------------------------------

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


def run_pytest(files: list[str], timeout_s: float, *, cwd: Path = REPO, extra_path: str | None = None,
               per_test_timeout_s: float = 120.0) -> dict:
    """The files in a pytest subprocess (so a crash or a hang stays there), with a timeout.
    Counts come from the junit file, or from the verbose lines when the run was stopped; a
    single test is stopped after ``per_test_timeout_s`` where pytest-timeout is installed."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not importable on this machine"}
    if not files:
        return {"status": "skipped", "reason": "no test files found"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (extra_path, str(cwd), env.get("PYTHONPATH")) if x)
        cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={per_test_timeout_s:.0f}")
        cmd += files
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, text, timed_out = r.returncode, r.stdout + r.stderr, False
        except subprocess.TimeoutExpired as e:
            rc, timed_out = None, True
            text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                           for x in (e.stdout, e.stderr))
        out = {"files": files, "returncode": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1),
               "output_tail": text[-3000:]}
        if xml.is_file():
            out.update(parse_junit(xml))
            out["counted_from"] = "junit"
        else:
            out.update(parse_verbose(text))
            out["counted_from"] = "verbose output (no junit file: the run did not finish)"
        out["status"] = "ok" if xml.is_file() else "error"
        if timed_out:
            out["error"] = f"pytest ran past {timeout_s:.0f} s and was stopped"
        elif not xml.is_file():
            out["error"] = f"pytest exited {rc} without a junit file"
        return out


def tests_section(opts: Options, left_s: float, shim: str | None) -> dict:
    if opts.device != "cuda":
        return {"status": "skipped", "reason": "CUDA-only: the CUDA test subset runs on a CUDA device"}
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "torch sees no CUDA device"}
    timeout = max(10.0, min(opts.test_timeout_s, left_s))
    return run_pytest(cuda_test_files(), timeout, extra_path=shim)


# ---- timing helpers -----------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_ms(fn, device: str, reps: int, warmup: int = 2) -> list[float]:
    """Wall milliseconds of each of ``reps`` calls (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bandwidth_section(opts: Options) -> dict:
    import torch

    n = (64 if opts.tiny or opts.device == "cpu" else 2048) * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=opts.device)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), opts.device, reps=10, warmup=3)
    best, med = min(times) / 1e3, statistics.median(times) / 1e3
    del src, dst
    return {"copy_bytes": n, "reps": len(times), "best_ms": round(best * 1e3, 4), "median_ms": round(med * 1e3, 4),
            "bytes_per_s_best": copy_bandwidth(n, best), "bytes_per_s_median": copy_bandwidth(n, med),
            "note": "a device-to-device copy; bytes read plus bytes written per second"}


# ---- the model and the engine -------------------------------------------------------------

def model_section(opts: Options, state: dict) -> dict:
    import torch

    from adaptspec.models.synthetic import LLAMA31_8B, TINY, random_model, weight_bytes

    cfg = TINY if opts.tiny else LLAMA31_8B
    dtype = "fp32" if opts.tiny else "bf16"
    t0 = time.perf_counter()
    # on the CPU the torch reference matmul: the same code path as on CUDA, no C kernel build
    tgt = random_model(cfg, dtype, opts.device, matmul="reference", name="random-llama31-8b-shape")
    _sync(opts.device)
    state["target"] = tgt
    c = tgt.model.cfg
    out = {"shape": {"hidden": c.hidden_size, "layers": c.num_layers, "heads": c.num_heads,
                     "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate": c.intermediate_size,
                     "vocab": c.vocab_size},
           "shape_of": "tiny" if opts.tiny else "Llama-3.1-8B", "dtype": str(tgt.model.dtype).replace("torch.", ""),
           "weight_bytes": weight_bytes(tgt.model),
           "kv_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * tgt.model.compute_dtype.itemsize,
           "attention": getattr(tgt.model.attn, "name", type(tgt.model.attn).__name__),
           "build_s": round(time.perf_counter() - t0, 2)}
    if opts.device == "cuda":
        out["memory_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return out


def _graphs_here(opts: Options) -> bool:
    return opts.device == "cuda" or opts.graphs_on_cpu


def engine_fields() -> set[str]:
    from dataclasses import fields

    from adaptspec.engine.engine import EngineConfig

    return {f.name for f in fields(EngineConfig)}


def make_engine(target, *, graphs: bool | None, max_num_seqs: int, max_model_len: int, draft=None, **extra):
    """An engine on ``target``; ``graphs`` True/False sets ``cuda_graphs`` where the engine
    has it (None: its default). Unknown extra fields are dropped (older engines)."""
    from adaptspec.engine.engine import Engine, EngineConfig

    have = engine_fields()
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=max(1024, 8 * max_num_seqs), enable_prefix_caching=False,
              suffix_drafter=False)
    if graphs is not None and "cuda_graphs" in have:
        kw["cuda_graphs"] = graphs
    kw.update({k: v for k, v in extra.items() if k in have})
    return Engine(target, draft, EngineConfig(**kw))


def _prompts(n: int, length: int, vocab: int, seed: int, repetitive: bool = False) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a 12-token phrase again and again: n-gram lookup has matches from the start
            phrase = torch.randint(0, vocab, (12,), generator=g).tolist()
            out.append((phrase * (length // 12 + 1))[:length])
        else:
            out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


def run_timed(engine, prompts, spec, *, warmup_steps: int, steps: int, max_new_tokens: int) -> dict:
    """Add the requests, step until each has its first token (prefill), ``warmup_steps``
    more, then time ``steps`` steps (wall; each step ends in its one host transfer). Aborts
    whatever is left."""
    from adaptspec.engine.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, spec) for p in prompts]
    got = {r: 0 for r in rids}
    guard = 0
    while min(got.values()) == 0:
        for o in engine.step():
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
        guard += 1
        if guard > 10_000:
            raise RuntimeError("prefill did not finish")
    for _ in range(warmup_steps):
        engine.step()
    before = copy.deepcopy(engine.totals)  # counters are committed within each step
    step_ms: list[float] = []
    try:
        t0 = time.perf_counter()
        emitted = 0
        n = 0
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            t_step = time.perf_counter()
            outs = engine.step()  # ends in the step's host transfer: the device work is done
            step_ms.append((time.perf_counter() - t_step) * 1e3)
            emitted += sum(len(o.new_token_ids) for o in outs)
            n += 1
        wall = time.perf_counter() - t0
    finally:
        after = copy.deepcopy(engine.totals)
        for r in rids:
            engine.abort(r)
    drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
    req_steps = after.steps - before.steps
    return {"batch": len(prompts), "steps": n, "wall_s": round(wall, 4), "emitted": emitted,
            "tokens_per_s": round(emitted / wall, 2) if wall > 0 else None,
            "step_ms": round(1e3 * wall / n, 4) if n else None,
            "step_ms_median": round(statistics.median(step_ms), 4) if step_ms else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(emitted / req_steps, 4) if req_steps else None}


def _lengths(opts: Options) -> tuple[int, int]:
    """(prompt tokens, max_model_len) of the speed runs."""
    return (32, 256) if opts.tiny else (128, 512)


def decode_section(opts: Options, state: dict, graphs: bool) -> dict:
    from adaptspec.engine.params import SpecConfig

    if graphs and not _graphs_here(opts):
        return {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    if graphs and "cuda_graphs" not in engine_fields():
        return {"status": "skipped", "reason": "this engine has no EngineConfig.cuda_graphs"}
    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    steps, warm = opts.decode_steps, 3
    t0 = time.perf_counter()
    eng = make_engine(tgt, graphs=graphs, max_num_seqs=max(opts.batches), max_model_len=max_len,
                      cuda_graph_max_tokens=max(opts.batches))
    out = {"mode": "graphs" if graphs else "eager", "engine_build_s": round(time.perf_counter() - t0, 2),
           "context_tokens": prompt_len + warm, "prompt_tokens": prompt_len, "by_batch": {}, "errors": {}}
    for b in opts.batches:
        try:
            out["by_batch"][str(b)] = run_timed(eng, _prompts(b, prompt_len, tgt.vocab_size, seed=b), SpecConfig(),
                                                warmup_steps=warm, steps=steps, max_new_tokens=steps + warm + 8)
        except SectionTimeout:
            raise
        except Exception as e:  # one batch size failing leaves the others
            out["errors"][str(b)] = _err(e)
    out["cuda_graphs"] = getattr(eng.config, "cuda_graphs", None)
    state["plain_" + out["mode"]] = out["by_batch"]
    return out


def fixed_proposer():
    """A drafter proposing ``k`` copies of the last token: the step verifies k + 1 rows
    whatever is accepted (the cost of verification by token count, not a drafter)."""
    from adaptspec.engine.proposers import Draft, Proposer

    class FixedProposer(Proposer):
        name = "fixed"

        def propose(self, seqs, ks):
            return [Draft([s.token_ids[-1]] * k, None, None) for s, k in zip(seqs, ks)]

    return FixedProposer()


def forward_cost(model, device: str, ctx: int, max_tokens: int = 9, reps: int = 10) -> dict[int, float]:
    """Median ms of the model's forward over ``n`` new tokens of one sequence with ``ctx``
    cached positions, n = 1..max_tokens (eager: the model alone, no engine)."""
    from adaptspec.models.batch import FlatBatch

    bs = 16
    blocks = -(-(ctx + max_tokens) // bs)
    if model.num_blocks < blocks or model.block_size != bs:
        model.allocate_kv(blocks, bs)
    table = list(range(blocks))
    out = {}
    for n in range(1, max_tokens + 1):
        batch = FlatBatch.build([[1] * n], [ctx], [table], list(range(n)), bs, model.device)
        out[n] = statistics.median(time_ms(lambda: model.forward(batch), device, reps=reps, warmup=2))
    return out


def verify_cost_section(opts: Options, state: dict) -> dict:
    from adaptspec.engine.params import SpecConfig

    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    out: dict = {"tokens": list(range(1, 10)), "context_tokens": prompt_len}
    fwd = forward_cost(tgt.model, opts.device, prompt_len, reps=5 if opts.tiny else 10)
    out["forward"] = {"ms": {str(n): round(v, 4) for n, v in fwd.items()},
                      "relative": {str(n): round(v, 4) for n, v in relative(fwd).items()}}
    state["forward_ms"] = fwd
    modes = [False] + ([True] if _graphs_here(opts) and "cuda_graphs" in engine_fields() else [])
    for graphs in modes:
        key = "engine_graphs" if graphs else "engine"
        try:
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=1, max_model_len=max_len,
                              cuda_graph_max_tokens=16)
            eng.add_proposer("draft", fixed_proposer())
            ms = {}
            for k in range(0, 9):
                spec = SpecConfig("draft", k) if k else SpecConfig()
                r = run_timed(eng, _prompts(1, prompt_len, tgt.vocab_size, seed=100 + k), spec, warmup_steps=2,
                              steps=max(4, opts.decode_steps // 2), max_new_tokens=200)
                ms[k + 1] = r["step_ms_median"]
            out[key] = {"step_ms": {str(n): v for n, v in ms.items()},
                        "relative": {str(n): round(v, 4) for n, v in relative(ms).items()}}
        except SectionTimeout:
            raise
        except Exception as e:
            out[key] = {"status": "error", **_err(e)}
    return out


def self_draft(target):
    """The target as its own draft: the same weights (no copy), its own KV cache."""
    from adaptspec.models.loader import LoadedModel

    twin = copy.copy(target.model)  # shares every weight tensor; allocate_kv gives it its own cache
    twin.k_cache, twin.v_cache = [], []
    return LoadedModel(name=target.name + "-self", path=target.path, model=twin, tokenizer=target.tokenizer)


def spec_section(opts: Options, state: dict) -> dict:
    from adaptspec.engine.params import SpecConfig

    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    k = opts.spec_k
    new = 24 if opts.tiny else 64
    batches = [b for b in opts.batches if b <= 8] or [min(opts.batches)]
    out: dict = {"k": k, "max_new_tokens": new, "runs": {}, "errors": {}}
    fwd = state.get("forward_ms") or {}
    # the self-draft runs eager only: its twin model shares the target's attributes, and
    # whatever per-model state graph capture keeps must not be shared
    runs = [("self_draft", True, False, False), ("ngram", False, True, False)]
    if _graphs_here(opts) and "cuda_graphs" in engine_fields():
        runs.append(("ngram_graphs", False, True, True))
    for name, with_draft, repetitive, graphs in runs:
        plain = state.get("plain_graphs" if graphs else "plain_eager") or {}
        try:
            draft = self_draft(tgt) if with_draft else None
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=max(batches), max_model_len=max_len, draft=draft,
                              cuda_graph_max_tokens=max(batches) * (k + 1))
            for b in batches:
                r = run_timed(eng, _prompts(b, prompt_len, tgt.vocab_size, seed=200 + b, repetitive=repetitive),
                              SpecConfig("draft" if with_draft else "ngram", k), warmup_steps=1,
                              steps=10_000, max_new_tokens=new)
                base = plain.get(str(b), {}).get("tokens_per_s")
                r["speedup_over_plain"] = round(r["tokens_per_s"] / base, 4) if base and r["tokens_per_s"] else None
                if with_draft and b == 1 and fwd.get(1) and fwd.get(k + 1):
                    # k one-token draft forwards + one (k+1)-token verification, the model alone
                    model_ms = k * fwd[1] + fwd[k + 1]
                    r["model_only_step_ms"] = round(model_ms, 4)
                    r["engine_overhead_ms"] = round(r["step_ms"] - model_ms, 4) if r["step_ms"] else None
                out["runs"][f"{name}/b{b}"] = r
            del eng, draft
        except SectionTimeout:
            raise
        except Exception as e:
            out["errors"][name] = _err(e)
    return out


# ---- the run -------------------------------------------------------------------------------

SECTIONS = ("env", "tests", "bandwidth", "model", "decode", "graphs", "verify_cost", "spec")
NEEDS_MODEL = ("decode", "graphs", "verify_cost", "spec")


def estimates(opts: Options) -> dict[str, float]:
    """Seconds each section is expected to take (to skip what no longer fits) and its hard
    cap (a multiple, so a slow start is not cut off but a hang is)."""
    if opts.tiny or opts.device == "cpu":
        return {s: 2.0 for s in SECTIONS}
    return {"env": 5, "tests": 60, "bandwidth": 5, "model": 30, "decode": 45, "graphs": 60, "verify_cost": 25,
            "spec": 40}


def _release_memory(device: str) -> None:
    """Engines hold themselves in cycles (scheduler callbacks): collect them, so their graphs
    and buffers leave the device before the next section builds its own."""
    import gc

    gc.collect()
    if device == "cuda":
        with contextlib.suppress(Exception):
            import torch

            torch.cuda.empty_cache()


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:1000],
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2500:]}


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
            "tests": lambda: tests_section(self.opts, self._test_time(), self.shim),
            "bandwidth": lambda: bandwidth_section(self.opts),
            "model": lambda: model_section(self.opts, self.state),
            "decode": lambda: decode_section(self.opts, self.state, graphs=False),
            "graphs": lambda: decode_section(self.opts, self.state, graphs=True),
            "verify_cost": lambda: verify_cost_section(self.opts, self.state),
            "spec": lambda: spec_section(self.opts, self.state),
        }

    def _test_time(self) -> float:
        """The tests get what the budget leaves after the speed sections' estimates."""
        reserve = sum(self.est[s] for s in ("bandwidth", "model", "decode", "graphs", "verify_cost", "spec"))
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
                rec = {"status": "error", **_err(e)}
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
                         f"over plain" + (f", engine overhead {r['engine_overhead_ms']} ms/step"
                                          if r.get("engine_overhead_ms") is not None else ""))
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
