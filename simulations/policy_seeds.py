"""How much one policy's goodput moves with its own random draws alone.

    .venv/bin/python simulations/policy_seeds.py simulations/interactive_batch_high.yaml \
        --policy thompson --cells 0:7,0:7.5,2:7 --draws 5 [--tpot-class interactive] [--json out.json]

A cell is (scenario seed, request rate; ``-`` for a scenario without a sweep). Every run of a
cell sees the same requests and acceptance draws (the scenario seed's); only the policy's own
seed differs (the first run's is the scenario seed, as in ``run_all.py``, so it reproduces the
stored result). A thompson run of a cell near its SLOs' edge moves by a percent or two with its
posterior draws, so a single cell near a goal's threshold says little on its own; this prints
each cell's runs and their mean (and, with ``--tpot-class``, the share of that class's tokens
within its TPOT target in each run). A benchmark that prints numbers, not a test.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def parse_cells(text: str) -> list[tuple[int, float | None]]:
    cells = []
    for part in filter(None, text.split(",")):
        seed, _, rate = part.partition(":")
        try:
            cells.append((int(seed), None if rate in ("", "-") else float(rate)))
        except ValueError:
            raise SystemExit(f"--cells: {part!r} is not SEED:RATE (RATE a number, or - for no sweep)") from None
    if not cells:
        raise SystemExit("--cells: give at least one SEED:RATE")
    return cells


def run_cells(sc, base: Path, label: str, cells: list[tuple[int, float | None]], draws: int,
              progress=print, tpot_class: str | None = None,
              tpot_tokens: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """{"seed:rate": [goodput of each draw]} for the policy ``label`` of scenario ``sc``; with
    ``tpot_class``, ``tpot_tokens`` (if given) is filled with {"seed:rate": [share of that
    class's tokens within its TPOT target, each draw]}."""
    from adaptspec.sim.runner import policy_label, run_scenario

    if label not in [policy_label(p) for p in sc.policies]:
        raise SystemExit(f"--policy: {label!r} not in the scenario's policies {[policy_label(p) for p in sc.policies]}")
    if tpot_class is not None and tpot_class not in [c.name for c in sc.classes]:
        raise SystemExit(f"--tpot-class: {tpot_class!r} not in the scenario's classes {[c.name for c in sc.classes]}")
    out: dict[str, list[float]] = {}
    for seed, rate in cells:
        if rate is None and sc.sweep is not None:
            raise SystemExit(f"--cells: the scenario sweeps {sc.sweep.rps} req/s; give a rate for seed {seed}")
        if rate is not None and sc.sweep is None:
            raise SystemExit(f"--cells: the scenario has no sweep; give - as the rate for seed {seed}")
        one = sc if rate is None else sc.model_copy(update={"sweep": sc.sweep.model_copy(update={"rps": [rate]})})
        runs = [run_scenario(one, base, only=[label], seed=seed,
                             policy_seed=seed if d == 0 else seed * 1000 + d).runs[0] for d in range(draws)]
        goodput = [r.goodput_rps for r in runs]
        key = f"{seed}:{'-' if rate is None else f'{rate:g}'}"
        out[key] = goodput
        # 4 significant digits: a CPU scenario's cells are ~0.005 req/s
        line = (f"seed {seed} rate {'-' if rate is None else f'{rate:g}'}: "
                + " ".join(f"{g:.4g}" for g in goodput) + f"  mean {np.mean(goodput):.4g}  "
                f"spread {(max(goodput) - min(goodput)) / max(np.mean(goodput), 1e-9):.1%}")
        if tpot_class is not None:
            share = [next(c.tpot_token_attainment for c in r.classes if c.name == tpot_class) for r in runs]
            if None in share:
                raise SystemExit(f"--tpot-class: {tpot_class!r} has no TPOT target in this scenario")
            if tpot_tokens is not None:
                tpot_tokens[key] = share
            line += f"; {tpot_class} tokens within TPOT: " + " ".join(f"{a:.2%}" for a in share) + \
                f"  mean {np.mean(share):.2%}"
        progress(line)
    return out


def main(argv: list[str] | None = None) -> int:
    from adaptspec.sim.scenario import load_scenario

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--policy", default="thompson", help="the policy's label in the scenario")
    ap.add_argument("--cells", required=True, help="SEED:RATE,... (RATE - for a scenario without a sweep)")
    ap.add_argument("--draws", type=int, default=5, help="runs per cell, each with its own policy seed")
    ap.add_argument("--tpot-class", help="also print this class's share of tokens within its TPOT target")
    ap.add_argument("--json", type=Path, help="write {cell: [goodput, ...]} here ({\"goodput\": {...}, "
                    "\"tpot_tokens\": {...}} with --tpot-class)")
    a = ap.parse_args(argv)
    if a.draws < 1:
        raise SystemExit("--draws: must be >= 1")
    sc, base = load_scenario(a.scenario)
    shares: dict[str, list[float]] = {}
    out = run_cells(sc, base, a.policy, parse_cells(a.cells), a.draws, progress=lambda s: print(s, flush=True),
                    tpot_class=a.tpot_class, tpot_tokens=shares)
    if a.json is not None:
        both = {"goodput": out, "tpot_tokens": shares}
        a.json.write_text(json.dumps(out if a.tpot_class is None else both, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
