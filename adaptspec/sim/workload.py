"""Workloads: arrival processes, rate schedules, class mixes, lengths, trace replay."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaptspec.sim.scenario import (
    ClassSpec,
    ConstantRate,
    DiurnalRate,
    FixedLength,
    LengthSpec,
    LognormalLength,
    RampRate,
    RateSpec,
    StepRate,
    TraceSpec,
    UniformLength,
    WorkloadSpec,
    ZipfLength,
)


@dataclass(slots=True)
class Requests:
    """The requests of a run, sorted by arrival."""

    arrival_s: np.ndarray  # [R] float
    prompt_tokens: np.ndarray  # [R] int
    output_tokens: np.ndarray  # [R] int
    class_idx: np.ndarray  # [R] int, index into the scenario's classes
    prompt_idx: np.ndarray | None = None  # [R] int: index into its class's prompt set (-1 / None: none)
    # [R] int: prompt tokens a prefix cache served (not in prompt_tokens, which are prefilled):
    # they are not computed, but every pass of the request reads them as context (None: none)
    cached_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.arrival_s.size


def sample_lengths(spec: LengthSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(spec, FixedLength):
        return np.full(n, spec.value, dtype=np.int64)
    if isinstance(spec, UniformLength):
        return rng.integers(spec.low, spec.high + 1, n)
    if isinstance(spec, LognormalLength):
        x = np.exp(np.log(spec.median) + spec.sigma * rng.standard_normal(n))
        return np.clip(np.round(x), spec.min, spec.max).astype(np.int64)
    if isinstance(spec, ZipfLength):
        return np.clip(rng.zipf(spec.a, n) * spec.scale, spec.min, spec.max).astype(np.int64)
    raise ValueError(f"unknown length distribution {spec!r}")


def rate_at(spec: RateSpec, t: np.ndarray, duration_s: float) -> np.ndarray:
    """Requests per second at times t."""
    if isinstance(spec, ConstantRate):
        return np.full_like(t, spec.rps)
    if isinstance(spec, StepRate):
        starts = np.array([s[0] for s in spec.steps])
        rates = np.array([s[1] for s in spec.steps])
        order = np.argsort(starts)
        idx = np.searchsorted(starts[order], t, side="right") - 1
        return np.where(idx >= 0, rates[order][np.maximum(idx, 0)], 0.0)
    if isinstance(spec, RampRate):
        return spec.start_rps + (spec.end_rps - spec.start_rps) * np.clip(t / duration_s, 0, 1)
    if isinstance(spec, DiurnalRate):
        return spec.mean_rps * (1 + spec.amplitude * np.sin(2 * np.pi * t / spec.period_s))
    raise ValueError(f"unknown rate schedule {spec!r}")


def arrival_times(spec: WorkloadSpec, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrivals in [0, duration_s): a unit-rate renewal process (Poisson, or Gamma with shape
    = burstiness as in vllm bench serve) mapped through the inverse cumulative rate."""
    grid = np.linspace(0.0, duration_s, max(int(duration_s * 10), 2) + 1)
    lam = np.maximum(rate_at(spec.rate, grid, duration_s), 0.0)
    cum = np.concatenate([[0.0], np.cumsum((lam[1:] + lam[:-1]) / 2 * np.diff(grid))])
    total = cum[-1]
    n_guess = int(total + 6 * np.sqrt(total + 1) + 10)
    if spec.arrival.process == "poisson":
        gaps = rng.exponential(1.0, n_guess)
    else:
        b = spec.arrival.burstiness
        gaps = rng.gamma(b, 1.0 / b, n_guess)
    u = np.cumsum(gaps)
    while u[-1] < total:  # rare: draw more
        more = rng.exponential(1.0, n_guess) if spec.arrival.process == "poisson" else rng.gamma(
            spec.arrival.burstiness, 1.0 / spec.arrival.burstiness, n_guess)
        u = np.concatenate([u, u[-1] + np.cumsum(more)])
    u = u[u < total]
    # invert the cumulative intensity (strictly increasing where the rate is positive)
    keep = np.concatenate([[True], np.diff(cum) > 0])
    return np.interp(u, cum[keep], grid[keep])


def synthesize(spec: WorkloadSpec, classes: list[ClassSpec], duration_s: float, rng: np.random.Generator) -> Requests:
    t = arrival_times(spec, duration_s, rng)
    return _with_classes(t, None, None, classes, rng)


def _with_classes(t: np.ndarray, prompt: np.ndarray | None, output: np.ndarray | None, classes: list[ClassSpec],
                  rng: np.random.Generator, class_idx: np.ndarray | None = None) -> Requests:
    n = t.size
    w = np.array([c.weight for c in classes], dtype=float)
    if w.sum() <= 0:
        raise ValueError("classes: at least one weight must be > 0")
    if class_idx is None and any(c.weight_schedule for c in classes):
        class_idx = _draw_classes(t, classes, rng)
    if class_idx is None:
        class_idx = rng.choice(len(classes), size=n, p=w / w.sum())
    p = np.zeros(n, dtype=np.int64) if prompt is None else prompt.astype(np.int64)
    o = np.zeros(n, dtype=np.int64) if output is None else output.astype(np.int64)
    for i, c in enumerate(classes):
        m = class_idx == i
        if prompt is None:
            p[m] = sample_lengths(c.prompt_tokens, int(m.sum()), rng)
        if output is None:
            o[m] = sample_lengths(c.output_tokens, int(m.sum()), rng)
    return Requests(t, np.maximum(p, 1), np.maximum(o, 1), class_idx.astype(np.int64))


def class_weights_at(classes: list[ClassSpec], t: np.ndarray) -> np.ndarray:
    """[len(t), C] each class's weight at times t (``weight``, then its ``weight_schedule``)."""
    out = np.empty((t.size, len(classes)))
    for i, c in enumerate(classes):
        out[:, i] = c.weight
        for start, weight in sorted(c.weight_schedule or ()):
            out[t >= start, i] = weight
    return out


def _draw_classes(t: np.ndarray, classes: list[ClassSpec], rng: np.random.Generator) -> np.ndarray:
    """A class per arrival from the weights in force at its time."""
    w = class_weights_at(classes, t)
    tot = w.sum(axis=1, keepdims=True)
    if (tot <= 0).any():
        raise ValueError(f"classes: every weight is 0 at {float(t[(tot[:, 0] <= 0)][0]):g} s")
    cum = np.cumsum(w / tot, axis=1)
    return np.minimum((rng.random(t.size)[:, None] > cum).sum(axis=1), len(classes) - 1)


def read_trace(spec: TraceSpec, base: Path, classes: list[ClassSpec], duration_s: float,
               rng: np.random.Generator) -> Requests:
    """CSV columns: arrived_at (s), num_prefill_tokens, num_decode_tokens, optional
    request_class. Rows without a known class get one drawn from the class weights."""
    path = Path(spec.path)
    if not path.is_absolute():
        path = base / path
    if not path.exists():
        raise ValueError(f"workload.trace.path: {path} does not exist")
    t, p, o, cls = [], [], [], []
    names = {c.name: i for i, c in enumerate(classes)}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"arrived_at", "num_prefill_tokens", "num_decode_tokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"workload.trace.path: {path} lacks columns {sorted(need - set(reader.fieldnames or ()))}")
        for row in reader:
            at = float(row["arrived_at"])
            if at < spec.start_s:
                continue
            at = (at - spec.start_s) / spec.time_scale
            if at >= duration_s:
                break
            t.append(at)
            p.append(int(float(row["num_prefill_tokens"])))
            o.append(int(float(row["num_decode_tokens"])))
            cls.append(names.get(row.get("request_class") or "", -1))
            if spec.max_requests and len(t) >= spec.max_requests:
                break
    if not t:
        raise ValueError(f"workload.trace: no rows of {path} fall within the run")
    order = np.argsort(np.array(t), kind="stable")
    c = np.array(cls)[order]
    w = np.array([x.weight for x in classes], dtype=float)
    missing = c < 0
    c[missing] = rng.choice(len(classes), size=int(missing.sum()), p=w / w.sum())
    return _with_classes(np.array(t)[order], np.array(p)[order], np.array(o)[order], classes, rng, c)
