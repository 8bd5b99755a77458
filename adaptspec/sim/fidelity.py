"""Simulator fidelity: the same workload live and simulated, compared per class and level.

Torch-free: this module holds the comparison (per-request rows from either side, the
metrics of a (policy, level, class) cell, relative errors, the goals), the report (table
rows, JSON, a plot) and the simulated side of a level; ``fidelity_run`` measures the live
side and drives the command.

Both sides are measured the same way, inside the same measured window: tokens that
arrived in it per second (throughput; a simulated request's tokens are spread evenly from
its first token to its last, the live ones arrive in recorded chunks), and TTFT and TPOT
percentiles over requests that finished in it (TPOT of requests with more than one token).
The medians are Harrell-Davis estimates by default (``median``): a cell's requests come from a
few prompts, and where those run at two speeds the sample median jumps between the groups.
The arms are request-steps per arm of the class: the live requests that finished in the
window, the simulated steps that ended in it.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from adaptspec.sim import step_shapes

METRICS = ("throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
# the goals of issue #29: |relative error| within these bounds in every cell
BOUNDS = {"throughput": 0.10, "tpot_p50": 0.10, "ttft_p50": 0.20}
TOP_ARM_AGREEMENT = 0.80
ALL = "all"  # the class column of a level's aggregate over its classes
# the live side's own sampling noise of a cell's medians: a bootstrap over its requests
NOISE_METRICS = ("ttft_p50", "tpot_p50")
NOISE_LEVEL = 0.90  # the central share of the bootstrap medians the interval holds
NOISE_RESAMPLES = 2000
# how a cell's p50s are estimated (``median``): "hd", Harrell-Davis; "sample", the sample median
MEDIANS = ("hd", "sample")
_MEDIAN_NAMES = {"hd": "Harrell-Davis median", "sample": "sample median"}


@functools.lru_cache(maxsize=512)
def _hd_weights(n: int, q: float = 0.5) -> np.ndarray:
    """The Harrell-Davis weights of ``n`` sorted values for quantile ``q``: the mass of a
    Beta(q (n+1), (1-q)(n+1)) on each (i-1)/n..i/n (scipy's regularized incomplete beta, the
    function ``scipy.stats.mstats.hdquantiles`` evaluates; here once per n, so a bootstrap of
    thousands of draws is one matrix product)."""
    from scipy.special import betainc

    w = np.diff(betainc(q * (n + 1), (1.0 - q) * (n + 1), np.arange(n + 1) / n))
    w.setflags(write=False)
    return w


def median(xs, how: str = "hd") -> float:
    """The median of ``xs`` (nan: none). "sample": the middle value (the mean of the two middle
    ones). "hd": the Harrell-Davis estimate, a weighted mean of every order statistic with
    weights peaked at the middle. They estimate the same median; they differ where the values
    form groups with a gap at the middle: 8 prompts of a class, 4 that copy under n-gram lookup
    at 12-18 ms a token and 4 that do not at 27-35 ms, put the sample median of 40 requests at
    either edge of the gap by which prompts a window happened to finish (one configuration's two
    live rounds: 20.2 and 26.8 ms), where the Harrell-Davis estimate moves with the groups'
    shares (22.4 and 23.7 ms): docs/results/2026-12-04-median.md."""
    if how not in MEDIANS:
        raise ValueError(f"median: one of {MEDIANS}, got {how!r}")
    x = np.asarray(xs, dtype=float)
    if x.size == 0:
        return math.nan
    if how == "sample" or x.size == 1:
        return float(np.median(x))
    return float(np.sort(x) @ _hd_weights(x.size))


def other_median(how: str) -> str:
    """The estimator of ``MEDIANS`` that is not ``how`` (reported beside it)."""
    return next(m for m in MEDIANS if m != how)


# ---- one side, one cell ----------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    """One request, live or simulated; times in seconds on one clock per run."""

    request_class: str
    start_s: float
    first_token_s: float = math.nan  # nan: no token yet
    end_s: float = math.nan  # nan: not finished (cut at the window's end, or past the drain)
    tokens: int = 0
    cut: bool = False
    error: bool = False
    chunks: list[tuple[float, int]] | None = None  # (time, tokens) as they arrived, when known
    prompt_index: int = -1
    arms: dict[str, int] = field(default_factory=dict)  # live: request-steps per arm ("drafter:k")
    cached_tokens: int = 0  # live: prompt tokens the prefix cache served
    # live, through a service: seconds of its TTFT outside the engine (client TTFT - the engine's)
    path_s: float = math.nan


@dataclass(slots=True)
class Run:
    """The requests of one run and its measured window, and its engine steps there (see
    ``step_time``)."""

    rows: list[Row]
    window: tuple[float, float]
    steps: int = 0  # engine steps that ended inside the window
    step_wall_s: float = 0.0  # their wall seconds
    busy_s: float = 0.0  # seconds of the window inside some step
    # live: speed probes of the engine right before and after the run ({"before"/"after":
    # {batch size: decode-step seconds}}, ``speed_probe``); None: not probed
    probe: dict | None = None
    # every step's shape inside the window (``sim.step_shapes``); None: not logged
    shapes: list | None = None

    @property
    def seconds(self) -> float:
        return self.window[1] - self.window[0]


def step_time(ends, walls, window: tuple[float, float]) -> tuple[int, float, float]:
    """(steps that ended inside ``window``, their wall seconds, seconds of the window in steps)."""
    ends, walls = np.asarray(ends, dtype=float), np.asarray(walls, dtype=float)
    if ends.size == 0:
        return 0, 0.0, 0.0
    inside = (ends >= window[0]) & (ends <= window[1])
    overlap = np.clip(np.minimum(ends, window[1]) - np.maximum(ends - walls, window[0]), 0.0, None)
    return int(inside.sum()), float(walls[inside].sum()), float(overlap.sum())


def tokens_in_window(r: Row, w0: float, w1: float) -> int:
    if r.chunks is not None:
        return sum(n for t, n in r.chunks if w0 <= t <= w1)
    if r.tokens <= 0 or math.isnan(r.first_token_s):
        return 0
    first = int(w0 <= r.first_token_s <= w1)
    if r.tokens == 1 or math.isnan(r.end_s):
        return first
    # the other tokens evenly over (first token, last token]
    t = r.first_token_s + (r.end_s - r.first_token_s) * np.arange(1, r.tokens) / (r.tokens - 1)
    return first + int(np.count_nonzero((t >= w0) & (t <= w1)))


@dataclass(slots=True)
class SideMetrics:
    requests: int  # finished inside the window(s)
    throughput: float  # tokens arriving inside the window(s) per second
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    arms: dict[str, float] = field(default_factory=dict)  # arm -> share of request-steps
    top_arm: str = "-"
    step_ms: float = math.nan  # mean engine step (all classes of the run)
    busy: float = math.nan  # the engine's share of the window spent in steps
    # metric -> (low, high): the NOISE_LEVEL bootstrap interval of that median over the
    # cell's requests (NOISE_METRICS), what another draw of as many requests could give
    noise: dict[str, tuple[float, float]] = field(default_factory=dict)
    median: str = "hd"  # how ttft_p50 and tpot_p50 were estimated (MEDIANS)
    # NOISE_METRICS by the other estimator of MEDIANS, for comparison (not judged)
    other_p50: dict[str, float] = field(default_factory=dict)

    def value(self, metric: str) -> float:
        return getattr(self, metric)


def side_metrics(runs: Iterable[Run], request_class: str | None,
                 arm_steps: dict[str, float] | None = None, noise: bool = False, how: str = "hd") -> SideMetrics:
    """A cell's metrics over ``runs`` (pooled; their windows add up); ``request_class`` None:
    every class. ``arm_steps`` None: the arms of the requests that finished in the window.
    ``noise``: with the medians' bootstrap intervals (``median_interval``). ``how``: the p50s'
    estimator (``median``); the other one's go in ``other_p50``."""
    runs = list(runs)
    seconds = sum(r.seconds for r in runs)
    tokens = 0
    ttft: list[float] = []
    tpot: list[float] = []
    done = 0
    row_arms: dict[str, float] = {}
    for run in runs:
        w0, w1 = run.window
        for r in run.rows:
            if request_class is not None and r.request_class != request_class:
                continue
            tokens += tokens_in_window(r, w0, w1)
            if r.cut or r.error or r.tokens <= 0 or math.isnan(r.end_s) or not w0 <= r.end_s <= w1:
                continue
            done += 1
            for a, n in r.arms.items():
                row_arms[a] = row_arms.get(a, 0) + n
            ttft.append(r.first_token_s - r.start_s)
            if r.tokens > 1:
                tpot.append((r.end_s - r.first_token_s) / (r.tokens - 1))

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else math.nan

    arms = dict(row_arms if arm_steps is None else arm_steps)
    total = sum(arms.values())
    share = {a: n / total for a, n in sorted(arms.items(), key=lambda kv: -kv[1])} if total > 0 else {}
    steps, wall, busy = (sum(getattr(r, f) for r in runs) for f in ("steps", "step_wall_s", "busy_s"))
    other = other_median(how)
    return SideMetrics(done, tokens / seconds if seconds > 0 else math.nan, median(ttft, how), pct(ttft, 99),
                       median(tpot, how), pct(tpot, 99), share, next(iter(share), "-"),
                       1e3 * wall / steps if steps else math.nan, busy / seconds if steps and seconds > 0 else math.nan,
                       {"ttft_p50": median_interval(ttft, how=how), "tpot_p50": median_interval(tpot, how=how)}
                       if noise else {}, how, {"ttft_p50": median(ttft, other), "tpot_p50": median(tpot, other)})


def median_interval(xs: list[float], level: float = NOISE_LEVEL, resamples: int = NOISE_RESAMPLES,
                    seed: int = 0, how: str = "hd") -> tuple[float, float]:
    """The central ``level`` share of the medians (estimated ``how``, see ``median``) of
    ``resamples`` bootstrap draws of ``xs`` (with replacement, as many as ``xs``): how far the
    median of another sample of as many requests from the same mix could fall. Where the values
    form two groups with the median between them (prompts that copy and prompts that do not,
    under n-gram lookup), the sample median's interval spans the gap. Seeded: the same requests
    give the same interval."""
    if len(xs) < 2:
        return (math.nan, math.nan)
    x = np.asarray(xs, dtype=float)
    draws = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    if how == "hd":
        med = np.sort(x[draws], axis=1) @ _hd_weights(x.size)
    else:
        med = np.median(x[draws], axis=1)
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(med, [tail, 100.0 - tail])
    return float(lo), float(hi)


# ---- live against simulated ------------------------------------------------------------------
def rel_error(sim: float, live: float) -> float:
    """(sim - live) / live; nan when either is missing or live is 0."""
    if sim is None or live is None or math.isnan(sim) or math.isnan(live) or live == 0:
        return math.nan
    return (sim - live) / abs(live)


@dataclass(slots=True)
class Cell:
    path: str  # "in-process" or "grpc": which live path
    policy: str
    level: str
    request_class: str  # a class, or ALL
    adaptive: bool
    live: SideMetrics
    sim: SideMetrics
    errors: dict[str, float] = field(default_factory=dict)
    # adaptive cells: the top arm of each live run (round) alone, when there are two or more
    live_round_tops: list[str] = field(default_factory=list)
    # adaptive cells with four or more rounds: the top arm of the first half of the rounds
    # pooled, and of the second half (two live sides of the same workload, each pooled)
    live_half_tops: list[str] = field(default_factory=list)

    def in_live_noise(self, metric: str) -> bool:
        """The simulated value lies inside the live side's bootstrap interval of ``metric``
        (``SideMetrics.noise``): a miss there is no larger than the live sample's own draw."""
        lo, hi = self.live.noise.get(metric, (math.nan, math.nan))
        v = self.sim.value(metric)
        return not math.isnan(lo) and not math.isnan(v) and lo <= v <= hi

    @property
    def same_top_arm(self) -> bool:
        """Both sides ran the class and chose the same arm most ("-": no steps of it)."""
        return self.live.top_arm == self.sim.top_arm != "-"

    @property
    def same_top_drafter(self) -> bool:
        """Both sides drafted with the same drafter most (steps of its arms summed over k): the
        kind of choice, where the top arm also asks for the same k among near-equal ones."""
        live, sim = (max(_by_drafter(x.arms).items(), key=lambda kv: kv[1], default=("-", 0))[0]
                     for x in (self.live, self.sim))
        return live == sim != "-"

    @property
    def arm_distance(self) -> float:
        """Total variation distance between the two sides' shares of steps by arm: 0 the same
        mix, 1 no arm in common (nan: a side ran no steps of the class)."""
        a, b = self.live.arms, self.sim.arms
        if not a or not b:
            return math.nan
        return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def _by_drafter(arms: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for arm, share in arms.items():
        drafter = arm.split(":")[0]
        out[drafter] = out.get(drafter, 0.0) + share
    return out


def arm_summary(cells: list[Cell]) -> str:
    """How close the adaptive policy's choices were beyond the top arm (not a goal of the issue:
    a sampling policy spreads its steps over arms of near-equal value, and one live run's top
    arm among them is a draw): top drafter agreement and the median arm-share distance."""
    adaptive = [c for c in cells if c.adaptive and c.request_class != ALL]
    if not adaptive:
        return ""
    tv = [c.arm_distance for c in adaptive if not math.isnan(c.arm_distance)]
    same, pairs = round_agreement(adaptive)
    rounds = f"; live rounds repeat their own top arm in {same}/{pairs} pairs" if pairs else ""
    same, n = half_agreement(adaptive)
    rounds += f"; the two halves of the live rounds, each pooled, agree in {same}/{n} cells" if n else ""
    return (f"adaptive arms beyond the top arm (not judged): top drafter agrees in "
            f"{sum(c.same_top_drafter for c in adaptive)}/{len(adaptive)} cells; arm-share distance (total "
            f"variation) median {float(np.median(tv)) if tv else math.nan:.2f}, max {max(tv, default=math.nan):.2f}"
            f"{rounds}")


def make_cell(path: str, policy: str, level: str, request_class: str, adaptive: bool, live: SideMetrics,
              sim: SideMetrics, live_round_tops: list[str] | None = None,
              live_half_tops: list[str] | None = None) -> Cell:
    return Cell(path, policy, level, request_class, adaptive, live, sim,
                {m: rel_error(sim.value(m), live.value(m)) for m in METRICS}, list(live_round_tops or []),
                list(live_half_tops or []))


def half_agreement(cells: list[Cell]) -> tuple[int, int]:
    """(adaptive cells whose two halves of live rounds, each pooled, have the same top arm,
    cells with both halves): the live service against itself at the pooling a goal's live side
    has, where ``round_agreement`` compares single rounds."""
    same = n = 0
    for c in cells:
        tops = c.live_half_tops
        if not c.adaptive or c.request_class == ALL or len(tops) != 2 or "-" in tops:
            continue
        n += 1
        same += tops[0] == tops[1]
    return same, n


def round_agreement(cells: list[Cell]) -> tuple[int, int]:
    """(pairs of live rounds of the same adaptive cell with the same top arm, such pairs): how
    often the live policy repeats its own top arm, the ceiling of one live side's agreement
    with a simulated one when arms of near-equal value share the steps."""
    same = pairs = 0
    for c in cells:
        if not c.adaptive or c.request_class == ALL:
            continue
        tops = c.live_round_tops
        for i in range(len(tops)):
            for j in range(i + 1, len(tops)):
                if tops[i] != "-" and tops[j] != "-":
                    pairs += 1
                    same += tops[i] == tops[j]
    return same, pairs


@dataclass(slots=True)
class Goal:
    name: str
    met: bool
    detail: str
    misses: list[str] = field(default_factory=list)  # the cells that miss it


def goals(cells: list[Cell]) -> list[Goal]:
    """The issue's goals over the per-class cells (ALL rows are reported, not judged)."""
    per_class = [c for c in cells if c.request_class != ALL]
    out = []
    for metric, bound in BOUNDS.items():
        misses, worst, within, in_noise = [], 0.0, 0, 0
        for c in per_class:
            e = c.errors.get(metric, math.nan)
            where = f"{c.path}/{c.policy}/{c.level}/{c.request_class}"
            if math.isnan(e):  # a cell without a value (no request finished) cannot be said to meet it
                misses.append(f"{where} (no value)")
                continue
            worst = max(worst, abs(e))
            if abs(e) > bound:
                noisy = metric in NOISE_METRICS and c.in_live_noise(metric)
                in_noise += noisy
                misses.append(f"{where} ({100 * e:+.1f}%{', inside the live interval' if noisy else ''})")
            else:
                within += 1
        detail = f"{within}/{len(per_class)} cells within, worst {100 * worst:.1f}%"
        if metric in NOISE_METRICS and misses:
            detail += (f"; {in_noise} of the {len(misses)} misses inside the live median's own "
                       f"{100 * NOISE_LEVEL:.0f}% bootstrap interval")
        if metric in NOISE_METRICS and per_class and per_class[0].live.other_p50:
            other = [rel_error(c.sim.other_p50.get(metric, math.nan), c.live.other_p50.get(metric, math.nan))
                     for c in per_class]
            detail += (f" (by the {_MEDIAN_NAMES[other_median(per_class[0].live.median)]}: "
                       f"{sum(not math.isnan(e) and abs(e) <= bound for e in other)}/{len(per_class)})")
        out.append(Goal(f"{metric} within {100 * bound:.0f}%", bool(per_class) and not misses, detail, misses))
    adaptive = [c for c in per_class if c.adaptive]
    agree = sum(c.same_top_arm for c in adaptive)
    frac = agree / len(adaptive) if adaptive else math.nan
    out.append(Goal(f"adaptive top arm agrees in >= {100 * TOP_ARM_AGREEMENT:.0f}% of cells",
                    bool(adaptive) and frac >= TOP_ARM_AGREEMENT,
                    f"{agree}/{len(adaptive)} cells" if adaptive else "no adaptive policy was run",
                    [f"{c.path}/{c.policy}/{c.level}/{c.request_class} (live {c.live.top_arm}, sim {c.sim.top_arm})"
                     for c in adaptive if not c.same_top_arm]))
    return out


# ---- report --------------------------------------------------------------------------------------
def _fmt(x: float, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * scale:.{digits}f}"


def _err(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:+.1f}%"


STEP_HEAD = ["path", "policy", "level", "steps/s live/sim", "step ms live/sim (err)", "engine busy live/sim"]


def step_rows(cells: list[Cell]) -> list[list[str]]:
    """Per level, the engine's steps live and simulated (from the ALL rows): a throughput
    error with the step time right points at acceptance or scheduling; with busy < 1 live,
    at time outside the engine's steps (the load generator's own work)."""
    rows = []
    for c in cells:
        if c.request_class != ALL:
            continue
        rate = [x.busy / (x.step_ms / 1e3) if x.step_ms > 0 else math.nan for x in (c.live, c.sim)]
        rows.append([c.path, c.policy, c.level, f"{_fmt(rate[0])}/{_fmt(rate[1])}",
                     f"{_fmt(c.live.step_ms, 1, 2)}/{_fmt(c.sim.step_ms, 1, 2)} "
                     f"({_err(rel_error(c.sim.step_ms, c.live.step_ms))})",
                     f"{_fmt(c.live.busy, 1, 2)}/{_fmt(c.sim.busy, 1, 2)}"])
    return rows


TABLE_HEAD = ["path", "policy", "level", "class", "req live/sim", "tok/s live/sim (err)", "TTFT p50 ms (err)",
              "TTFT p99 ms (err)", "TPOT p50 ms (err)", "TPOT p99 ms (err)", "top arm live/sim"]


def table_rows(cells: list[Cell]) -> list[list[str]]:
    rows = []
    for c in cells:
        def pair(m: str, scale: float) -> str:
            return f"{_fmt(c.live.value(m), scale)}/{_fmt(c.sim.value(m), scale)} ({_err(c.errors[m])})"

        rows.append([c.path, c.policy, c.level, c.request_class, f"{c.live.requests}/{c.sim.requests}",
                     pair("throughput", 1.0), pair("ttft_p50", 1e3), pair("ttft_p99", 1e3), pair("tpot_p50", 1e3),
                     pair("tpot_p99", 1e3),
                     f"{c.live.top_arm}/{c.sim.top_arm}" + ("" if c.same_top_arm else " *")])
    return rows


def to_json(cells: list[Cell], goal_list: list[Goal], meta: dict) -> str:
    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    data = {"meta": meta, "goals": [asdict(g) for g in goal_list],
            "cells": [{**asdict(c), "same_top_arm": c.same_top_arm, "same_top_drafter": c.same_top_drafter,
                       "arm_distance": c.arm_distance} for c in cells]}
    return json.dumps(clean(data), indent=1)


def plot(cells: list[Cell], path: str | Path, title: str = "simulator fidelity") -> Path:
    """Simulated against live, one panel per metric, every per-class cell a point (marker by
    policy kind), with y = x and the goal's band; on the median panels a horizontal bar is the
    live median's bootstrap interval (``SideMetrics.noise``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    per_class = [c for c in cells if c.request_class != ALL]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 4.2))
    scale = {"throughput": 1.0}
    for ax, m in zip(axes, METRICS):
        s = scale.get(m, 1e3)
        for adaptive, marker, label in ((False, "s", "static"), (True, "o", "adaptive")):
            pts = [c for c in per_class
                   if c.adaptive == adaptive and not math.isnan(c.live.value(m)) and not math.isnan(c.sim.value(m))]
            if pts:
                x = np.array([c.live.value(m) * s for c in pts])
                y = np.array([c.sim.value(m) * s for c in pts])
                sc = ax.scatter(x, y, marker=marker, s=18, alpha=0.75, label=label)
                band = np.array([c.live.noise.get(m, (math.nan, math.nan)) for c in pts], dtype=float) * s
                if m in NOISE_METRICS and not np.isnan(band).all():
                    # the live median's bootstrap interval, horizontal: where another live sample could land
                    xerr = np.nan_to_num(np.abs(np.stack([x - band[:, 0], band[:, 1] - x])))
                    ax.errorbar(x, y, xerr=xerr, fmt="none", ecolor=sc.get_facecolor()[0], alpha=0.35, lw=0.8)
        vals = [v * s for c in per_class for v in (c.live.value(m), c.sim.value(m)) if not math.isnan(v) and v > 0]
        if vals:
            lo, hi = min(vals) * 0.8, max(vals) * 1.25
            xs = np.array([lo, hi])
            ax.plot(xs, xs, "k-", lw=0.8)
            band = BOUNDS.get(m)
            if band:
                ax.fill_between(xs, xs * (1 - band), xs * (1 + band), color="green", alpha=0.12,
                                label=f"+-{100 * band:.0f}% (goal)")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            if hi / lo > 20:
                ax.set_xscale("log")
                ax.set_yscale("log")
                for axis in (ax.xaxis, ax.yaxis):  # the minor ticks' labels overlap on a short log range
                    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        unit = "tok/s" if m == "throughput" else "ms"
        ax.set(xlabel=f"live {m} ({unit})", ylabel=f"simulated {m} ({unit})", title=m)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the simulated side of a level ---------------------------------------------------------------
def rows_from_sim(requests, recorder, class_names: list[str]) -> list[Row]:
    rows = []
    for i in range(len(requests)):
        rows.append(Row(class_names[int(requests.class_idx[i])], float(requests.arrival_s[i]),
                        float(recorder.first_token_s[i]), float(recorder.finish_s[i]),
                        int(requests.output_tokens[i]),
                        # its class's prompt, as a live row names it; the arm steps when kept
                        prompt_index=-1 if requests.prompt_idx is None else int(requests.prompt_idx[i]),
                        arms=dict((recorder.request_arms or {}).get(i, {}))))
    return rows


def sim_arm_steps(recorder, class_names: list[str], window: tuple[float, float]) -> dict[str, dict[str, float]]:
    """Request-steps per arm and class in the bins inside ``window``."""
    from adaptspec.sim.replica import arm_key

    lo = int(math.floor(window[0] / recorder.bin_s))
    hi = max(int(math.ceil(window[1] / recorder.bin_s)), lo + 1)
    counts = recorder.arm_counts[:, lo:hi, :].sum(axis=1)  # [C, A]
    out = {}
    for c, name in enumerate(class_names):
        out[name] = {arm_key(a): float(counts[c, i]) for i, a in enumerate(recorder.arms) if counts[c, i] > 0}
    return out


class SnapshotPolicy:
    """A policy as a live replica sees it: the arm per class of a snapshot, refreshed every
    ``interval_s`` (the controller's ``report_interval_s``); at a refresh the policy learns
    from every step since the last one, then chooses every class's arm at the load of the
    latest step (``ControlCore.report``). Time is engine time: the steps' seconds and the
    host's between them (``host_gap``), so an idle engine (an open loop's quiet spells)
    refreshes later than the live one. Everything else is the policy's own."""

    def __init__(self, policy, classes: list[str], interval_s: float,
                 host_gap: tuple[float, float] = (0.0, 0.0)) -> None:
        from adaptspec.control.types import Load

        self.inner, self.classes, self.interval_s, self.host_gap = policy, list(classes), interval_s, host_gap
        self._pending: list = []
        self._elapsed = 0.0
        self._arms = dict(zip(self.classes, policy.choose_many(self.classes, Load())))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def choose_many(self, classes: list[str], load) -> list:
        missing = [c for c in classes if c not in self._arms]
        if missing:  # a class the snapshot did not hold: the controller adds it at once
            self.classes += missing
            self._arms.update(zip(missing, self.inner.choose_many(missing, load)))
        return [self._arms[c] for c in classes]

    def observe(self, outcome) -> None:
        self._pending.append(outcome)
        a, b = self.host_gap
        self._elapsed += outcome.wall_s + a + b * outcome.batch_size
        if self._elapsed >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Report the steps since the last refresh and take a new snapshot (a live run's end
        reports as well)."""
        from adaptspec.control.types import Load

        if not self._pending:
            return
        for o in self._pending:
            self.inner.observe(o)
        last = self._pending[-1]
        self._pending, self._elapsed = [], 0.0
        load = Load(max(last.batch_size, 1), last.queued, last.verify_tokens, last.context_tokens)
        self._arms = dict(zip(self.classes, self.inner.choose_many(self.classes, load)))


@dataclass(slots=True)
class SimLevel:
    """What the simulator needs to mirror one live level (a closed loop of ``clients`` with
    their think time, or open-loop arrivals at the live run's times)."""

    clients: int = 0
    think_s: float = 0.0
    think: str = "fixed"
    arrivals_s: np.ndarray | None = None  # open loop: the send times (s from the start)
    # closed loop: a reply's way back to the client and its next request's way in, on top of
    # the think time (a service path's delay, ``path_delays``; 0 in-process)
    round_trip_s: float = 0.0


def fit_host_gap(samples) -> tuple[float, float]:
    """(a, b): seconds between two engine steps, while work was left, as a + b x requests in
    the step before (least squares over ``samples`` of (requests, seconds): the mean is what
    throughput feels). b < 0, or a line below zero at one request: the mean gap alone."""
    x = np.array([r for r, _ in samples], dtype=float)
    y = np.array([g for _, g in samples], dtype=float)
    if y.size == 0:
        return 0.0, 0.0
    mean = max(float(y.mean()), 0.0)
    if y.size < 3 or np.ptp(x) == 0:
        return mean, 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0 or a + b * max(x.min(), 1.0) < 0:
        return mean, 0.0
    return float(a), float(b)


def simulate_level(level: SimLevel, *, policy, cost, truths, classes, prompt_set, warmup_s: float, duration_s: float,
                   drain_s: float, max_k: int, seed: int, bin_s: float = 0.5,
                   host_gap: tuple[float, float] = (0.0, 0.0)) -> tuple[Run, dict[str, dict[str, float]]]:
    """One simulated run of ``level`` with ``policy``: its rows and window, and arm steps per class.

    ``classes``: ``ClassSpec``s in the load test's order (their lengths come from
    ``prompt_set``, sent round-robin as the live load test sends them). ``host_gap``: the
    host's seconds between steps (``fit_host_gap``)."""
    from adaptspec.sim.closed_loop import RequestSource, simulate_closed_loop
    from adaptspec.sim.scenario import ThinkTimeSpec
    from adaptspec.sim.simulator import RunSetup, simulate
    from adaptspec.sim.workload import Requests

    names = [c.name for c in classes]
    source = RequestSource(classes, prompt_set, "round_robin", np.random.default_rng([seed, 1]))
    horizon = warmup_s + duration_s
    if level.arrivals_s is None:
        empty = Requests(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        setup = RunSetup(cost, truths, empty, 1, "least_loaded", max_k, horizon, drain_s, bin_s, seed,
                         host_gap=host_gap, record_shapes=True)
        out, req = simulate_closed_loop(setup, policy, level.clients,
                                        ThinkTimeSpec(dist=level.think, mean_s=level.think_s), source,
                                        round_trip_s=level.round_trip_s)
    else:
        t = np.asarray(level.arrivals_s, dtype=float)
        t = t[t < horizon]
        cls, p, o, pick, cached = source.take(t.size)
        req = Requests(t, p, o, cls, pick, cached)
        out = simulate(RunSetup(cost, truths, req, 1, "least_loaded", max_k, horizon, drain_s, bin_s, seed,
                                host_gap=host_gap, record_shapes=True), policy)
    window = (warmup_s, horizon)
    return (Run(rows_from_sim(req, out.recorder, names), window,
                *step_time(out.recorder.step_end, out.recorder.step_wall, window),
                shapes=step_shapes.inside(out.recorder.step_shapes or [], window)),
            sim_arm_steps(out.recorder, names, window))


def recorded_steps(recording, request_class: str, drafter: str) -> int:
    rec = recording.classes.get(request_class, {}).get(drafter)
    return int(sum(np.asarray(h).sum() for h in rec.joint.values())) if rec is not None else 0


def acceptance_source(recording, request_class: str, drafter: str) -> str | None:
    """The recorded class whose ``drafter`` acceptance ``request_class`` takes: its own, else
    the class with the most request-steps of that drafter (None: the drafter never ran)."""
    if recorded_steps(recording, request_class, drafter) > 0:
        return request_class
    best = max(recording.classes, key=lambda c: recorded_steps(recording, c, drafter), default=None)
    return best if best is not None and recorded_steps(recording, best, drafter) > 0 else None


def truths_from_recording(recording, class_names: list[str], drafters: Iterable[str], min_steps: int = 30,
                          per_prompt: bool = True, per_position: bool = True):
    """``ClassTruth`` per class from an ``AcceptanceFile`` (``acceptance_source`` says whose;
    a drafter that never ran accepts nothing). Returns the truths and a note per fallback.
    ``per_prompt``: keep the recording's per-prompt counts (a class's own only: another
    class's prompt indices name other prompts); ``per_position``: and its per-position trace."""
    from adaptspec.sim.acceptance import BernoulliAcceptance
    from adaptspec.sim.acceptance_replay import RecordedAcceptance
    from adaptspec.sim.replica import ClassTruth

    notes = []
    truths = []
    for name in class_names:
        acc = {}
        for d in drafters:
            src = acceptance_source(recording, name, d)
            if src is None:
                acc[d] = BernoulliAcceptance(0.0)
                notes.append(f"{name}/{d}: {d} never ran live; acceptance 0")
                continue
            acc[d] = RecordedAcceptance.from_record(recording.classes[src][d], min_steps, per_prompt and src == name,
                                                    per_position)
            if src != name:
                notes.append(f"{name}/{d}: not recorded; {src}'s {d} acceptance instead")
        truths.append(ClassTruth(name, acc))
    return truths, notes
