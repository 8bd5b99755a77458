"""Replay a fidelity run's live engine steps into the online step-cost model, as the live
adaptive policy met them level by level, and price held-out live steps with what it learned.

Why: the live controller learns its step costs from the steps it sees, which a simulation
does not reproduce (its steps are priced by the profile it learns toward). A fidelity run logs
every live step's shape and time (``live_runs.json.gz``), so the learned model can be checked
against the live steps themselves: the price it gives a step over the price it took.

    python simulations/cost_replay.py docs/results/2026-12-05-warm-calibration/live-50s

Learns from the in-process path's ``--learn-policy`` runs at 1, 4 and 16 clients in that
order (every step, prompt chunks included, as the live controller sees them), seeded with the
run's calibration as the service seeds it; then prices the gRPC path's decode steps at 16
clients (every policy), in bins of verified tokens; and prints what four more verified tokens
add to a step of 16 at that level's context, learned and by the profile.

    python simulations/cost_replay.py --checkpoint docs/results/2026-12-05-live-goal-own/checkpoints/c16.pkl \
        --profile docs/results/2026-12-05-live-goal-own/profile.json

reads what a live controller's checkpoint (``controller.checkpoint``) learned instead: the
weight its fit gives the profile's curve (1 where it keeps the profile's steps) and the same
four-token rise. ``--plan-ms`` times a plan of three classes with that profile as the prior,
after 600 steps with prompt chunks.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from adaptspec.control.costmodel import OnlineStepCost
from adaptspec.control.costs import ProfileCostModel
from adaptspec.control.types import StepOutcome

K = 8  # the controller's max_k (draft positions of a step's shape)
BINS = ((10, 14), (15, 16), (17, 20), (21, 32), (33, 48), (49, 80))


def shapes(runs: list, policy: str | None, level: str, prompts: bool) -> list:
    """Step shapes (``sim.step_shapes``) of the runs of ``policy`` (None: every one) at ``level``."""
    out = []
    for r in runs:
        if (policy is None or r["policy"] == policy) and r["level"] == level:
            out += [s for s in r["shapes"] if s[1] + s[2] > 0 and (prompts or s[2] == 0)]
    return out


def draft_batch(s: list) -> np.ndarray:
    d = np.zeros(K)
    x = s[9:9 + K]
    d[:len(x)] = x
    return d


def outcome(s: list) -> StepOutcome:
    """A shape as the controller's step outcome (``StepOutcome.from_step_stats``'s convention:
    verify tokens and seconds are the whole forward, prompt chunks included)."""
    return StepOutcome(batch_size=s[1], num_prefill=s[2], verify_tokens=s[3] + s[2], context_tokens=s[4],
                       draft_s=s[6], verify_s=s[7], other_s=s[8], wall_s=s[6] + s[7] + s[8],
                       prefill_chunks=int(s[2] > 0))


def price(model, V: np.ndarray, ctx: np.ndarray, D: np.ndarray, G: np.ndarray, n: np.ndarray) -> np.ndarray:
    return np.asarray(model.step_time(V, ctx, D, G, ctx / np.maximum(n, 1)), dtype=float)


def replay(folder: Path, learn_policy: str = "thompson") -> dict:
    """{"learned": steps learned from, "priced": steps priced, "bins": [(lo, hi, steps, learned / live,
    profile / live)], "four_more": (learned, profile) relative rise of a step of 16 by 4 tokens}."""
    prof = ProfileCostModel.load(folder / "profile.json")
    live = json.load(gzip.open(folder / "live_runs.json.gz"))["live"]
    model = OnlineStepCost()
    model.seed_from(prof, max_k=K)
    seen = 0
    for level in ("c=1", "c=4", "c=16"):
        for s in shapes(live["in-process"], learn_policy, level, prompts=True):
            model.observe(outcome(s), draft_batch(s), s[5], s[4] / max(s[1], 1))
            seen += 1
    test = shapes(live["grpc"], None, "c=16", prompts=False)
    if not seen or not test:
        raise ValueError(f"{folder}: no in-process {learn_policy} steps or no gRPC steps at 16 clients")
    V = np.array([s[3] for s in test], dtype=float)
    ctx = np.array([s[4] for s in test], dtype=float)
    n = np.array([s[1] for s in test], dtype=float)
    D = np.array([draft_batch(s) for s in test])
    G = np.array([s[5] for s in test], dtype=float)
    took = np.array([s[6] + s[7] + s[8] for s in test])
    learned, profiled = price(model, V, ctx, D, G, n), price(prof, V, ctx, D, G, n)
    bins = []
    for lo, hi in BINS:
        m = (V >= lo) & (V <= hi)
        if m.sum() >= 5:
            bins.append((lo, hi, int(m.sum()), float(np.median(learned[m] / took[m])),
                         float(np.median(profiled[m] / took[m]))))
    c = float(np.median(ctx[(V >= 15) & (V <= 16)])) if ((V >= 15) & (V <= 16)).any() else 16 * 200.0
    q = np.array([16.0, 20.0])
    z = (q, np.full(2, c), np.zeros((2, K)), np.zeros(2), np.full(2, 16.0))
    a, b = price(model, *z), price(prof, *z)
    return {"learned": seen, "priced": len(test), "bins": bins, "context": c,
            "four_more": (float(a[1] / a[0] - 1), float(b[1] / b[0] - 1))}


def checkpoint_cost(path: Path, profile: Path, context: float = 3200.0) -> dict:
    """{"shape_weight", "four_more": (learned, profile)} of the thompson policy a controller
    checkpoint holds (pickled by this project's controller; read the coefficients as laid out
    by the code that wrote it: the curve's columns first, then the context's)."""
    import pickle

    pol = pickle.loads(Path(path).read_bytes())["policies"]["thompson"]  # noqa: S301 - our own file
    cost = pol.cost
    v = cost.verify.coef()
    nb = cost._basis.shape[1]
    q = np.array([16.0, 20.0])
    # the fit's curve and its context term (the prompt column is last, the context's before it);
    # plain steps: a drafted tokens' column adds nothing, and the local correction is left out
    learned = np.interp(q, cost._xs, cost._basis @ v[:nb]) + v[-2] * 1e-6 * context + cost.other_s
    prof = ProfileCostModel.load(profile)
    truth = price(prof, q, np.full(2, context), np.zeros((2, K)), np.zeros(2), np.full(2, 16.0))
    return {"shape_weight": float(v[nb - 1]) if cost._shape is not None else None,
            "four_more": (float(learned[1] / learned[0] - 1), float(truth[1] / truth[0] - 1))}


def plan_ms(profile: Path, plans: int = 30) -> float:
    """Median milliseconds of a plan of three classes by thompson seeded with ``profile``,
    after 600 synthetic steps of 15 requests, a third with a 24-token prompt chunk."""
    import time

    from adaptspec.control import Load
    from adaptspec.control.base import PolicyConfig
    from adaptspec.control.thompson import ModelBasedThompson
    from adaptspec.control.types import Arm, GroupOutcome

    pol = ModelBasedThompson(PolicyConfig(("ngram", "draft"), K, (), 0, (), 16, 2560),
                             prior_cost=ProfileCostModel.load(profile))
    rng = np.random.default_rng(0)
    classes = ["chat", "code_edit", "extraction"]
    for i in range(600):
        groups = []
        for c in classes:
            hist = np.bincount(rng.integers(0, 2, 5), minlength=2)
            groups.append(GroupOutcome(c, Arm("ngram", 1), hist, int(hist @ np.arange(2)) + 5, 5, -1))
        p = 24 if i % 3 == 0 else 0
        pol.observe(StepOutcome(15, p, 20 + p, 3000, 0.0, 0.06, 0.003, 0.063, groups, prefill_chunks=int(p > 0)))
        pol.choose_many(classes, Load())
    took = []
    for _ in range(plans):
        pol._planned_at = -np.inf  # the next decision plans
        t0 = time.perf_counter()
        pol.choose_many(classes, Load())
        took.append(time.perf_counter() - t0)
    return 1000 * float(np.median(took))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, nargs="?", help="a fidelity run's folder (profile.json, live_runs.json.gz)")
    ap.add_argument("--learn-policy", default="thompson", help="whose live steps the model learns from")
    ap.add_argument("--checkpoint", type=Path, help="a controller checkpoint to read instead (needs --profile)")
    ap.add_argument("--profile", type=Path, help="the profile the checkpoint's controller was seeded with")
    ap.add_argument("--plan-ms", action="store_true", help="also time a plan with --profile as the prior")
    args = ap.parse_args()
    if args.checkpoint or args.plan_ms:
        if args.profile is None:
            raise SystemExit("error: --profile: needed with --checkpoint and --plan-ms")
        if args.checkpoint:
            r = checkpoint_cost(args.checkpoint, args.profile)
            a, b = r["four_more"]
            print(f"{args.checkpoint}: weight of the profile's curve {r['shape_weight']}; four more verified tokens "
                  f"on a step of 16: learned +{100 * a:.1f}%, profile +{100 * b:.1f}%")
        if args.plan_ms:
            print(f"a plan of three classes: {plan_ms(args.profile):.2f} ms (median of 30)")
        return
    if args.folder is None:
        raise SystemExit("error: folder: a fidelity run's folder (or --checkpoint / --plan-ms)")
    try:
        r = replay(args.folder, args.learn_policy)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"learned from {r['learned']} live steps ({args.learn_policy}, in-process, 1 -> 4 -> 16 clients); "
          f"priced {r['priced']} decode steps of the gRPC path at 16 clients")
    print("| verified tokens | steps | learned / live (median) | profile / live (median) |")
    print("|---|---|---|---|")
    for lo, hi, m, a, b in r["bins"]:
        print(f"| {lo}-{hi} | {m} | {a:.3f} | {b:.3f} |")
    a, b = r["four_more"]
    print(f"four more verified tokens on a step of 16 (context {r['context']:.0f}): learned +{100 * a:.1f}%, "
          f"profile +{100 * b:.1f}%")


if __name__ == "__main__":
    main()
