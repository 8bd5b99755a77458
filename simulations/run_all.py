"""Run every scenario of this folder for seeds 0-2; write results/<scenario>.seed<N>.json.gz.

    nice -n 19 .venv/bin/python simulations/run_all.py [--seeds 0,1,2] [--only name,...] [--force]
    nice -n 19 .venv/bin/python simulations/run_all.py --kinds thompson   # re-run one policy kind
    .venv/bin/python simulations/run_all.py --plots-only [--only name,...]  # redraw figures from the JSON

Resumable: a (scenario, seed) whose JSON exists is skipped unless --force. The figures are
drawn from seed 0. One scenario at a time, one process: these runs share a 2-core machine.
``--kinds`` re-runs only the policies of those kinds (after a change to one policy: every
other policy's runs do not depend on it) and replaces their runs in the existing JSON (and
redraws the figures from it).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the speed check is one simulated hour of one policy: it measures the simulator, one seed says that
ONE_SEED = {"speed_hour_20rps"}


def splice(target: Path, new: dict) -> None:
    """Replace ``target``'s runs of the same (policy, level) by ``new``'s."""
    from adaptspec.sim.report import read_json_file, write_json_file

    old = read_json_file(target)
    key = lambda r: (r["policy"], r.get("rate_rps"), r.get("clients"))  # noqa: E731
    fresh = {key(r): r for r in new["runs"]}
    old["runs"] = [fresh.pop(key(r), r) for r in old["runs"]]
    if fresh:
        raise SystemExit(f"{target.name}: runs not in the old results: {sorted(map(str, fresh))[:3]}")
    old["policy_notes"].update(new.get("policy_notes", {}))
    write_json_file(old, target)


def replot(target: Path) -> None:
    """Redraw a scenario's figures from its results JSON (``plot`` reads the runs' fields only)."""
    from types import SimpleNamespace

    from adaptspec.sim.report import plot, read_json_file

    data = read_json_file(target)
    plot(SimpleNamespace(scenario=data["scenario"], runs=[SimpleNamespace(**r) for r in data["runs"]]),
         HERE / "figures")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--only", default="")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--kinds", default="", help="re-run only these policy kinds, spliced into the existing JSON")
    ap.add_argument("--plots-only", action="store_true", help="redraw the figures from the results JSON (first seed)")
    args = ap.parse_args()
    from adaptspec.sim.report import plot, write_json
    from adaptspec.sim.runner import policy_label, run_scenario
    from adaptspec.sim.scenario import load_scenario

    seeds = [int(s) for s in args.seeds.split(",")]
    only = set(filter(None, args.only.split(",")))
    kinds = set(filter(None, args.kinds.split(",")))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    for path in sorted(HERE.glob("*.yaml")):
        name = path.stem
        if only and name not in only:
            continue
        if args.plots_only:
            target = out / f"{name}.seed{seeds[0]}.json.gz"
            if target.exists():
                replot(target)
                print(f"{name}: figures redrawn from {target.name}", flush=True)
            continue
        sc, base = load_scenario(path)
        only_labels = None
        if kinds:
            # run only these, but keep the scenario's policy list whole: the oracle's candidates
            # are the scenario's static assignments (a list cut to the kinds left it none to beat)
            only_labels = [policy_label(p) for p in sc.policies if p.kind in kinds]
            if not only_labels or name in ONE_SEED:
                continue
        for seed in seeds[:1] if name in ONE_SEED else seeds:
            target = out / f"{name}.seed{seed}.json.gz"
            if kinds:
                if not target.exists():
                    print(f"{name} seed {seed}: no results to splice into (run it whole first)", flush=True)
                    continue
            elif target.exists() and not args.force:
                continue
            t0 = time.time()
            try:
                res = run_scenario(sc, base, only=only_labels, seed=seed)
            except ValueError as exc:  # e.g. the trace replay without ../shared
                print(f"{name} seed {seed}: skipped ({exc})", flush=True)
                break
            if kinds:
                with tempfile.TemporaryDirectory() as tmp:
                    write_json(res, Path(tmp) / "new.json")
                    splice(target, json.loads((Path(tmp) / "new.json").read_text()))
                if seed == seeds[0]:
                    replot(target)
                print(f"{name} seed {seed}: {len(res.runs)} runs replaced in {time.time() - t0:.0f} s", flush=True)
                continue
            write_json(res, target)
            if seed == seeds[0]:
                plot(res, HERE / "figures")
            print(f"{name} seed {seed}: {len(res.runs)} runs in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
