"""Fit the per-layer linear-operator curves shipped in ``adaptspec.control.gpu_profiles``.

Run: ``python -m adaptspec.sim.fit_profiles ../shared/data/profiles`` prints the table
``LAYER_MS`` (milliseconds per transformer layer at each token count) that gpu.py holds.
It reads the measured H100 operator profiles (microsoft/vidur data, MIT) in place; the data
files are never copied into the project, only these numbers.

Per layer = the median time of every profiled operator except the embedding
(layernorms, QKV projection, rotary, output projection, gated MLP up/act/down, residual
adds), summed; duplicate rows are combined by their median. ``up_proj`` is kept
separately: it is the yardstick for the output layer (a GEMM of the same kind).
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

KNOTS = (1, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# (file under profiles/, tensor-parallel degree) -> key in LAYER_MS
SOURCES = {
    "llama2-7b-tp1": ("h100/Llama-2-7b-hf.mlp.csv", 1),
    "llama2-7b-tp4": ("h100/Llama-2-7b-hf.mlp.csv", 4),
    "llama2-70b-tp4": ("h100/Llama-2-70b-hf.mlp.csv", 4),
    "phi2-tp1": ("h100/phi-2.mlp.csv", 1),
}


def layer_curve(path: Path, tp: int) -> tuple[list[float], list[float]]:
    rows = list(csv.DictReader(path.open()))
    ops = sorted({k.split(".")[1] for k in rows[0] if k.startswith("time_stats.")} - {"emb"})
    by_n: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        if int(r["num_tensor_parallel_workers"]) != tp:
            continue
        total = sum(float(r[f"time_stats.{o}.median"]) for o in ops)
        up = float(r["time_stats.mlp_up_proj.median"])
        by_n.setdefault(int(r["num_tokens"]), []).append((total, up))
    ns = np.array(sorted(by_n))
    tot = np.array([np.median([x[0] for x in by_n[n]]) for n in ns])
    up = np.array([np.median([x[1] for x in by_n[n]]) for n in ns])
    # enforce a non-decreasing curve (measurement noise at small n), then sample the knots
    tot = np.maximum.accumulate(tot)
    up = np.maximum.accumulate(up)
    return ([round(float(np.interp(k, ns, tot)), 5) for k in KNOTS],
            [round(float(np.interp(k, ns, up)), 5) for k in KNOTS])


def fit(root: Path) -> dict[str, tuple[list[float], list[float]]]:
    return {key: layer_curve(root / f, tp) for key, (f, tp) in SOURCES.items()}


def main(argv: list[str]) -> None:
    root = Path(argv[0] if argv else "../shared/data/profiles")
    print(f"KNOTS = {KNOTS}")
    print("LAYER_MS = {")
    for key, (tot, up) in fit(root).items():
        print(f'    "{key}": ({tot},\n        {up}),')
    print("}")


if __name__ == "__main__":
    main(sys.argv[1:])
