"""Run a scenario's thompson at one level, then set what it learned beside the truth.

Why: where thompson loses to a static arm and the planner fed the true models (`oracle-planner`)
does not, thompson planned on a wrong belief: acceptance or step cost. This says which. After the
run it prints the arms each class ran, the acceptance it learned beside the scenario's truth, the
learned step cost over the simulated truth at the batch the policy last saw (a plain step, one and
four drafted rows more), and the plan its posterior means make with its learned cost and with the
true one (the same acceptance: where they differ, the cost is what misleads it).

    .venv/bin/python simulations/cost_probe.py simulations/cpu_live_avx2_mirror.yaml --clients 4 --seed 0
    .venv/bin/python simulations/cost_probe.py simulations/cpu_bench_calibrated.yaml --rps 0.01 --seed 0
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

K_SHOWN = 4  # draft positions printed


def probe(path: Path, clients: int | None, rps: float | None, seed: int) -> None:
    import adaptspec.sim.runner as runner
    from adaptspec.control.planning import PlanInputs
    from adaptspec.sim.scenario import load_scenario

    sc, base = load_scenario(path)
    if sc.workload.closed_loop is None:
        if rps is None:
            raise SystemExit(f"error: --rps: {path} is open-loop (no workload.closed_loop): name the rate to run")
        if sc.sweep is not None:
            sc.sweep.rps = [rps]
        elif getattr(sc.workload.rate, "kind", None) == "constant":
            sc.workload.rate.rps = rps
        else:
            raise SystemExit(f"error: --rps: {path} has neither a sweep nor a constant rate to set")
        level = f"{rps:g} req/s"
    else:
        if rps is not None:
            raise SystemExit(f"error: --rps: {path} is closed-loop: name the level with --clients")
        clients = 4 if clients is None else clients
        sc.workload.closed_loop.clients = clients
        if sc.sweep is not None:
            sc.sweep.clients = [clients]
        level = f"{clients} clients"
    built = []
    make = runner.build_policy

    def keep(*args, **kw):  # the run builds its policy inside; keep it to read what it learned
        run = make(*args, **kw)
        built.append(run.policy)
        return run

    runner.build_policy = keep
    try:
        res = runner.run_scenario(sc, base, only=["thompson"], seed=seed)
    finally:
        runner.build_policy = make
    pol, truth = built[-1], runner.cost_model(sc, base)
    run = res.runs[0]
    print(f"{path.name}, {level}, seed {seed}: thompson {run.output_token_throughput:.2f} output tok/s")
    for c in run.classes:
        print(f"  {c.name}: " + ", ".join(f"{a} {s:.0%}" for a, s in c.arm_share[:4]))
    print("acceptance (a position's, given the ones before), learned [evidence] / truth:")
    truths = {t.name: t.at(0.0) for t in runner.class_truths(sc, base)}
    for c in pol.picture.classes:
        for d, (acc, ev) in pol.learned_acceptance(c).items():
            true = truths[c][d].position_probs(K_SHOWN) if c in truths and d in truths[c] else None
            got = " ".join(f"{a:.2f}[{e:.0f}]" for a, e in zip(acc[:K_SHOWN], ev[:K_SHOWN]))
            print(f"  {c} {d}: {got} / " + (" ".join(f"{t:.2f}" for t in true) if true is not None else "-"))
    classes = list(pol.picture.classes)
    b = sum(pol.picture.batch(c) for c in classes)
    cpr = pol.picture.context_per_request
    K = pol.config.max_k

    def cost(model, rows: float) -> float:
        return float(model.step_time(np.array([b + rows]), np.array([b * cpr]), np.zeros((1, K)), np.zeros(1), cpr)[0])

    plain = cost(pol.cost, 0), cost(truth, 0)
    print(f"step cost at the batch seen ({b:.2f} requests, {cpr:.0f} context tokens each), learned / truth:")
    print(f"  plain step {1000 * plain[0]:.1f} / {1000 * plain[1]:.1f} ms")
    for rows in (1, 4):
        add = cost(pol.cost, rows) - plain[0], cost(truth, rows) - plain[1]
        print(f"  {rows} drafted row{'s' if rows > 1 else ''} more: +{1000 * add[0]:.1f} / +{1000 * add[1]:.1f} ms")

    def plan(model) -> list[str]:
        pic = pol.picture
        x = PlanInputs(classes, pol.curves(classes, sample=False), np.array([pic.demand(c) for c in classes]),
                       pic.prefill_rate, pic.prefill_share, pic.context_per_request, False, pic.in_system,
                       np.array([pic.batch(c) for c in classes]), pic.prefill_per_step, pic.chunk_rate,
                       pic.chunk_tokens, None)
        idx = pol.planner.plan(x, model, np.array([pol.table.index(pol.plan[c]) for c in classes]))
        return [f"{c} {pol.table.arms[i]}" for c, i in zip(classes, idx)]

    print("plan on the posterior means, learned cost: " + ", ".join(plan(pol.cost)))
    print("plan on the posterior means, true cost:    " + ", ".join(plan(truth)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", type=Path, help="a scenario with a thompson policy")
    ap.add_argument("--clients", type=int, default=None, help="closed-loop clients (the level to run; default 4)")
    ap.add_argument("--rps", type=float, default=None, help="an open-loop scenario's arrival rate (the level to run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.clients is not None and args.clients < 1:
        raise SystemExit("error: --clients: must be >= 1")
    if args.rps is not None and not args.rps > 0:
        raise SystemExit("error: --rps: must be > 0")
    try:
        probe(args.scenario, args.clients, args.rps, args.seed)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
