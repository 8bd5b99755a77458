"""Run every scenario of this folder for seeds 0-2; write results/<scenario>.seed<N>.json.

    nice -n 19 .venv/bin/python simulations/run_all.py [--seeds 0,1,2] [--only name,...] [--force]

Resumable: a (scenario, seed) whose JSON exists is skipped unless --force. The figures are
drawn from seed 0. One scenario at a time, one process: these runs share a 2-core machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the speed check is one simulated hour of one policy: it measures the simulator, one seed says that
ONE_SEED = {"speed_hour_20rps"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--only", default="")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    from adaptspec.sim.report import plot, write_json
    from adaptspec.sim.runner import run_scenario
    from adaptspec.sim.scenario import load_scenario

    seeds = [int(s) for s in args.seeds.split(",")]
    only = set(filter(None, args.only.split(",")))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    for path in sorted(HERE.glob("*.yaml")):
        name = path.stem
        if only and name not in only:
            continue
        sc, base = load_scenario(path)
        for seed in seeds[:1] if name in ONE_SEED else seeds:
            target = out / f"{name}.seed{seed}.json"
            if target.exists() and not args.force:
                continue
            t0 = time.time()
            try:
                res = run_scenario(sc, base, seed=seed)
            except ValueError as exc:  # e.g. the trace replay without ../shared
                print(f"{name} seed {seed}: skipped ({exc})", flush=True)
                break
            write_json(res, target)
            if seed == seeds[0]:
                plot(res, HERE / "figures")
            print(f"{name} seed {seed}: {len(res.runs)} runs in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
