"""The kernel tools run: the bench on tiny sizes, and the kernels compile for a real GPU.

The compile check runs the whole Triton pipeline down to a cubin for sm_90 without a GPU,
catching type errors the interpreter accepts (it runs in a subprocess: this process may
have triton in interpreter mode).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from adaptspec_kernels.testing import load_kernels_or_skip

_, DEVICE = load_kernels_or_skip()


def test_bench_runs_on_tiny_sizes(tmp_path, capsys):
    from adaptspec.tools import kernel_bench as bench

    out = tmp_path / "bench.json"
    rows = bench.main(["--device", DEVICE, "--batch", "2", "--k", "0", "3", "--vocab", "100",
                       "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert [(r["mode"], r["k"]) for r in rows] == [("greedy", 0), ("stochastic", 0), ("greedy", 3), ("stochastic", 3)]
    # same inputs, same uniforms: the kernels reproduce the torch verifier row for row
    assert all(r["same"] == 1.0 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and "triton" in saved["machine"]
    assert "speedup" in capsys.readouterr().out


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "adaptspec_kernels.compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("sm_90 ok") == 23
    assert "rotary_and_write bf16" in proc.stdout and "paged_attention fp32" in proc.stdout


FMA_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adaptspec_kernels.compile_check import _variants
name, fn, sig, ce, opts = next(v for v in _variants() if v[0] == "rotary_and_write fp32")
for o in (opts, None):
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32),
                         options=o).asm["ptx"]
    print(ptx.count("fma.rn.f32"))
"""


def test_the_rotary_kernel_compiles_without_fused_multiply_adds():
    """torch rounds each product of the rotary embedding before the sum; the kernel matches
    its bits only if the compiler does not contract them into FMAs: with the launch's option
    the fp32 PTX has none; the control, the same kernel without it, has some."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", FMA_CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with_option, without = (int(x) for x in proc.stdout.split())
    assert with_option == 0 and without > 0
