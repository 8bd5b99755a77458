"""``adaptspec calibrate``: measure the live engine's step costs, write a profile JSON.

The engine (torch) is imported inside ``calibrate`` only; the fit is a pure function of
the measured steps (``fit_profile``), tested without torch. Procedure: for each batch size
and each arm (no drafting, n-gram k, draft k), start that many requests with random
prompts, let the prefill pass go by, then time ``steps`` decode steps with the engine's own
per-step timers (verify_s, draft_s, other_s) and record tokens and context. With several
``prompt_tokens``, the points take them in turn (and the next pass the next one), so each
token count is measured at more than one context per request and the context's price can be
told from the tokens' (with one prompt length the context grows with the batch, as the
tokens do). With
``prefill``, also one-request prompt passes at several prompt lengths (drafter ``prompt``):
the profile's prompt table (``control.costs``), since a prompt token costs less than a
verified one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from adaptspec.control.costs import ProfileCostModel, ProfileFile


@dataclass(slots=True)
class StepSample:
    batch_size: int
    drafter: str
    k: int
    verify_tokens: int
    context_tokens: int
    verify_s: float
    draft_s: float
    other_s: float
    pass_index: int = 0  # the calibration pass that measured it (the steps CSV's ``pass``)


def fit_profile(samples: list[StepSample], *, name: str, max_num_seqs: int, kv_capacity_tokens: int,
                max_batched_tokens: int, context_term: bool = True) -> ProfileFile:
    """verify_s = table(verify_tokens) + c * context; draft_s / k per forward at each batch
    size; n-gram seconds per request; host time other_s = o0 + o1 * batch size, a line through
    the decode steps' median at each batch size (o1 = 0 when it would fall; a prefill sample's
    host time beyond it counts as its tokens' verify time).

    c comes from within each measured point (batch size, drafter, k, verify tokens): least
    squares with one level per point, so only a point measured at different contexts (``calibrate`` with
    several ``prompt_tokens``) prices the context, and a batch's per-request cost, which grows
    with its context too, stays in the table. The table is then the median at each token count
    of the time less c * context. No point that spans contexts (its largest at least
    ``CONTEXT_SPAN`` times its smallest), a negative c, or ``context_term=False``: c = 0 and the
    table alone, at the contexts the measured batches had (a joint fit over all points could
    hand a batch's per-request cost to the context and leave the table flat, SmolLM2 fp32: 1 to
    18 tokens at one price, which tells a policy choosing k that candidates are free).

    Samples of one-request prompt passes (drafter ``prompt``) make the prompt table (median
    seconds at each length, beyond the overhead, non-decreasing); the verify table then leaves
    out the admission steps (drafter ``prefill``), which mix prompt and decode tokens and would
    price the mix as verified tokens."""
    if not samples:
        raise ValueError("calibrate: no steps were measured")
    prompt = [s for s in samples if s.drafter == "prompt"]
    rest = [s for s in samples if s.drafter not in ("prompt", "prefill")] if prompt else samples
    if not rest:
        raise ValueError("calibrate: no decode steps were measured (prompt passes alone)")
    full, samples = samples, rest
    tokens = np.array([s.verify_tokens for s in samples])
    levels = np.unique(tokens)
    context = np.array([s.context_tokens for s in samples], dtype=float)
    # the fixed host seconds of a step: the decode steps' (a prefill step commits a whole prompt
    # chunk, and the larger batches give many chunks: in the median they would set every step's
    # overhead to a prefill step's)
    decode = [s for s in samples if s.drafter != "prefill"] or samples
    overhead, per_request = _host_line(decode)
    # ... and what a prefill step spends beyond that goes with its tokens, into the table
    y = np.array([s.verify_s + (max(s.other_s - overhead - per_request * s.batch_size, 0.0) + s.draft_s
                                if s.drafter == "prefill" else 0.0) for s in samples])
    ctx = _context_price(samples, context, y) if context_term else 0.0
    coef = np.array([np.median((y - ctx * context)[tokens == v]) for v in levels] + [ctx])
    weights = np.array([np.count_nonzero(tokens == v) for v in levels], dtype=float)
    verify = np.maximum(_isotonic(coef[:-1], weights), 1e-6)  # more tokens never cost less
    draft = [s for s in samples if s.drafter == "draft" and s.k > 0]
    batches = sorted({s.batch_size for s in draft})
    draft_s = [float(np.median([s.draft_s / s.k for s in draft if s.batch_size == b])) for b in batches]
    ngram = [s.draft_s / s.batch_size for s in samples if s.drafter == "ngram" and s.k > 0]
    lengths = sorted({s.verify_tokens for s in prompt})
    # a prompt pass decodes nothing: its host time beyond o0 is its prompt's
    py = [float(np.median([s.verify_s + s.draft_s + max(s.other_s - overhead, 0.0) for s in prompt
                           if s.verify_tokens == n])) for n in lengths]
    if py:
        py = list(np.maximum(_isotonic(np.array(py), np.array([sum(s.verify_tokens == n for s in prompt)
                                                                for n in lengths], dtype=float)), 1e-6))
    return ProfileFile(
        name=name, verify_tokens=[float(x) for x in levels], verify_s=[float(x) for x in verify],
        verify_context_s_per_token=ctx,
        draft_batch=[float(b) for b in batches] or [1.0],
        draft_s=list(np.maximum.accumulate(draft_s)) if draft_s else [0.0],
        ngram_s_per_request=float(np.median(ngram)) if ngram else 0.0,
        step_overhead_s=overhead, step_overhead_s_per_request=per_request,
        prefill_tokens=[float(n) for n in lengths], prefill_s=[float(x) for x in py],
        kv_capacity_tokens=kv_capacity_tokens, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
        calibrated=True, notes=[f"measured by adaptspec calibrate from {len(full)} steps"])


def _host_line(decode: list[StepSample]) -> tuple[float, float]:
    """(o0, o1): host seconds of a decode step = o0 + o1 * batch size, least squares through
    the median at each batch size weighted by its steps; one batch size or a falling line: the
    median of all, o1 = 0."""
    sizes = sorted({s.batch_size for s in decode})
    med = np.array([np.median([s.other_s for s in decode if s.batch_size == b]) for b in sizes])
    w = np.sqrt([sum(s.batch_size == b for s in decode) for b in sizes])
    if len(sizes) >= 2:
        A = np.stack([np.ones(len(sizes)), np.array(sizes, dtype=float)], axis=1)
        (o0, o1), *_ = np.linalg.lstsq(A * w[:, None], med * w, rcond=None)
        if o1 > 0 and o0 >= 0:
            return float(o0), float(o1)
    return float(np.median([s.other_s for s in decode])), 0.0


CONTEXT_SPAN = 1.5  # a point prices the context if its largest context is this many times its smallest


def _context_price(samples: list[StepSample], context: np.ndarray, y: np.ndarray) -> float:
    """Seconds per context token from within the measured points (``fit_profile``): steps of
    one batch size, drafter, k and verify token count; admission steps (their prompt chunks
    vary) left out. 0 when no point spans contexts or the fit is negative."""
    keep = np.array([s.drafter != "prefill" for s in samples])
    samples, context, y = [s for s, m in zip(samples, keep) if m], context[keep], y[keep]
    if not samples:
        return 0.0
    points: dict = {}
    idx = np.array([points.setdefault((s.batch_size, s.drafter, s.k, s.verify_tokens), len(points))
                    for s in samples])
    lo, hi = np.full(len(points), np.inf), np.zeros(len(points))
    np.minimum.at(lo, idx, context)
    np.maximum.at(hi, idx, context)
    if not np.any((lo > 0) & (hi >= CONTEXT_SPAN * lo)):
        return 0.0
    X = np.zeros((len(samples), len(points) + 1))
    X[np.arange(len(samples)), idx] = 1.0
    X[:, -1] = context
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return float(coef[-1]) if coef[-1] > 0 else 0.0


def calibrate(out: Path, *, target: str, draft: str | None, dtype: str, device: str, repeats: int,
              batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), ks: tuple[int, ...] = (1, 2, 4, 8),
              prompt_tokens: int | tuple[int, ...] = 128, context_term: bool = True, prefill: bool = False,
              engine_options: dict | None = None, probe: bool = True, passes: int = 2,
              prompt_lengths: tuple[int, ...] = (8, 16, 32, 64, 128), warmup: bool = True) -> Path:
    """``prefill``: also keep each point's admission step (its prompts' prefill and whatever
    the engine runs with it) as a sample at its prefill + verify tokens, so the profile's
    token table reaches prompt-sized passes (the simulator prices a step's prompt chunks on
    the same table) instead of extrapolating the decode steps' slope. ``engine_options``: more
    ``Engine.from_pretrained`` settings (a service's: token budget, block size, prefix cache).
    ``probe``: speed probes (``speed_probe``) of the engine at the start and the end, kept in
    the profile as the reference a live engine's probes are compared with (the machine's speed
    drifts between minutes; ``adaptspec fidelity`` scales the profile by live probe / this).
    ``passes``: the grid is measured this many times, every other pass in reverse order, and
    the samples pooled: the machine's speed drifts within a calibration too, and one pass in
    batch order would measure the small batches in one speed state and the large ones in
    another, which bends the token table (the shape the policy prices k by).
    ``prompt_lengths`` (with ``prefill``): each pass also times ``repeats`` one-request prompt
    passes of each length (fresh random tokens: no prefix-cache hit), the prompt table.
    ``prompt_tokens``: the decode points' prompt length, or lengths taken in turn (above).
    ``warmup``: one untimed pass over the grid first. On the CPU the first steps of a shape
    not seen before (a token count, a batch size) pay one-off set-up in the kernels, enough to
    raise a token count's price in the table by half, which steers a controller priced on it
    off the k that makes that count. A live engine meets each shape cold once in thousands of
    steps; a calibration meets many of them for the first time."""
    if passes < 1:  # before the models load: a bad value fails at once
        raise ValueError(f"calibrate: passes must be >= 1, got {passes}")
    contexts = (int(prompt_tokens),) if isinstance(prompt_tokens, int) else tuple(int(n) for n in prompt_tokens)
    if not contexts or any(n < 1 for n in contexts):
        raise ValueError(f"calibrate: prompt_tokens must be >= 1, got {prompt_tokens}")
    if prefill and any(int(n) < 1 for n in prompt_lengths):
        raise ValueError(f"calibrate: prompt_lengths must be >= 1, got {tuple(prompt_lengths)}")
    try:
        from adaptspec import Engine, SamplingParams, SpecConfig
    except Exception as e:  # pragma: no cover - depends on the install
        raise RuntimeError(f"calibrate needs the engine (torch): {e}") from None
    max_seqs = max(batch_sizes)
    engine = Engine.from_pretrained(target=target, draft=draft, dtype=dtype, device=device, max_num_seqs=max_seqs,
                                    **(engine_options or {}))
    probes = []
    if probe:
        from adaptspec.sim.speed_probe import speed_probe

        speed_probe(engine)  # untimed: a fresh engine's first passes are slow
        probes.append(speed_probe(engine))
    rng = np.random.default_rng(0)
    vocab = int(engine.target.vocab_size)
    arms = [("none", 0)] + [("ngram", k) for k in ks] + ([("draft", k) for k in ks] if draft else [])
    samples: list[StepSample] = []
    steps = max(repeats, 1)
    from tqdm import tqdm

    budget = int(engine.config.max_num_batched_tokens)
    points = [(b, d, k) for b in batch_sizes for d, k in arms]
    if prefill:  # one-request prompt passes, each length one point (a length over the step's token budget is left out)
        points += [(1, "prompt", int(n)) for n in sorted(set(prompt_lengths)) if int(n) <= budget]
    # point j of pass i prompts with contexts[(i + j) % n]: within a pass the lengths alternate
    # (drift hits both alike), and over n passes every point meets every length
    order = lambda i: enumerate(points) if i % 2 == 0 else reversed(list(enumerate(points)))  # noqa: E731
    grid = [(i, *pt, contexts[(i + j) % len(contexts)]) for i in range(passes) for j, pt in order(i)]
    if warmup:  # pass -1: measured as the others, kept by none
        grid = [(-1, *pt, contexts[j % len(contexts)]) for j, pt in order(0)] + grid
    timed: list[StepSample] = []
    for i, b, drafter, k, plen in tqdm(grid, desc="calibrate", unit="point"):
        samples = [] if i < 0 else timed
        if drafter == "prompt":
            samples += [replace(x, pass_index=i) for x in _prompt_passes(engine, k, steps, rng, vocab)]
            continue
        ids = []
        # the step's token budget chunks the prompts over this many steps, and the requests
        # prefilled first decode meanwhile: each must still run through the timed steps
        prefill_steps = -(-b * plen // budget) + 1
        for _ in range(b):
            # a repeated random phrase, so n-gram lookup finds candidates as in real text
            # away from the vocabulary's ends (special tokens), unless it is a tiny test vocabulary
            phrase = (rng.integers(100, vocab - 100, 16) if vocab > 400 else rng.integers(0, vocab, 16)).tolist()
            prompt = (phrase * (plen // 16 + 1))[:plen]
            ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=(k + 1) * (steps + 2 + prefill_steps) + 2,
                                                                 ignore_eos=True),
                                          SpecConfig(drafter, k), raw=True))
        for _ in range(prefill_steps + 1):  # admission and prefill, in chunks when the budget says so
            engine.step()
            st = engine.last_step
            if prefill and st is not None and st.prefill_tokens:
                samples.append(StepSample(b, "prefill", 0, st.prefill_tokens + st.verify_tokens, st.context_tokens,
                                          st.prefill_s + st.verify_s, st.draft_s, st.other_s, i))
            if not engine.scheduler.waiting and not any(s.prefilling for s in engine.scheduler.running):
                break
        for _ in range(steps):
            engine.step()
            st = engine.last_step
            if st is None or st.batch_size != b:
                break
            samples.append(StepSample(b, drafter, k, st.verify_tokens, st.context_tokens, st.verify_s,
                                      st.draft_s, st.other_s, i))
        for rid in ids:
            engine.abort(rid)
    samples = timed
    with open(Path(out).with_suffix(".steps.csv"), "w") as f:  # the raw measurements, for the record
        f.write("batch_size,drafter,k,verify_tokens,context_tokens,verify_s,draft_s,other_s,pass\n")
        for x in samples:
            f.write(f"{x.batch_size},{x.drafter},{x.k},{x.verify_tokens},{x.context_tokens},{x.verify_s:.6f},"
                    f"{x.draft_s:.6f},{x.other_s:.6f},{x.pass_index}\n")
    kv = max_seqs * engine.config.max_model_len
    prof = fit_profile(samples, name=f"{target} + {draft or 'no draft'} on {device} ({dtype}), calibrated",
                       max_num_seqs=max_seqs, kv_capacity_tokens=kv,
                       max_batched_tokens=max(max(contexts) * max_seqs, 512),
                       context_term=context_term)
    if warmup:
        prof.notes.append("after an untimed warm-up pass over the grid")
    if probe:
        probes.append(speed_probe(engine))
        prof.probe = probe_ref(*probes)
        ref = prof.probe
        prof.notes.append("speed probe (decode step, ms, batch " + "/".join(map(str, ref.batch_sizes)) + "): start "
                          + "/".join(f"{1e3 * x:.2f}" for x in ref.start_s) + ", end "
                          + "/".join(f"{1e3 * x:.2f}" for x in ref.end_s))
    ProfileCostModel(prof).save(out)
    return Path(out)


def _prompt_passes(engine, length: int, repeats: int, rng, vocab: int) -> list[StepSample]:
    """``repeats`` timed passes that each prefill one fresh prompt of ``length`` tokens on an
    idle engine. Each request asks for two tokens and is aborted after its pass: a request
    that ended at its first token would skip what the pass costs every live request, which
    goes on decoding (a draft head reading the prompt's features in the commit phase, a few
    ms a pass on the CPU; a table without it made simulated TTFT short)."""
    from adaptspec import SamplingParams, SpecConfig

    out = []
    lo, hi = (100, vocab - 100) if vocab > 400 else (0, vocab)
    for _ in range(repeats):
        rid = engine.add_request(rng.integers(lo, hi, length).tolist(), SamplingParams(max_new_tokens=2, ignore_eos=True),
                                 SpecConfig("none", 0), raw=True)
        engine.step()
        st = engine.last_step
        if st is not None and st.prefill_tokens == length and st.verify_tokens == 0:
            out.append(StepSample(1, "prompt", 0, length, st.context_tokens, st.prefill_s + st.verify_s,
                                  st.draft_s, st.other_s))
        engine.abort(rid)
    return out


def probe_ref(start: dict[int, float], end: dict[int, float]):
    """The profile's ``probe`` field from the probes at a calibration's start and end."""
    from adaptspec.control.costs import SpeedProbeRef

    b = sorted(set(start) & set(end))
    return SpeedProbeRef(batch_sizes=b, start_s=[start[x] for x in b], end_s=[end[x] for x in b])


def read_steps(path: str | Path) -> list[StepSample]:
    """The raw measurements a calibration wrote (``<profile>.steps.csv``)."""
    import csv

    with open(path, newline="") as f:
        return [StepSample(int(r["batch_size"]), r["drafter"], int(r["k"]), int(r["verify_tokens"]),
                           int(r["context_tokens"]), float(r["verify_s"]), float(r["draft_s"]), float(r["other_s"]),
                           int(r.get("pass") or 0))
                for r in csv.DictReader(f)]


def refit(steps_csv: str | Path, out: str | Path, *, like: str | Path | None = None, context_term: bool = False) -> Path:
    """A profile fitted again from a calibration's raw steps (a changed fit, no new
    measurement); the limits and name of ``like`` (a profile JSON) when given."""
    samples = read_steps(steps_csv)
    base = ProfileCostModel.load(like).profile if like else None
    prof = fit_profile(samples, name=(base.name if base else f"refit of {steps_csv}"),
                       max_num_seqs=base.max_num_seqs if base else max(s.batch_size for s in samples),
                       kv_capacity_tokens=base.kv_capacity_tokens if base else 1_000_000,
                       max_batched_tokens=base.max_batched_tokens if base else 8192, context_term=context_term)
    if base is not None and base.probe is not None:  # the same measurement: the same speed reference
        prof.probe = base.probe
    prof.notes.append(f"refitted from {Path(steps_csv).name}")
    ProfileCostModel(prof).save(out)
    return Path(out)


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in weighted least squares (pool adjacent
    violators): one slow level pools with its neighbours instead of lifting every level after
    it, as a running maximum would."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for v, wt in zip(y.tolist(), w.tolist()):
        blocks.append([v, wt, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.array([m for m, _, n in blocks for _ in range(n)])
