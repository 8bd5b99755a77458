"""Engine steps by shape, live and simulated: where a step-time error comes from.

A fidelity level's mean step can be off for two reasons: the profile prices a step of a given
shape (requests decoding, tokens verified, prompt tokens, draft forwards) wrongly, or the
simulated run has another mix of shapes (more overlap, bigger batches). The mean step alone
cannot tell them apart. Both sides log every step's shape and its time by phase; the live
steps are then priced again on the very profile the simulation used (``reprice``): live
measured against live re-priced is the profile's error on the live shapes, and the shape
counts live against simulated are the mix's.

A shape is one list (``FIELDS``, then the draft batch per position)."""
from __future__ import annotations

import math
import time

import numpy as np

FIELDS = ("end_s", "decoding", "prompt_tokens", "decode_tokens", "context", "ngram",
          "draft_s", "forward_s", "other_s")
_N = len(FIELDS)

# (label, lowest decoding requests, highest) in the table
BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 10**9))


def from_step(st, end_s: float) -> list:
    """The shape of a live engine step (``engine.stats.StepStats``). Draft forwards per request
    are its k asked for (clamped to its tokens left), as the simulator charges them; n-gram
    lookups count every other drafter asked for candidates."""
    forwards = [r.k for r in st.requests if r.drafter == "draft" and r.k > 0]
    ngram = sum(1 for r in st.requests if r.drafter not in ("draft", "none") and r.k > 0)
    context = int(st.context_tokens)
    return [end_s, int(st.batch_size), int(st.prefill_tokens), int(st.verify_tokens), context, ngram,
            float(st.draft_s), float(st.prefill_s + st.verify_s), float(st.other_s), *draft_batch(forwards)]


def record(st) -> tuple:
    """What a fidelity run keeps of a live engine step (``StepStats``): (its end on the host's
    perf_counter, its wall seconds, rows in it, whether the engine had work left after it, its
    shape). Picklable and a few dozen numbers, so a service replica can log it for a client."""
    end = st.end_s or time.perf_counter()
    return end, float(st.wall_s), int(st.batch_size) + int(st.num_prefill), st.unfinished > 0, from_step(st, end)


def draft_batch(forwards) -> list[int]:
    """Requests running a draft forward at each position, from each request's forwards."""
    f = np.asarray(list(forwards), dtype=np.int64)
    if f.size == 0 or f.max(initial=0) <= 0:
        return []
    return [int((f > j).sum()) for j in range(int(f.max()))]


def inside(shapes: list, window: tuple[float, float]) -> list:
    """The shapes of the steps that ended inside ``window`` (as ``fidelity.step_time`` counts)."""
    return [s for s in shapes if window[0] <= s[0] <= window[1]]


def reprice(shape, cost) -> tuple[float, float, float]:
    """(draft, forward, other) seconds ``cost`` (a ``ProfileCostModel``) gives this shape,
    priced as the simulated replica prices its steps."""
    decoding, prompt, decode, context, ngram = (int(x) for x in shape[1:6])
    batch = np.asarray(shape[_N:], dtype=float)
    mean_ctx = context / decoding if decoding else 0.0
    t = cost.step(decode + prompt, context, batch, ngram, mean_ctx, prompt_tokens=prompt, requests=decoding)
    return t.draft_s, t.verify_s, t.other_s


_LABELS = [str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+") for lo, hi in BUCKETS]


def bucket_of(decoding: int) -> int:
    """The index in ``BUCKETS`` of a step with ``decoding`` requests decoding."""
    return next(i for i, (lo, hi) in enumerate(BUCKETS) if lo <= decoding <= hi)


def table(live: list, sim: list, cost_of=None) -> list[dict]:
    """Rows by (decoding requests bucket, prompt in the step or not) plus an "all" row:
    {decoding, prompt, live_n, live_ms, live_draft_ms, live_forward_ms, live_other_ms,
    repriced_ms (+ its phases), sim_n, sim_ms (+ phases), share_live, share_sim}.
    ``live``/``sim``: lists of runs' shapes [[shape]]; ``cost_of(i)``: the cost model live run
    i's steps are priced on (None: not re-priced)."""
    sides = ("live", "repriced", "sim")
    groups: dict = {}  # (bucket, prompt) -> {side: [(draft, forward, other) seconds]}
    for side, runs in (("live", live), ("sim", sim)):
        for i, shapes in enumerate(runs):
            cost = cost_of(i) if side == "live" and cost_of is not None else None
            for s in shapes:
                g = groups.setdefault((bucket_of(int(s[1])), bool(s[2] > 0)), {x: [] for x in sides})
                g[side].append(s[6:9])
                if side == "live":
                    g["repriced"].append(reprice(s, cost) if cost is not None else (math.nan,) * 3)
    total = {x: [v for g in groups.values() for v in g[x]] for x in sides}
    n_live, n_sim = max(len(total["live"]), 1), max(len(total["sim"]), 1)
    result = []
    for (b, prompt), g in [*sorted(groups.items()), ((None, None), total)]:
        row = {"decoding": "all" if b is None else _LABELS[b], "prompt": prompt, "live_n": len(g["live"]),
               "sim_n": len(g["sim"]), "share_live": len(g["live"]) / n_live, "share_sim": len(g["sim"]) / n_sim}
        for side in sides:
            a = np.asarray(g[side], dtype=float).reshape(-1, 3)
            m = a.mean(axis=0) * 1e3 if a.size else np.full(3, math.nan)
            row[f"{side}_ms"] = float(m.sum())
            row[f"{side}_draft_ms"], row[f"{side}_forward_ms"], row[f"{side}_other_ms"] = (float(x) for x in m)
        result.append(row)
    return result


def markdown(tables: dict) -> str:
    """``{(path, policy, level): table rows}`` as a Markdown report."""
    def f(x, nd=1):
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"

    def err(a, b):
        return "-" if not (math.isfinite(a) and math.isfinite(b) and b > 0) else f"{(a / b - 1) * 100:+.1f}%"

    lines = ["# Engine steps by shape, live and simulated", "",
             "Per level: steps by requests decoding and whether a prompt chunk rode along. *live*: the "
             "engine's measured step (draft / forward / other ms); *priced*: the same live steps priced "
             "on the simulation's profile (its error is the profile's, on the live shapes); *sim*: the "
             "simulated steps of that shape. The shares say how the mix of shapes differs.", ""]
    head = ("| decoding | prompt | share live/sim | live ms (draft/fwd/other) | priced ms (draft/fwd/other) "
            "| priced err | sim ms | steps sim/live |")
    for (path, policy, level), rows in tables.items():
        lines += [f"## {path}, {policy}, {level}", "", head, "|" + "---|" * 8]
        for r in rows:
            p = "-" if r["prompt"] is None else ("yes" if r["prompt"] else "no")
            lines.append(
                f"| {r['decoding']} | {p} | {r['share_live']:.0%}/{r['share_sim']:.0%} "
                f"| {f(r['live_ms'])} ({f(r['live_draft_ms'])}/{f(r['live_forward_ms'])}/{f(r['live_other_ms'])}) "
                f"| {f(r['repriced_ms'])} ({f(r['repriced_draft_ms'])}/{f(r['repriced_forward_ms'])}/"
                f"{f(r['repriced_other_ms'])}) | {err(r['repriced_ms'], r['live_ms'])} | {f(r['sim_ms'])} "
                f"| {r['sim_n']}/{r['live_n']} |")
        lines.append("")
    return "\n".join(lines)
