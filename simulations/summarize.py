"""Print the markdown tables and goal checks of REPORT.md from simulations/results/*.json.

    .venv/bin/python simulations/summarize.py > /tmp/summary.md

Every number comes from the JSON that `adaptspec simulate ... --json` wrote; nothing here
is typed in by hand.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BANDITS = ("thompson", "ucb", "ucb-window")


def load(name: str) -> dict | None:
    p = HERE / "results" / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def table(runs: list[dict], with_rate: bool) -> str:
    head = (["rps"] if with_rate else []) + ["policy", "goodput req/s", "SLO met %", "out tok/s", "TTFT p50/p99 ms",
                                             "TPOT p50/p99 ms", "ITL p50 ms", "acc len", "decide us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        row = ([f"{r['rate_rps']:g}"] if with_rate else []) + [
            r["policy"], f"{r['goodput_rps']:.2f}", f"{100 * r['slo_attainment']:.1f}",
            f"{r['output_token_throughput']:.0f}", f"{ms(r['ttft']['p50'])}/{ms(r['ttft']['p99'])}",
            f"{ms(r['tpot']['p50'])}/{ms(r['tpot']['p99'])}", ms(r["itl"]["p50"]), f"{r['mean_accepted_length']:.2f}",
            f"{r['decision_us_mean']:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def class_table(runs: list[dict]) -> str:
    lines = ["| policy | class | goodput | SLO met % | TPOT p50/p99 ms | acc len | top arms |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        for c in r["classes"]:
            arms = ", ".join(f"{a} {100 * s:.0f}%" for a, s in c["arm_share"][:3])
            lines.append(f"| {r['policy']} | {c['name']} | {c['goodput_rps']:.2f} | {100 * c['slo_attainment']:.1f} | "
                         f"{ms(c['tpot']['p50'])}/{ms(c['tpot']['p99'])} | {c['mean_accepted_length']:.2f} | {arms} |")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def sweep_goals(d: dict) -> list[str]:
    runs = d["runs"]
    rates = sorted({r["rate_rps"] for r in runs})
    by = {(r["rate_rps"], r["policy"]): r for r in runs}
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    bandits = [p for p in policies if p in BANDITS]
    statics = [p for p in policies if p.startswith("static-")]
    out = ["| rps | oracle | thompson | ucb | best bandit / oracle | best static (goodput) |", "|---|---|---|---|---|---|"]
    worst = 1e9
    for rate in rates:
        o = by[(rate, "oracle")]["goodput_rps"]
        best_b = max(by[(rate, b)]["goodput_rps"] for b in bandits)
        bs = max(statics, key=lambda s: by[(rate, s)]["goodput_rps"])
        ratio = best_b / o if o > 0 else float("inf")
        worst = min(worst, ratio)
        out.append(f"| {rate:g} | {o:.2f} | {by[(rate, 'thompson')]['goodput_rps']:.2f} | "
                   f"{by[(rate, 'ucb')]['goodput_rps']:.2f} | {ratio:.3f} | {bs} ({by[(rate, bs)]['goodput_rps']:.2f}) |")
    mean = {p: sum(by[(r, p)]["goodput_rps"] for r in rates) / len(rates) for p in policies}
    best_static = max(statics, key=mean.get)
    best_bandit = max(bandits, key=mean.get)
    missed = {p: sum(round(by[(r, p)]["requests"] * (1 - by[(r, p)]["slo_attainment"])) for r in rates) for p in policies}
    top = rates[-1]
    none_top = by[(top, "static-none")]
    bb_top = max(bandits, key=lambda b: by[(top, b)]["goodput_rps"])
    out += [
        "",
        f"- Best bandit >= 0.97 x oracle at every level: worst ratio {worst:.3f} -> {verdict(worst >= 0.97)}.",
        f"- Best bandit >= best single static over the sweep (mean goodput over the {len(rates)} levels): "
        f"{best_bandit} {mean[best_bandit]:.4f} vs {best_static} {mean[best_static]:.4f} (requests missing an SLO "
        f"over the sweep: {missed[best_bandit]} vs {missed[best_static]}) -> "
        f"{verdict(mean[best_bandit] >= mean[best_static])}.",
        f"- At saturation ({top:g} rps) best bandit >= 0.98 x no speculation: {bb_top} goodput "
        f"{by[(top, bb_top)]['goodput_rps']:.2f} vs {none_top['goodput_rps']:.2f} "
        f"(ratio {by[(top, bb_top)]['goodput_rps'] / max(none_top['goodput_rps'], 1e-9):.2f}); token throughput "
        f"{by[(top, bb_top)]['output_token_throughput']:.0f} vs {none_top['output_token_throughput']:.0f} -> "
        f"{verdict(by[(top, bb_top)]['goodput_rps'] >= 0.98 * none_top['goodput_rps'])}.",
        "- Mean goodput over the sweep: " + ", ".join(f"{p} {mean[p]:.2f}" for p in sorted(mean, key=mean.get, reverse=True)),
    ]
    return out


def shift_lines(d: dict, cls: str = "chat", at: float = 150.0) -> list[str]:
    out = [f"Mean chosen k of `{cls}` per 5 s bin around the shift at {at:g} s (draft acceptance 0.8-0.5 -> 0.3); "
           "`draft` arms count their k, n-gram arms too:", "",
           "| policy | " + " | ".join(f"{t:+g} s" for t in (-15, -5, 5, 10, 15, 25, 45, 95)) + " |", "|---|" + "---|" * 8]
    for r in d["runs"]:
        if r["policy"].startswith("static"):
            continue
        ts = r["timeline_s"]
        ks = r["timeline_k"][cls]
        cells = []
        for dt in (-15, -5, 5, 10, 15, 25, 45, 95):
            i = min(range(len(ts)), key=lambda j: abs(ts[j] - (at + dt)))
            cells.append("-" if ks[i] is None else f"{ks[i]:.1f}")
        out.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
    return out


def overload_lines(d: dict) -> list[str]:
    out = []
    for rate in sorted({r["rate_rps"] for r in d["runs"]}):
        runs = [r for r in d["runs"] if r["rate_rps"] == rate]
        top = max(runs, key=lambda r: r["output_token_throughput"])
        none = next(r for r in runs if r["policy"] == "static-none")
        out.append(f"- {rate:g} rps: highest token throughput {top['policy']} {top['output_token_throughput']:.0f} tok/s; "
                   + ", ".join(f"{r['policy']} {r['output_token_throughput']:.0f}" for r in runs if r["policy"] in
                               ("thompson", "oracle", "static-none", "static-draft:2", "vllm-schedule"))
                   + f"; best bandit / no speculation (tokens/s) "
                   f"{max(r['output_token_throughput'] for r in runs if r['policy'] in BANDITS) / none['output_token_throughput']:.2f}")
    return out


def bursty_goals(d: dict) -> list[str]:
    g = {r["policy"]: r["goodput_rps"] for r in d["runs"]}
    best = max((b for b in g if b in BANDITS), key=g.get)
    base = [p for p in ("vllm-schedule", "ema", "heuristic") if p in g]
    ok = all(g[best] > g[p] for p in base)
    return [f"- Best bandit ({best}, {g[best]:.2f} req/s) beats " + ", ".join(f"{p} {g[p]:.2f}" for p in base)
            + f" -> {verdict(ok)}."]


def interactive_goals(d: dict) -> list[str]:
    runs = {r["policy"]: r for r in d["runs"]}

    def att(r):
        return next(c for c in r["classes"] if c["name"] == "interactive")["slo_attainment"]

    statics_ok = {p: r for p, r in runs.items() if p.startswith("static-") and att(r) >= 0.99}
    best_static = max(statics_ok, key=lambda p: statics_ok[p]["output_token_throughput"]) if statics_ok else None
    out = []
    for b in (p for p in runs if p in BANDITS):
        r = runs[b]
        thr_ok = best_static is None or r["output_token_throughput"] >= statics_ok[best_static]["output_token_throughput"]
        out.append(f"- {b}: interactive meets its TPOT target for {100 * att(r):.1f}% of requests; output tokens/s "
                   f"{r['output_token_throughput']:.0f} vs best static meeting it "
                   f"({best_static}: {statics_ok[best_static]['output_token_throughput']:.0f})" if best_static else "")
        out[-1] += f" -> {verdict(att(r) >= 0.99 and thr_ok)}."
    return out


def recover_lines(d: dict) -> list[str]:
    """draft_recovers: does thompson take the draft back once it turned good?"""
    by = {r["policy"]: r for r in d["runs"]}
    out = []
    for p in ("thompson", "thompson-no-fade", "oracle"):
        r = by.get(p)
        if r is not None:
            out.append(f"- {p}: TPOT p50 {ms(r['tpot']['p50'])} ms, accepted length {r['mean_accepted_length']:.2f}")
    t, o = by.get("thompson"), by.get("oracle")
    if t is not None and o is not None:
        ok = t["mean_accepted_length"] >= 0.8 * o["mean_accepted_length"]
        out.append(f"- thompson (evidence fading, 60 s) reaches {t['mean_accepted_length'] / o['mean_accepted_length']:.2f} "
                   f"of the oracle's accepted length -> {verdict(ok)} (>= 0.8)")
    return out


def main() -> None:
    for name in ("h100_8b_load_sweep", "h100_8b_overload", "bursty_mixed", "bursty_mixed_moderate", "class_shift",
                 "draft_recovers", "interactive_batch", "trace_replay_conv", "cpu_bench_mirror", "cpu_bench_calibrated", "speed_hour_20rps"):
        d = load(name)
        if d is None:
            print(f"\n## {name}: no results\n")
            continue
        runs = d["runs"]
        sweep = any(r["rate_rps"] is not None for r in runs)
        print(f"\n## {d['scenario']}\n")
        print(table(runs, sweep))
        if not sweep:
            print()
            print(class_table(runs))
        print()
        if name == "h100_8b_load_sweep":
            print("\n".join(sweep_goals(d)))
        elif name == "class_shift":
            print("\n".join(shift_lines(d)))
        elif name == "draft_recovers":
            print("\n".join(recover_lines(d)))
        elif name == "h100_8b_overload":
            print("\n".join(overload_lines(d)))
        elif name.startswith("bursty_mixed"):
            print("\n".join(bursty_goals(d)))
        elif name == "interactive_batch":
            print("\n".join(interactive_goals(d)))
        elif name == "speed_hour_20rps":
            for r in runs:
                print(f"- {r['policy']}: {r['simulated_s']:.0f} simulated s, {r['steps']} steps, "
                      f"{r['wall_s']:.1f} s of wall time ({1e6 * r['wall_s'] / max(r['steps'], 1):.0f} us per step) "
                      f"-> {verdict(r['wall_s'] < 60)} (< 60 s)")
        if d.get("policy_notes"):
            print()
            for p, note in d["policy_notes"].items():
                print(f"- targets, {p}: {note}")


if __name__ == "__main__":
    sys.exit(main())
