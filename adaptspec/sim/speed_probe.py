"""Speed probes: how fast is the engine right now, against how fast it was when calibrated?

A shared machine's speed drifts from minute to minute with nothing else visibly running (a
batch-1 decode step of the same engine in the same process can take half as long again a
minute later), so a profile calibrated once carries the speed of its minute into every
simulated run. A probe is a fixed, cheap microbenchmark on an idle engine: ``batch_sizes``
requests of a fixed prompt, no drafting, a few decode steps each; it returns the median
decode-step seconds per batch size by the engine's own timers. ``calibrate`` probes its
engine at its start and end (the profile's reference); ``adaptspec fidelity`` probes the
live engine right before and after every live run, and simulates that run on the profile's
time costs times the run's speed factor (live probe / reference).

A prompt probe (``prompt_probe``) times one-request prompt passes of fresh prompts at a few
lengths the same way: a calibration's prompt table can drift apart from its decode steps
(simulations/FIDELITY.md), and a run's first tokens follow its prompt passes, so each live run
gets its own prompt factor (``prompt_factor``: live pass / the profile's prompt table).

``speed_probe`` imports no torch itself (it drives the engine it is given); the rest is
arithmetic on probe dicts {batch size (or prompt length): seconds}.
"""
from __future__ import annotations

import math

import numpy as np

PROBE_BATCHES = (1, 8)
PROMPT_LENGTHS = (8, 16, 32)  # what a chat prompt leaves to prefill past the prefix cache, mostly


def _prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    """Fixed token ids, the same on every call (so a probe's prefill hits the prefix cache it
    left the last time, and nothing the workload sends); away from the vocabulary's ends
    (special tokens) unless it is a tiny test vocabulary."""
    rng = np.random.default_rng(20261202)
    lo, hi = (100, vocab - 100) if vocab > 400 else (0, vocab)
    return [rng.integers(lo, hi, tokens).tolist() for _ in range(n)]


def speed_probe(engine, batch_sizes: tuple[int, ...] = PROBE_BATCHES, steps: int = 5,
                prompt_tokens: int = 32) -> dict[int, float]:
    """{batch size: median seconds of a decode step (verify + draft + other, the engine's
    timers)} of ``batch_sizes`` (each at most the engine's KV slots) requests of a fixed prompt
    with no drafting: the prompts are prefilled, one decode step goes untimed, ``steps`` are
    timed, the requests are aborted. The engine must be idle; it is idle again after, and its
    step listeners never see the probe's steps (a load test's logs, the controller's reports,
    the acceptance recorder)."""
    from adaptspec import SamplingParams, SpecConfig

    if engine.has_unfinished():
        raise ValueError("speed_probe: the engine has unfinished requests (probe an idle engine)")
    if steps < 1:
        raise ValueError(f"speed_probe: steps must be >= 1, got {steps}")
    slots = int(engine.config.max_num_seqs)
    batches = sorted({max(1, min(int(b), slots)) for b in batch_sizes})
    budget = int(getattr(engine.config, "max_num_batched_tokens", 0) or prompt_tokens * max(batches))
    seen: list = []
    saved = engine.step_listeners
    engine.step_listeners = [seen.append]
    out: dict[int, float] = {}
    try:
        for b in batches:
            seen.clear()
            prefill_steps = -(-b * prompt_tokens // budget) + 1
            params = SamplingParams(max_new_tokens=prefill_steps + steps + 8, ignore_eos=True, seed=0)
            ids = [engine.add_request(p, params, SpecConfig("none", 0), raw=True)
                   for p in _prompts(b, prompt_tokens, int(engine.target.vocab_size))]
            try:
                for _ in range(prefill_steps + steps + 6):
                    engine.step()
                    if len([s for s in seen if s.batch_size == b and not s.prefill_tokens]) > steps:
                        break
            finally:
                for rid in ids:
                    engine.abort(rid)
                flush = getattr(engine, "flush_stats", None)
                if flush is not None:  # CUDA: a step's timings publish after its events ran
                    flush(wait=True)
            decode = [s for s in seen if s.batch_size == b and not s.prefill_tokens][1:]  # the first: untimed
            if not decode:
                raise RuntimeError(f"speed_probe: no decode step of {b} requests was measured")
            out[b] = float(np.median([s.verify_s + s.draft_s + s.other_s for s in decode[:steps]]))
    finally:
        engine.step_listeners = saved
    return out


def prompt_probe(engine, lengths: tuple[int, ...] = PROMPT_LENGTHS, repeats: int = 3,
                 seed: int | None = None) -> dict[int, float]:
    """{prompt length: median seconds of a one-request pass that prefills a fresh prompt of that
    many tokens (verify + draft + other, the engine's timers)}, ``repeats`` passes each, as
    ``adaptspec calibrate`` times its prompt table. Fresh token ids every call (``seed``: None
    draws one), so no pass is served by the prefix cache. The engine must be idle; its step
    listeners never see the passes. A length over the step's token budget is left out."""
    from adaptspec.sim.calibrate import _prompt_passes

    if engine.has_unfinished():
        raise ValueError("prompt_probe: the engine has unfinished requests (probe an idle engine)")
    if repeats < 1:
        raise ValueError(f"prompt_probe: repeats must be >= 1, got {repeats}")
    budget = int(getattr(engine.config, "max_num_batched_tokens", 0) or max(lengths))
    rng = np.random.default_rng(seed)
    saved = engine.step_listeners
    engine.step_listeners = []
    out: dict[int, float] = {}
    try:
        for n in sorted({int(x) for x in lengths if 1 <= int(x) <= budget}):
            got = _prompt_passes(engine, n, repeats, rng, int(engine.target.vocab_size))
            if got:
                out[n] = float(np.median([g.verify_s + g.draft_s + g.other_s for g in got]))
    finally:
        engine.step_listeners = saved
    return out


def prompt_factor(live: dict[int, float], profile) -> float:
    """``speed_factor`` of a live prompt probe (beyond the profile's step overhead, as the prompt
    table is) against the profile's prompt table at the probed lengths; nan without a table or
    a probe. One level correction for the whole table."""
    xs, ys = list(getattr(profile, "prefill_tokens", None) or []), list(getattr(profile, "prefill_s", None) or [])
    if not xs:
        return math.nan
    over = float(profile.step_overhead_s)
    return speed_factor({n: t - over for n, t in live.items()}, {n: float(np.interp(n, xs, ys)) for n in live})


def repeatability(readings: list[dict[int, float]]) -> dict[int, dict[str, float]]:
    """Per batch size, how much back-to-back probes of one engine agree: count, median, min,
    max (seconds) and the coefficient of variation (population sd / mean). A machine whose
    probes spread by more than a benchmark's goal cannot check that goal."""
    out = {}
    for b in sorted({b for r in readings for b in r}):
        x = np.array([r[b] for r in readings if b in r], dtype=float)
        out[b] = {"n": int(x.size), "median_s": float(np.median(x)), "min_s": float(x.min()),
                  "max_s": float(x.max()), "cv": float(x.std() / x.mean()) if x.mean() > 0 else math.nan}
    return out


def mean_probe(*probes: dict[int, float]) -> dict[int, float]:
    """Per batch size, the mean of the probes that have it."""
    keys = sorted({b for p in probes if p for b in p})
    return {b: float(np.mean([p[b] for p in probes if p and b in p])) for b in keys}


def speed_ratios(live: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    """Per batch size both probed: live seconds / reference seconds (> 1: slower now)."""
    return {b: live[b] / reference[b] for b in sorted(set(live) & set(reference)) if reference[b] > 0 and live[b] > 0}


def speed_factor(live: dict[int, float], reference: dict[int, float]) -> float:
    """The geometric mean of ``speed_ratios`` over batch sizes; nan when none is shared.

    One factor for every step, not one per batch size: the simulator's steps span every batch
    size of a run, one factor keeps the calibrated profile's shape (measured carefully, point
    by point) and corrects only its level, and the mean of two ratios is less noisy than
    either. The geometric mean, so a ratio and its inverse weigh alike."""
    r = speed_ratios(live, reference)
    return float(math.exp(np.mean(np.log(list(r.values()))))) if r else math.nan


def probe_to_json(p: dict[int, float] | None) -> dict[str, float] | None:
    return None if p is None else {str(b): float(s) for b, s in sorted(p.items())}


def probe_from_json(p: dict | None) -> dict[int, float] | None:
    return None if p is None else {int(b): float(s) for b, s in p.items()}


def summary(factors: list[float]) -> dict[str, float | int]:
    """min / median / max of the finite factors (how much the machine drifted)."""
    f = [x for x in factors if math.isfinite(x)]
    if not f:
        return {"probed_runs": 0}
    return {"probed_runs": len(f), "min": float(min(f)), "median": float(np.median(f)), "max": float(max(f))}
