"""Reports of a scenario's runs: text tables, JSON, PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import asdict
from pathlib import Path

from adaptspec.sim.metrics import RunMetrics
from adaptspec.sim.runner import ScenarioResult

ADAPTIVE = ("thompson", "ucb", "ucb-window", "oracle", "oracle-planner", "ema", "heuristic", "vllm-schedule",
            "vllm-adaptive", "vllm-adaptive-k4", "thompson-no-stopping", "thompson-no-admission",
            "thompson-no-pacing")


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:.1f}"


def _level(r: RunMetrics) -> str:
    """The load column: the rate, or a closed loop's client count."""
    if r.clients is not None:
        return f"{r.clients} cl."
    return "-" if r.rate_rps is None else f"{r.rate_rps:g}"


def table_rows(runs: list[RunMetrics]) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "rps", "goodput", "SLO %", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
            "ITL p50 ms", "E2E p50 s", "acc len", "decide us"]
    rows = []
    for r in runs:
        rows.append([
            r.policy, _level(r), f"{r.goodput_rps:.2f}",
            f"{100 * r.slo_attainment:.1f}", f"{r.request_throughput:.2f}", f"{r.output_token_throughput:.0f}",
            f"{_ms(r.ttft.p50)}/{_ms(r.ttft.p99)}", f"{_ms(r.tpot.p50)}/{_ms(r.tpot.p99)}", _ms(r.itl.p50),
            "-" if math.isnan(r.e2e.p50) else f"{r.e2e.p50:.2f}", f"{r.mean_accepted_length:.2f}",
            f"{r.decision_us_mean:.1f}"])
    return head, rows


def class_rows(runs: list[RunMetrics]) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "rps", "class", "goodput", "SLO %", "TPOT p50/p99 ms", "acc len", "top arms"]
    rows = []
    for r in runs:
        for c in r.classes:
            arms = ", ".join(f"{a} {100 * s:.0f}%" for a, s in c.arm_share[:3])
            rows.append([r.policy, _level(r), c.name, f"{c.goodput_rps:.2f}",
                         f"{100 * c.slo_attainment:.1f}", f"{_ms(c.tpot.p50)}/{_ms(c.tpot.p99)}",
                         f"{c.mean_accepted_length:.2f}", arms])
    return head, rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def write_json(result: ScenarioResult, path: str | Path) -> None:
    """The result as JSON; gzipped where ``path`` ends in ``.gz`` (a sweep's runs with their
    timelines take megabytes, a tenth of that gzipped)."""
    data = {"scenario": result.scenario, "policy_notes": result.policy_notes,
            "runs": [asdict(r) for r in result.runs]}
    write_json_file(data, path)


def write_json_file(data: dict, path: str | Path) -> None:
    """``data`` as indented JSON at ``path``, gzipped where the name ends in ``.gz``."""
    text = json.dumps(data, indent=1, default=lambda x: None)
    if str(path).endswith(".gz"):
        Path(path).write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        Path(path).write_text(text)


def read_json_file(path: str | Path) -> dict:
    """What ``write_json_file`` wrote (gzipped or not, by the name)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)


def plot(result: ScenarioResult, folder: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = result.scenario
    written = []
    runs = result.runs
    policies = list(dict.fromkeys(r.policy for r in runs))
    rates = sorted({r.rate_rps for r in runs if r.rate_rps is not None})
    if len(rates) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for p in policies:
            pr = sorted((r for r in runs if r.policy == p), key=lambda r: r.rate_rps)
            style = "-" if p in ADAPTIVE else "--"
            axes[0].plot([r.rate_rps for r in pr], [r.goodput_rps for r in pr], style, marker="o", ms=3, label=p)
            axes[1].plot([r.rate_rps for r in pr], [r.output_token_throughput for r in pr], style, marker="o", ms=3, label=p)
        axes[0].set(xlabel="offered load (requests/s)", ylabel="goodput (requests/s meeting SLOs)", title="goodput")
        axes[1].set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="token throughput")
        axes[0].legend(fontsize=7)
        fig.suptitle(name)
        fig.tight_layout()
        written.append(_save(fig, folder / f"{name}-goodput.png"))
    # chosen k over time per class, at the highest rate, for adaptive policies
    top = max(rates) if rates else None
    sel = [r for r in runs if r.rate_rps == top and r.policy in ADAPTIVE]
    if sel:
        classes = list(sel[0].timeline_k)
        fig, axes = plt.subplots(1, len(classes), figsize=(4.5 * len(classes), 3.8), squeeze=False)
        for ax, c in zip(axes[0], classes):
            for r in sel:
                ax.plot(r.timeline_s, [math.nan if v is None else v for v in r.timeline_k[c]], label=r.policy)
            ax.set(xlabel="simulated time (s)", ylabel="mean chosen k", title=c)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{name}: chosen k over time" + (f" at {top:g} rps" if top else ""))
        fig.tight_layout()
        written.append(_save(fig, folder / f"{name}-k-over-time.png"))
    sel = [r for r in runs if r.rate_rps == top]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in sel:
        q = list(range(101))
        if r.tpot_quantiles:
            axes[0].plot([x * 1e3 for x in r.tpot_quantiles], q, label=r.policy)
        if r.ttft_quantiles:
            axes[1].plot([x * 1e3 for x in r.ttft_quantiles], q, label=r.policy)
    axes[0].set(xlabel="TPOT (ms)", ylabel="percentile", title="TPOT CDF")
    axes[1].set(xlabel="TTFT (ms)", ylabel="percentile", title="TTFT CDF", xscale="log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: latency CDFs" + (f" at {top:g} rps" if top else ""))
    fig.tight_layout()
    written.append(_save(fig, folder / f"{name}-latency-cdf.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
