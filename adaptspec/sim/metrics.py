"""Metrics with the standard names: TTFT, TPOT, ITL, E2E, throughput, goodput under SLOs.

Goodput follows DistServe and ``vllm bench serve --goodput``: requests per second that meet
every SLO given (TTFT, TPOT, E2E). Requests that arrived within [warmup, duration) are
measured; one not finished by the end of the drain counts as missing its SLOs.
TPOT = (E2E - TTFT) / (output tokens - 1). ITL = time between successive emissions of a
request (a step's duration, weighted by the requests it advanced).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptspec.sim.replica import Recorder
from adaptspec.sim.workload import Requests


@dataclass(slots=True)
class LatencyStats:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, x: np.ndarray, weights: np.ndarray | None = None) -> "LatencyStats":
        x = np.asarray(x, dtype=float)
        if x.size == 0:
            return cls(np.nan, np.nan, np.nan, np.nan)
        if weights is None:
            p = np.percentile(x, [50, 90, 99])
            return cls(float(x.mean()), *map(float, p))
        order = np.argsort(x)
        xs, w = x[order], np.asarray(weights, dtype=float)[order]
        cw = np.cumsum(w)
        if cw[-1] <= 0:
            return cls(np.nan, np.nan, np.nan, np.nan)
        q = [float(xs[min(np.searchsorted(cw, f * cw[-1]), xs.size - 1)]) for f in (0.5, 0.9, 0.99)]
        return cls(float(np.dot(xs, w) / cw[-1]), *q)


@dataclass(slots=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


@dataclass(slots=True)
class ClassMetrics:
    name: str
    requests: int
    completed: int
    goodput_rps: float
    slo_attainment: float  # fraction of measured requests meeting their SLOs
    output_tok_s: float
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    mean_accepted_length: float
    arm_share: list[tuple[str, float]]  # most used arms first
    # share of the class's output tokens (measured requests) in requests that finished within
    # the class's TPOT SLO (None: the class has no TPOT SLO)
    tpot_token_attainment: float | None = None


@dataclass(slots=True)
class RunMetrics:
    policy: str
    rate_rps: float | None
    requests: int
    completed: int
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput_rps: float
    slo_attainment: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    mean_accepted_length: float
    decision_us_mean: float
    decision_us_max: float
    steps: int
    simulated_s: float
    wall_s: float
    classes: list[ClassMetrics] = field(default_factory=list)
    # over time, per class: [bins] mean accepted length and mean k of the chosen arms
    timeline_s: list[float] = field(default_factory=list)
    timeline_accepted: dict[str, list[float]] = field(default_factory=dict)
    timeline_k: dict[str, list[float]] = field(default_factory=dict)
    # latency distributions for CDF plots: the 0th..100th percentiles (seconds)
    tpot_quantiles: list[float] = field(default_factory=list)
    ttft_quantiles: list[float] = field(default_factory=list)
    clients: int | None = None  # a closed loop's client count (rate_rps is None then)
    refused: int = 0  # measured requests refused at arrival (SLO-aware admission): they miss their SLOs


def compute_metrics(policy: str, rate: float | None, req: Requests, rec: Recorder, class_names: list[str],
                    slos: list[SLO], warmup_s: float, duration_s: float, simulated_s: float, wall_s: float,
                    steps: int, decision_us_mean: float, decision_us_max: float) -> RunMetrics:
    window = duration_s - warmup_s
    m = (req.arrival_s >= warmup_s) & (req.arrival_s < duration_s)
    done = m & ~np.isnan(rec.finish_s)
    ttft = rec.first_token_s - req.arrival_s
    e2e = rec.finish_s - req.arrival_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(req.output_tokens > 1, (rec.finish_s - rec.first_token_s) / (req.output_tokens - 1), 0.0)
    ok = done.copy()
    for c, slo in enumerate(slos):
        mc = req.class_idx == c
        if slo.ttft_s is not None:
            ok &= ~mc | (ttft <= slo.ttft_s)
        if slo.tpot_s is not None:
            ok &= ~mc | (tpot <= slo.tpot_s)
        if slo.e2e_s is not None:
            ok &= ~mc | (e2e <= slo.e2e_s)
    ends = np.asarray(rec.step_end)
    in_win = (ends >= warmup_s) & (ends < duration_s)
    emitted_win = float(np.asarray(rec.step_emitted)[in_win].sum()) if ends.size else 0.0
    prompt_done = float(req.prompt_tokens[done].sum())
    arms = [str(a) for a in rec.arms]
    ks = np.array([a.k for a in rec.arms], dtype=float)
    classes = []
    for c, name in enumerate(class_names):
        mc = m & (req.class_idx == c)
        dc = done & (req.class_idx == c)
        counts = rec.arm_counts[c].sum(axis=0)
        tot = counts.sum()
        share = sorted(((arms[i], float(counts[i] / tot)) for i in np.flatnonzero(counts)), key=lambda x: -x[1])
        classes.append(ClassMetrics(
            name, int(mc.sum()), int(dc.sum()), float((ok & mc).sum() / window),
            float((ok & mc).sum() / max(mc.sum(), 1)), float(req.output_tokens[dc].sum() / window),
            LatencyStats.of(ttft[dc]), LatencyStats.of(tpot[dc & (req.output_tokens > 1)]), LatencyStats.of(e2e[dc]),
            float(rec.accepted_sum[c].sum() / max(rec.accepted_n[c].sum(), 1)), share[:6],
            None if slos[c].tpot_s is None else
            float(req.output_tokens[dc & (tpot <= slos[c].tpot_s)].sum() / max(req.output_tokens[mc].sum(), 1))))
    with np.errstate(invalid="ignore", divide="ignore"):
        acc_t = rec.accepted_sum / rec.accepted_n
        k_t = (rec.arm_counts * ks).sum(axis=2) / rec.arm_counts.sum(axis=2)
    last = max(rec.bin(simulated_s) + 1, 1)
    return RunMetrics(
        policy=policy, rate_rps=rate, requests=int(m.sum()), completed=int(done.sum()),
        request_throughput=float(done.sum() / window),
        output_token_throughput=emitted_win / window,
        total_token_throughput=(emitted_win + prompt_done) / window,
        goodput_rps=float(ok.sum() / window),
        slo_attainment=float(ok.sum() / max(m.sum(), 1)),
        ttft=LatencyStats.of(ttft[done]), tpot=LatencyStats.of(tpot[done & (req.output_tokens > 1)]),
        itl=LatencyStats.of(np.asarray(rec.step_wall)[in_win], np.asarray(rec.step_decoding)[in_win]),
        e2e=LatencyStats.of(e2e[done]),
        mean_accepted_length=float(rec.accepted_sum.sum() / max(rec.accepted_n.sum(), 1)),
        decision_us_mean=decision_us_mean, decision_us_max=decision_us_max,
        steps=steps, simulated_s=simulated_s, wall_s=wall_s, classes=classes,
        timeline_s=[float((b + 0.5) * rec.bin_s) for b in range(last)],
        timeline_accepted={n: [None if np.isnan(x) else float(x) for x in acc_t[c, :last]] for c, n in enumerate(class_names)},
        timeline_k={n: [None if np.isnan(x) else float(x) for x in k_t[c, :last]] for c, n in enumerate(class_names)},
        tpot_quantiles=_quantiles(tpot[done & (req.output_tokens > 1)]),
        ttft_quantiles=_quantiles(ttft[done]),
        refused=int((m & _refused(rec, len(req))).sum()),
    )


def _refused(rec: Recorder, n: int) -> np.ndarray:
    r = getattr(rec, "refused", None)
    if r is None:
        return np.zeros(n, dtype=bool)
    return r[:n] if r.size >= n else np.concatenate([r, np.zeros(n - r.size, dtype=bool)])


def _quantiles(x: np.ndarray) -> list[float]:
    return [float(v) for v in np.percentile(x, np.arange(101))] if x.size else []
