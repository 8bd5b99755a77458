"""The live service against itself: each cell's two live rounds, the sample median against the
Harrell-Davis one.

For every (path, policy, level, class) of a fidelity run with two or more live rounds, the
TPOT and TTFT p50 of round 1 and of round 2, each by both estimators (``fidelity.median``),
and how many cells' rounds lie within the fidelity goal's bound of each other (10% for TPOT,
20% for TTFT). Nothing simulated: the same service, configuration and prompts twice.

    .venv/bin/python docs/results/2026-12-04-median/rounds_against_each_other.py \
        docs/results/2026-12-03-round-trip [--show-class extraction]
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from adaptspec.sim.fidelity import BOUNDS, median
from adaptspec.sim.fidelity_run import load_live


def per_request(run, cls: str) -> tuple[list[float], list[float]]:
    """(TTFTs, TPOTs) of the requests of ``cls`` that finished in the run's window, as
    ``fidelity.side_metrics`` takes them."""
    w0, w1 = run.window
    ttft, tpot = [], []
    for r in run.rows:
        if r.request_class != cls or r.cut or r.error or r.tokens <= 0 or math.isnan(r.end_s):
            continue
        if not w0 <= r.end_s <= w1:
            continue
        ttft.append(r.first_token_s - r.start_s)
        if r.tokens > 1:
            tpot.append((r.end_s - r.first_token_s) / (r.tokens - 1))
    return ttft, tpot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a folder `adaptspec fidelity` wrote (live_runs.json[.gz])")
    ap.add_argument("--show-class", default="extraction", help="print this class's cells one by one")
    a = ap.parse_args()
    live_file = next(p for p in (a.folder / "live_runs.json.gz", a.folder / "live_runs.json") if p.is_file())
    live = load_live(live_file)
    agree = {(m, how): 0 for m in ("tpot_p50", "ttft_p50") for how in ("sample", "hd")}
    cells = 0
    shown = []
    for path, runs in live.items():
        for (policy, level), rs in runs.items():
            if len(rs) < 2:
                continue
            classes = sorted({r.request_class for r in rs[0].rows})
            for cls in classes:
                (t1, p1), (t2, p2) = per_request(rs[0], cls), per_request(rs[1], cls)
                if len(p1) < 2 or len(p2) < 2:
                    continue
                cells += 1
                for m, xs, ys in (("tpot_p50", p1, p2), ("ttft_p50", t1, t2)):
                    for how in ("sample", "hd"):
                        x, y = median(xs, how), median(ys, how)
                        agree[(m, how)] += abs(y - x) / x <= BOUNDS[m]
                if cls == a.show_class:
                    shown.append(f"| {path} | {policy} | {level} | {len(p1)} / {len(p2)} | "
                                 f"{1e3 * median(p1, 'sample'):.1f} / {1e3 * median(p2, 'sample'):.1f} | "
                                 f"{1e3 * median(p1):.1f} / {1e3 * median(p2):.1f} |")
    print(f"{cells} cells with two live rounds; rounds 1 and 2 within the goal's bound of each other:")
    for m in ("tpot_p50", "ttft_p50"):
        print(f"  {m} (within {100 * BOUNDS[m]:.0f}%): sample median {agree[(m, 'sample')]}/{cells}, "
              f"Harrell-Davis {agree[(m, 'hd')]}/{cells}")
    if shown:
        print(f"\n{a.show_class}, TPOT p50 ms of rounds 1 / 2:\n")
        print("| path | policy | level | requests | sample median | Harrell-Davis |")
        print("|---|---|---|---|---|---|")
        print("\n".join(shown))


if __name__ == "__main__":
    main()
