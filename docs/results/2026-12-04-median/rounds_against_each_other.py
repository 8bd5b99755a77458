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
from pathlib import Path

from adaptspec.sim.fidelity import BOUNDS, side_metrics
from adaptspec.sim.fidelity_run import load_live


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
                # each round's medians as the report takes them: HD, the sample median beside it
                r1, r2 = side_metrics([rs[0]], cls), side_metrics([rs[1]], cls)
                if r1.requests < 2 or r2.requests < 2:
                    continue
                cells += 1
                for m in ("tpot_p50", "ttft_p50"):
                    for how, (x, y) in (("hd", (r1.value(m), r2.value(m))),
                                        ("sample", (r1.other_p50[m], r2.other_p50[m]))):
                        agree[(m, how)] += abs(y - x) / x <= BOUNDS[m]
                if cls == a.show_class:
                    shown.append(f"| {path} | {policy} | {level} | {r1.requests} / {r2.requests} | "
                                 f"{1e3 * r1.other_p50['tpot_p50']:.1f} / {1e3 * r2.other_p50['tpot_p50']:.1f} | "
                                 f"{1e3 * r1.tpot_p50:.1f} / {1e3 * r2.tpot_p50:.1f} |")
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
