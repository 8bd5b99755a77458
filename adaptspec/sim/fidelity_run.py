"""``adaptspec fidelity``: calibrate, run a workload live and simulated, compare.

1. Step costs: a fresh ``adaptspec calibrate`` of the service config's engine on this
   machine (same models, dtype, device and torch threads), prefill steps included; or a
   given profile.
2. Live: every (level, policy) through the in-process engine and controller (the
   replica's engine and ``ControlCore``, driven as a replica drives them), interleaved as
   ``adaptspec loadtest`` interleaves them; optionally also through Ray Serve and gRPC.
   The engine's steps are recorded meanwhile: acceptance per class, drafter, k and
   position (``AcceptanceRecorder``), and what each prompt produced (the prompt set:
   prompt tokens by the engine's tokenizer, output tokens as the live requests ended).
3. Simulated: the same levels (closed loops of the same clients and think times; the open
   loops at the live run's very arrival times), the same prompts in the same order, the
   same policies built by the service's ``make_policy`` with the controller's settings, on
   the calibrated profile and the recorded acceptance.
4. Per path, policy, level and class: relative errors of throughput, TTFT p50/p99 and
   TPOT p50/p99, the top arm live and simulated; the goals; a table, JSON and a plot.
   Everything it used (profile, acceptance recording, prompt set, a scenario YAML for
   ``adaptspec simulate``) lands in the output folder.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from adaptspec.sim import step_shapes
from adaptspec.sim.fidelity import (
    ALL, Cell, Row, Run, SimLevel, SnapshotPolicy, acceptance_source, goals, make_cell, side_metrics, simulate_level, step_time,
    to_json, truths_from_recording,
)


SPEED_FROM = ("probes", "steps", "none")  # FidelityOptions.speed_from


@dataclass(slots=True)
class FidelityOptions:
    config: str | None = None
    levels: list = field(default_factory=lambda: [1, 4, 16])  # ints (closed loops) and loadtest.Arrivals
    policies: list[str] = field(default_factory=list)  # empty: thompson and the static arms
    classes: list[str] = field(default_factory=lambda: ["chat", "code_edit", "extraction"])
    max_tokens: int = 64
    prompts: str | None = None  # loadtest's --prompts: corpus:N[:SEED] or a JSON file; None: the bench prompts
    duration_s: float = 30.0
    warmup_s: float = 10.0
    rounds: int = 1
    fresh: bool = False
    profile: str | None = None  # a profile JSON: skip the calibration
    calibrate_repeats: int = 3
    calibrate_batch: tuple[int, ...] = (1, 2, 4, 8, 16)
    calibrate_ks: tuple[int, ...] = (2, 4, 8)
    # the calibration's prompt lengths, taken in turn by its points: two contexts per point
    # price the context apart from the tokens (``calibrate.fit_profile``); one: the table alone
    calibrate_prompt_tokens: tuple[int, ...] = (32, 160)
    sim_seeds: int = 1
    host_gap: bool = True  # simulate the host's time between engine steps as measured live
    snapshots: bool = True  # the simulated policy's arms from snapshots, as a live replica's
    probe: bool = True  # speed-probe the live engine around each run; simulate it at that speed
    prompt_probe: bool = True  # with probe: also time prompt passes; price each run's at its own factor
    # a run whose probe after it differs from the one before by more than this (relative, at any
    # batch size or prompt length) is simulated without its factor (see speed_factors)
    probe_tolerance: float = 0.1
    # where each run's speed factor comes from: "probes" (taken around it, above), "steps" (its
    # own engine steps priced on the profile: ``step_factors``) or "none" (the calibration's)
    speed_from: str = "probes"
    # add each level's median time outside the engine (measured live through a service) to the
    # simulated side's token times of that path (see path_delays)
    path_delay: bool = True
    per_prompt: bool = True  # replay acceptance per prompt where recorded (else per class)
    per_position: bool = True  # and, with it, a step at a position its prompt's live runs settled as it went
    cache_replay: bool = True  # each simulated run prefills what the prefix cache left its live run
    median: str = "hd"  # the p50s' estimator (``fidelity.median``: "hd" or "sample")
    drain_s: float = 120.0
    grpc: bool = False
    torch_threads: int | None = None
    out: Path = Path("fidelity")


def default_policies(drafters: tuple[str, ...], max_k: int) -> list[str]:
    k = min(4, max_k)
    return ["thompson", "static:none:0"] + [f"static:{d}:{k}" for d in drafters]


def rows_from_records(records) -> list[Row]:
    """Load-test ``RequestRecord``s as rows (perf_counter clock)."""
    rows = []
    for r in records:
        error = bool(r.error)
        engine = r.engine_ttft_s
        rows.append(Row(r.request_class, r.start_s, r.start_s + r.ttft_s if r.ttft_s > 0 else math.nan,
                        r.start_s + r.e2e_s if not (r.cut or error) else math.nan, r.tokens, r.cut, error,
                        list(r.chunks), r.prompt_index, dict(r.arms), r.cached_tokens,
                        max(r.ttft_s - engine, 0.0) if r.ttft_s > 0 and engine > 0 else math.nan))
    return rows


def build_prompt_set(engine, classes: list[str], live: dict, max_tokens: int, prompts: dict | None = None):
    """Per class, for each prompt of ``prompts`` (the load's pools; None: the bench prompts):
    its prompt tokens by the engine's tokenizer, its output tokens as its live requests ended
    (their median; ``max_tokens`` for a prompt that never finished live) and the prompt tokens
    the prefix cache served them (their median). Returns
    the ``PromptSet`` (uncached prompt tokens: the simulator has no prefix cache) and its CSV
    rows (request_class, num_prefill_tokens, num_decode_tokens, num_cached_tokens)."""
    from adaptspec.serve.loadtest import bench_prompts
    from adaptspec.sim.closed_loop import PromptSet

    prompts = prompts if prompts is not None else bench_prompts()
    ended: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for runs in live.values():
        for run in runs:
            for r in run.rows:
                if not (r.cut or r.error) and r.tokens > 0 and r.prompt_index >= 0:
                    ended.setdefault((r.request_class, r.prompt_index), []).append((r.tokens, r.cached_tokens))
    ptoks, otoks, ktoks, csv_rows = [], [], [], []
    for cls in classes:
        pool = prompts.get(cls) or prompts["chat"]
        p = np.array([len(engine.encode(x)) for x in pool], dtype=np.int64)
        seen = [np.array(ended.get((cls, i), [(max_tokens, 0)])) for i in range(len(pool))]
        o = np.array([int(np.median(x[:, 0])) for x in seen], dtype=np.int64)
        cached = np.minimum(np.array([int(np.median(x[:, 1])) for x in seen], dtype=np.int64), p - 1)
        ptoks.append(p - cached)
        otoks.append(o)
        ktoks.append(cached)
        csv_rows += [(cls, int(a), int(b), int(c)) for a, b, c in zip(p, o, cached)]
    return PromptSet(ptoks, otoks, cached_tokens=ktoks), csv_rows


def cache_replay(ps_rows, live: dict, classes: list[str]) -> tuple[dict, dict]:
    """The prompt set of each live run: ``({(policy, level label): [PromptSet per round]},
    {(policy, level label): [mean prompt tokens the cache served a request, per round]})``.

    The simulator has no prefix cache, and what the live one serves a request depends on what
    ran before it in the session (the session's first runs start cold; a run with more or
    longer requests evicts more; one cycle through the prompts can lose a block of each), so
    one prompt set holding each prompt's median over all runs prices some requests' prompts
    low and others' high, and their TTFT with them. A run's set replays its requests in send
    order: the pool of a class becomes one copy of its prompts per time the run sent them, the
    j-th copy of a prompt less what the cache served the j-th request of it (the round-robin
    order of the load test and the simulator picks copy j for the j-th use; a prompt sent fewer
    times takes its median in the run, one never sent its median over all runs, as ``ps_rows``
    has it). With several paths (in-process, gRPC) the first one's run of the round counts.
    ``ps_rows``: (class, prompt tokens, output tokens, cached tokens) per prompt in class and
    pool order (``build_prompt_set``'s CSV rows); ``live``: {path: {(policy, level label): [Run]}}."""
    from adaptspec.sim.closed_loop import PromptSet

    base = {c: [(int(p), int(o), int(k)) for cc, p, o, k in ps_rows if cc == c] for c in classes}
    keys = sorted({key for runs in live.values() for key in runs}, key=str)
    sets: dict = {}
    served: dict = {}
    for key in keys:
        rounds = max(len(runs.get(key, [])) for runs in live.values())
        for r in range(rounds):
            got = next(runs[key][r] for runs in live.values() if r < len(runs.get(key, [])))
            rows = sorted((row for row in got.rows if row.prompt_index >= 0), key=lambda x: x.start_s)
            occ: dict[tuple[str, int], list[int]] = {}
            for row in rows:
                occ.setdefault((row.request_class, row.prompt_index), []).append(row.cached_tokens)
            ptoks, otoks, ktoks, ids = [], [], [], []
            for c in classes:
                pool = base[c]
                uses = max([len(occ.get((c, i), ())) for i in range(len(pool))] + [1])
                pt, ot, kt = [], [], []
                ids.append(np.tile(np.arange(len(pool), dtype=np.int64), uses))  # copy j of prompt i is prompt i
                for j in range(uses):
                    for i, (p, o, k) in enumerate(pool):
                        seen = occ.get((c, i), [])
                        kk = seen[j] if j < len(seen) else (int(np.median(seen)) if seen else k)
                        kt.append(max(min(kk, p - 1), 0))
                        pt.append(p - kt[-1])
                        ot.append(o)
                ptoks.append(np.array(pt, dtype=np.int64))
                otoks.append(np.array(ot, dtype=np.int64))
                ktoks.append(np.array(kt, dtype=np.int64))
            sets.setdefault(key, []).append(PromptSet(ptoks, otoks, ids, ktoks))
            served.setdefault(key, []).append(float(np.mean([row.cached_tokens for row in rows])) if rows else math.nan)
    return sets, served


def sim_profile(profile_path: str | Path, cfg, engine):
    """The calibrated profile with the live engine's limits: KV slots, KV tokens, step token budget."""
    from adaptspec.control.costs import ProfileCostModel

    model = ProfileCostModel.load(profile_path)
    ec = getattr(engine, "config", None)
    budget = (getattr(ec, "max_num_batched_tokens", None) or getattr(ec, "max_batched_tokens", None)
              or cfg.engine.max_num_seqs * cfg.engine.max_model_len)  # no budget: a step prefills all it admits
    update = {"max_num_seqs": cfg.engine.max_num_seqs, "kv_capacity_tokens": cfg.engine.max_num_seqs *
              cfg.engine.max_model_len, "max_batched_tokens": int(budget)}
    return ProfileCostModel(model.profile.model_copy(update=update))


def calibrate_for(cfg, out: Path, opts: FidelityOptions) -> Path:
    """A fresh calibration of the service's engine: its models, dtype, device, torch threads."""
    import torch

    from adaptspec.sim.calibrate import calibrate

    torch.set_num_threads(opts.torch_threads or cfg.engine.torch_threads or max(1, int(cfg.target.num_cpus or 1)))
    draft = cfg.models.draft if cfg.placement == "colocated" else None
    batch = tuple(b for b in opts.calibrate_batch if b <= cfg.engine.max_num_seqs) or (1,)
    ks = tuple(k for k in opts.calibrate_ks if k <= cfg.controller.max_k) or (1,)
    return calibrate(out, target=cfg.models.target, draft=draft, dtype=cfg.models.dtype, device=cfg.models.device,
                     repeats=opts.calibrate_repeats, batch_sizes=batch, ks=ks, prefill=True,
                     prompt_tokens=tuple(opts.calibrate_prompt_tokens), context_term=True,
                     engine_options={"max_model_len": cfg.engine.max_model_len,
                                     "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
                                     "block_size": cfg.engine.block_size,
                                     "enable_prefix_caching": cfg.engine.enable_prefix_caching,
                                     "kv_cache_memory": cfg.engine.kv_cache_memory})


class StepLog:
    """Engine steps for the fidelity comparison: per step, (perf_counter at the step's end, its
    wall seconds) and its shape; and the host's gaps between steps while the engine had work
    left, as (requests in the step before, seconds from its end to the next step's start): the
    serving loop, the other listeners, the controller's reports and tokenizing new requests,
    none of it inside the engine's timers.

    Called as an engine step listener (the in-process path), or fed ``record``s that a
    service replica logged (``extend``: the gRPC path, whose engine runs in another process of
    the same host; ``StepStats.end_s`` is on the one host-wide clock)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self._rows: list[int] = []
        self._busy: list[bool] = []
        self.gaps: dict[str, list[tuple[int, float]]] = {}  # policy in force -> (requests, seconds)
        self.shapes: list[list] = []  # every step's shape (``sim.step_shapes``)

    def __call__(self, st) -> None:
        self.extend([step_shapes.record(st)])

    def extend(self, records) -> None:
        for end, wall, rows, busy, shape in records:
            self.steps.append((end, wall))
            self.shapes.append(shape)
            self._rows.append(rows)
            self._busy.append(busy)

    def inside(self, w0: float, w1: float) -> tuple[int, float, float]:
        """``step_time`` of the logged steps over [w0, w1]."""
        return step_time([t for t, _ in self.steps], [w for _, w in self.steps], (w0, w1))

    def shapes_inside(self, w0: float, w1: float) -> list[list]:
        return step_shapes.inside(self.shapes, (w0, w1))

    def clear(self, policy: str = "*") -> None:
        """End of a run of ``policy``: keep its gaps, forget its steps (the next run's first
        step follows a policy switch, not a step)."""
        gaps = self.gaps.setdefault(policy, [])
        for i in range(1, len(self.steps)):
            if self._busy[i - 1]:
                gaps.append((self._rows[i - 1], self.steps[i][0] - self.steps[i][1] - self.steps[i - 1][0]))
        self.steps.clear()
        self.shapes.clear()
        self._rows.clear()
        self._busy.clear()


def _live_levels(opts: FidelityOptions, spec, console, *, current, switch, run_one,
                 step_log: StepLog | None = None, probe=None) -> tuple[dict, list]:
    """Every (level, policy) run, interleaved as the load test does; returns
    {(policy, level label): [Run]} and the load test's summaries. ``probe()``: (speed probe,
    prompt probe) of the (idle) engine, taken right before and right after every run
    (``Run.probe``: "before"/"after" and "prompt_before"/"prompt_after"; either may be None)."""
    from adaptspec.serve.cli import _interleaved_levels
    from adaptspec.serve.loadtest import as_arrivals

    runs: dict[tuple[str, str], list[Run]] = {}

    def capture(n):
        before, p_before = probe() if probe is not None else (None, None)
        got, window = run_one(n)  # returns with the engine idle: what is still running is aborted
        after, p_after = probe() if probe is not None else (None, None)
        steps = step_log.inside(window.start_s, window.end_s) if step_log is not None else (0, 0.0, 0.0)
        runs.setdefault((current(), as_arrivals(n).label), []).append(
            Run(rows_from_records(got), (window.start_s, window.end_s), *steps,
                probe=None if probe is None else {"before": before, "after": after,
                                                  "prompt_before": p_before, "prompt_after": p_after},
                shapes=step_log.shapes_inside(window.start_s, window.end_s) if step_log is not None else None))
        if step_log is not None:
            step_log.clear(current())
        return got, window

    summaries = _interleaved_levels(opts.levels, opts.policies, opts.rounds, opts.fresh, spec, console,
                                    current=current, switch=switch, run_one=capture)
    return runs, summaries


def _grpc_levels(cfg, opts: FidelityOptions, spec, console) -> tuple[dict, list, StepLog]:
    """Every (level, policy) run through Ray Serve and gRPC; the replica logs its engine's steps
    (``TargetEngine.start_step_log``), fetched after each run by a Serve handle, so this path's
    runs carry their own step shapes, speed and host gaps as the in-process ones do."""
    from ray import serve

    from adaptspec.serve import app as serve_app
    from adaptspec.serve.cli import start_embedded
    from adaptspec.serve.client import Client
    from adaptspec.serve.loadtest import run_level

    if cfg.target.autoscaling is not None or cfg.target.num_replicas != 1:
        raise ValueError("fidelity --grpc: target.num_replicas must be 1 and target.autoscaling null (the "
                         "simulated side is one engine)")
    address = start_embedded(cfg, console)
    step_log = StepLog()
    try:
        replica = serve.get_app_handle(cfg.app_name)
        with Client(address, cfg.app_name) as c:
            c.wait_ready(60)
            replica.start_step_log.remote().result()

            def run_one(n):
                got = run_level(c, n, opts.duration_s, spec, warmup_s=opts.warmup_s)
                step_log.extend(replica.take_step_log.remote().result())
                return got

            runs, summaries = _live_levels(opts, spec, console, current=lambda: c.policy().policy,
                                           switch=lambda p, reset: c.update_policy(p, reset=reset),
                                           run_one=run_one, step_log=step_log)
            return runs, summaries, step_log
    finally:
        serve_app.stop()


def _sim_level(level) -> SimLevel:
    from adaptspec.serve.loadtest import as_arrivals

    arr = as_arrivals(level)
    if arr.open:
        return SimLevel(arrivals_s=None)  # filled per run with the live times
    return SimLevel(clients=arr.clients, think_s=arr.think_s, think=arr.think)


def _round_factors(factors: list[float], default: float | None):
    """round r -> live run r's factor; a run without a usable one: the mean of the others', none
    at all: ``default``."""
    ok = lambda f: math.isfinite(f) and f > 0  # noqa: E731
    known = [f for f in factors if ok(f)]
    fallback = float(np.mean(known)) if known else default
    return lambda r: factors[r] if r < len(factors) and ok(factors[r]) else fallback


def simulate_all(cfg, opts: FidelityOptions, cost, truths, class_specs, prompt_set, console=None,
                 host_gap: dict | None = None, speed: dict | None = None, run_prompts: dict | None = None,
                 prompt_speed: dict | None = None, round_trip: dict | None = None) -> dict:
    """{(policy, level label): ([Run], {class: {arm: steps}})}: every (level, policy) as the
    live run had them, ``rounds`` runs each (an adaptive policy carries what it learned from
    run to run unless ``fresh``, as the live controller does), for each of ``sim_seeds``
    seeds. ``host_gap``: {policy: (a, b)}, ``"*"`` for any other policy (``host_gaps``).
    ``speed``: {(policy, level label): [speed factor of each live run]} (``speed_factors``):
    round r is simulated on ``cost``'s time costs times live run r's factor (a run without
    one: the mean of the others'; none at all: 1). ``prompt_speed``: the same for the prompt
    table alone (``prompt_factors``; a run without one: the mean of the others', none at all:
    the run's speed factor). ``run_prompts``: {(policy, level label):
    [prompt set of live round r]} (``cache_replay``); round r of every seed takes round r's
    set, a run without one ``prompt_set``. ``round_trip``: {(policy, level label): seconds} a
    closed loop's client adds between a reply and its next request reaching the engine (a
    service path, ``path_delays``)."""
    from dataclasses import replace

    from adaptspec.control import ClassTarget
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.serve.loadtest import as_arrivals
    from adaptspec.serve.policies import load_cost_prior, make_policy

    m = cfg.models
    prior = load_cost_prior(cfg.controller.cost_profile, target=m.target, dtype=m.dtype, device=m.device)
    targets = tuple(ClassTarget(c.name, c.tpot_s, c.ttft_s) for c in cfg.classes
                    if c.tpot_s is not None or c.ttft_s is not None)
    policies: dict[tuple[str, int], object] = {}
    out: dict = {}
    for level in opts.levels:
        arr = as_arrivals(level)
        lv = _sim_level(level)
        if arr.open:
            lv.arrivals_s = arr.times(opts.warmup_s + opts.duration_s)  # the live run's arrival times
        for name in opts.policies:
            gap = (host_gap or {}).get(name, (host_gap or {}).get("*", (0.0, 0.0)))
            factor = _round_factors((speed or {}).get((name, arr.label), []), 1.0)
            p_factor = _round_factors((prompt_speed or {}).get((name, arr.label), []), None)
            lv_run = replace(lv, round_trip_s=0.0 if arr.open else (round_trip or {}).get((name, arr.label), 0.0))
            runs, arms = [], {}
            sets = list((run_prompts or {}).get((name, arr.label), []))
            for seed in range(opts.sim_seeds):
                for r in range(opts.rounds):
                    ps = sets[r] if r < len(sets) else prompt_set
                    f, fp = factor(r), p_factor(r)
                    run_cost = cost if f == 1.0 and fp is None else ProfileCostModel(cost.profile.scaled(f, fp))
                    key = (name, seed)
                    if opts.fresh or key not in policies:
                        policies[key] = make_policy(name, drafters=cfg.drafters, max_k=cfg.controller.max_k,
                                                    targets=targets, seed=cfg.controller.seed + seed,
                                                    prior_cost=prior, fade_half_life_s=cfg.controller.fade_half_life_s,
                                                    fade_min_steps=cfg.controller.fade_min_steps)
                        if opts.snapshots:
                            policies[key] = SnapshotPolicy(policies[key], list(opts.classes),
                                                           cfg.controller.report_interval_s, gap)
                    run, steps = simulate_level(lv_run, policy=policies[key], cost=run_cost,
                                                truths=truths, classes=class_specs, prompt_set=ps, warmup_s=opts.warmup_s,
                                                duration_s=opts.duration_s, drain_s=opts.drain_s,
                                                max_k=cfg.controller.max_k, seed=seed * 1000 + r, host_gap=gap)
                    runs.append(run)
                    if isinstance(policies[key], SnapshotPolicy):
                        policies[key].flush()  # the live run's last report
                    for cls, per in steps.items():
                        for a, n in per.items():
                            arms.setdefault(cls, {})[a] = arms.setdefault(cls, {}).get(a, 0) + n
            out[(name, arr.label)] = (runs, arms)
            if console is not None:
                console.print(f"simulated {name} {arr.label}")
    return out


def position_replay(truths) -> dict[str, int]:
    """Request-steps the simulations replayed from a recorded trace, and drew (every class
    and drafter; ``RecordedAcceptance.replayed`` / ``drawn``)."""
    from adaptspec.sim.acceptance_replay import RecordedAcceptance

    models = [m for t in truths for m in t.acceptance.values() if isinstance(m, RecordedAcceptance)]
    return {"replayed": sum(m.replayed for m in models), "drawn": sum(m.drawn for m in models)}


def path_delays(live: dict) -> dict:
    """{path: {(policy, level label): seconds}}: the median over a level's live requests of the
    TTFT spent outside the engine (``Row.path_s``: the client's TTFT less the engine's), for the
    paths whose requests report the engine's (a service: the gRPC proxy, the ingress, the
    replica's event loop and the engine process's pipe, there and back)."""
    out: dict = {}
    for path, runs in live.items():
        for key, rs in runs.items():
            d = [r.path_s for run in rs for r in run.rows if math.isfinite(r.path_s)]
            if d:
                out.setdefault(path, {})[key] = float(np.median(d))
    return out


def delayed(runs: list, d: float) -> list:
    """Simulated runs as a client behind a path of ``d`` seconds sees them: every token (the
    first, the chunks, the last) ``d`` later. TPOT does not move; TTFT grows by ``d``. A
    closed-loop client's next request reaches the engine ``d`` after the reply left it: the
    simulated run pays that as its round trip (``SimLevel.round_trip_s``) where the engine's
    TTFT counts from the request's posting (runs before that counted the wait for the step in
    progress as path, which stood in for it)."""
    from dataclasses import replace

    out = []
    for run in runs:
        rows = [replace(r, first_token_s=r.first_token_s + d, end_s=r.end_s + d,
                        chunks=None if r.chunks is None else [(t + d, n) for t, n in r.chunks]) for r in run.rows]
        out.append(replace(run, rows=rows))
    return out


def compare(path: str, live: dict, sim: dict, classes: list[str], delays: dict | None = None,
            how: str = "hd") -> list[Cell]:
    """Cells of ``path``'s live runs against the simulated ones; ``delays``: {(policy, level
    label): seconds} of the path outside the engine (``path_delays``), added to the simulated
    side's token times. ``how``: the p50s' estimator (``fidelity.median``)."""
    cells = []
    for (policy, level), live_runs in live.items():
        if (policy, level) not in sim:
            continue
        sim_runs, sim_arms = sim[(policy, level)]
        d = (delays or {}).get((policy, level), 0.0)
        if d > 0:
            sim_runs = delayed(sim_runs, d)
        adaptive = not policy.startswith("static")
        for cls in [*classes, ALL]:
            arms = sim_arms.get(cls, {}) if cls != ALL else _sum_arms(sim_arms.values())
            which = None if cls == ALL else cls
            tops = [side_metrics([r], which).top_arm for r in live_runs] if adaptive and len(live_runs) > 1 else []
            h = len(live_runs) // 2  # two equal halves: an odd last round is in neither
            halves = [side_metrics(live_runs[:h], which).top_arm, side_metrics(live_runs[h:2 * h], which).top_arm] \
                if adaptive and h >= 2 else []
            cells.append(make_cell(path, policy, level, cls, adaptive,
                                   side_metrics(live_runs, which, noise=True, how=how),
                                   side_metrics(sim_runs, which, arms, how=how), tops, halves))
    return cells


def _sum_arms(per_class) -> dict[str, float]:
    out: dict[str, float] = {}
    for per in per_class:
        for a, n in per.items():
            out[a] = out.get(a, 0) + n
    return out


def scenario_yaml(opts: FidelityOptions, cfg, profile: str, recording, recording_file: str, prompt_set: str) -> dict:
    """A scenario ``adaptspec simulate`` runs: the closed-loop levels as a clients sweep (the
    open-loop levels and per-level think times are the command's own; the policies as close as
    the scenario schema writes them: thompson seeds its cost model from the calibrated profile
    where the live controller takes controller.cost_profile)."""
    from adaptspec.serve.loadtest import as_arrivals

    closed = [as_arrivals(lv) for lv in opts.levels if not as_arrivals(lv).open]
    pols = []
    for p in opts.policies:
        base, _, rest = p.partition(":")
        if base == "static":
            d, _, k = rest.partition(":")
            pols.append({"kind": "static", "drafter": d or "none", "k": int(k or 0)})
        elif base == "thompson":
            pols.append({"kind": "thompson", "fade_half_life_s": cfg.controller.fade_half_life_s,
                         "fade_min_steps": cfg.controller.fade_min_steps,
                         "seed_cost_from_profile": cfg.controller.cost_profile is not None})
        elif base == "ucb":
            pols.append({"kind": "ucb"})
    classes = []
    for c in opts.classes:
        acc = {}
        for d in cfg.drafters:
            src = acceptance_source(recording, c, d)
            acc[d] = ({"bernoulli": 0.0} if src is None else
                      {"recorded": {"file": recording_file, **({} if src == c else {"request_class": src}),
                                    **({} if opts.per_prompt else {"per_prompt": False}),
                                    **({} if opts.per_position else {"per_position": False})}})
        cc = {"name": c, "acceptance": acc}
        tc = next((x for x in cfg.classes if x.name == c), None)
        if tc is not None and (tc.tpot_s or tc.ttft_s):
            cc["target"] = {k: v for k, v in (("tpot_s", tc.tpot_s), ("ttft_s", tc.ttft_s)) if v}
        classes.append(cc)
    sc = {
        "name": "fidelity-mirror",
        "description": "written by adaptspec fidelity: the live closed-loop levels, prompt set, calibrated profile "
                       "and recorded acceptance",
        "seed": 0, "duration_s": opts.warmup_s + opts.duration_s, "warmup_s": opts.warmup_s, "drain_s": opts.drain_s,
        "timeline_bin_s": 1.0,
        "hardware": {"profile_file": profile},
        "drafters": list(cfg.drafters), "max_k": cfg.controller.max_k,
        "classes": classes,
        "workload": {"closed_loop": {"clients": closed[0].clients if closed else 1,
                                     "think_time": {"dist": closed[0].think if closed else "fixed",
                                                    "mean_s": closed[0].think_s if closed else 0.0}},
                     "prompt_set": {"path": prompt_set}},
        "policies": pols or [{"kind": "static", "drafter": "none", "k": 0}],
        "targets_from_slo": False,
    }
    if len(closed) > 1:
        sc["sweep"] = {"clients": [a.clients for a in closed]}
    return sc


def code_version() -> str:
    """The commit the code came from (``+dirty`` with local changes), if this is a git checkout."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) or "unknown"


def machine() -> str:
    import torch

    return (f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def run_fidelity(opts: FidelityOptions, console) -> tuple[list[Cell], list, dict]:
    import csv

    from adaptspec.models import cpu_gemm
    from adaptspec.serve.config import load_config
    from adaptspec.serve.inprocess import InProcessService
    from adaptspec.serve.loadtest import LoadSpec, load_prompts
    from adaptspec.sim.acceptance_replay import AcceptanceRecorder

    cfg = load_config(opts.config)
    spec = LoadSpec(list(opts.classes), opts.max_tokens, prompts=load_prompts(opts.prompts, list(opts.classes)),
                    prompts_from=opts.prompts or "bench")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    # the prompts as sent: `--prompts out/prompts.json` sends them again
    (out / "prompts.json").write_text(json.dumps(spec.pools(), indent=1, ensure_ascii=False))
    opts.policies = opts.policies or default_policies(cfg.drafters, cfg.controller.max_k)
    started = _dt.datetime.now().astimezone()
    if opts.profile:
        profile_path = Path(opts.profile)
    else:
        with console.status("calibrating the step costs on this machine"):
            profile_path = calibrate_for(cfg, out / "profile.json", opts)
        console.print(f"calibrated: {profile_path}")
    with console.status("loading the models"):
        svc = InProcessService(cfg, torch_threads=opts.torch_threads)
    recorder, step_log = AcceptanceRecorder(prompt_of=svc.prompt_of.get), StepLog()
    svc.engine.step_listeners.insert(0, step_log)
    svc.engine.step_listeners.append(recorder.observe_step)
    probe = None
    if opts.probe:
        from adaptspec.sim.speed_probe import prompt_probe, speed_probe

        probes = [("speed", speed_probe)] + ([("prompt", prompt_probe)] if opts.prompt_probe else [])
        for _, fn in probes:  # untimed: a fresh engine's first passes are slow
            fn(svc.engine)

        def probe():
            got = []
            for what, fn in probes:
                try:
                    got.append(fn(svc.engine))
                except Exception as e:  # a failed probe costs that run its factor, not the measurement
                    console.print(f"[yellow]{what} probe failed ({e}); this run takes its level's other runs' "
                                  "factor[/yellow]")
                    got.append(None)
            return got[0], got[1] if len(got) > 1 else None
    live = {"in-process": _live_levels(opts, spec, console, current=svc.policy,
                                       switch=lambda p, reset: svc.update_policy(p, reset=reset),
                                       run_one=lambda n: svc.run_level(n, opts.duration_s, spec,
                                                                       warmup_s=opts.warmup_s),
                                       step_log=step_log, probe=probe)}
    recording = recorder.to_file(f"{cfg.models.target} + {cfg.models.draft or 'no draft'} ({cfg.models.dtype}, "
                                 f"{cfg.models.device}), {started:%Y-%m-%d %H:%M %Z}, {recorder.steps} steps")
    recording.save(out / "acceptance.json")
    prompt_set, ps_rows = build_prompt_set(svc.engine, list(opts.classes), live["in-process"][0], opts.max_tokens,
                                           spec.pools())
    with open(out / "prompt_set.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_class", "num_prefill_tokens", "num_decode_tokens", "num_cached_tokens"])
        w.writerows(ps_rows)
    cost = sim_profile(profile_path, cfg, svc.engine)
    gap = host_gaps(step_log.gaps)
    # the live controller's own step-time predictions against the engine's (a model-based policy)
    cost_check = {p: c.table() for p, c in svc.core.cost_checks.items() if c.rows}
    gap_by_path = {"in-process": gap}
    if opts.grpc:
        del svc  # the service's replica gets the CPU to itself
        grpc_runs, grpc_summaries, grpc_log = _grpc_levels(cfg, opts, spec, console)
        live["grpc"] = (grpc_runs, grpc_summaries)
        gap_by_path["grpc"] = host_gaps(grpc_log.gaps)
    save_live(out / "live_runs.json", {p: runs for p, (runs, _) in live.items()}, cost.profile)
    meta = {
        "date": started.isoformat(timespec="seconds"), "machine": machine(), "code": code_version(),
        "cpu_kernel": cpu_gemm.status(),
        # the engine's TTFT (a service path's Row.path_s) counts from the request's posting to the
        # engine loop, the wait for the step in progress included (simulate_and_report's round trip)
        "engine_ttft_from": "posted",
        "config": opts.config or "(embedded default)",
        "models": {"target": cfg.models.target, "draft": cfg.models.draft, "dtype": cfg.models.dtype,
                   "device": cfg.models.device},
        "profile": str(profile_path), "levels": [_level_json(x) for x in opts.levels], "policies": opts.policies,
        "classes": list(opts.classes), "duration_s": opts.duration_s, "warmup_s": opts.warmup_s,
        "rounds": opts.rounds, "max_tokens": opts.max_tokens, "sim_seeds": opts.sim_seeds,
        "prompts": spec.prompts_from,
        "acceptance_steps": recorder.steps, "controller_cost_check": cost_check,
        "sim_limits": {k: getattr(cost.profile, k) for k in ("max_num_seqs", "kv_capacity_tokens",
                                                             "max_batched_tokens")},
        "host_gap_measured": _gaps_json(gap),
        # per path (the gRPC path's engine loop is another process's)
        "host_gap_by_path": {path: _gaps_json(g) for path, g in gap_by_path.items()},
        "live_summaries": {p: [asdict(s) for s in summ] for p, (_, summ) in live.items()},
    }
    runs = {p: r for p, (r, _) in live.items()}
    gaps = {path: {p: (a, b) for p, (a, b, _, _) in g.items()} for path, g in gap_by_path.items()}
    return simulate_and_report(cfg, opts, out, runs, recording, prompt_set, cost, gaps, meta, console, ps_rows)


def _gaps_json(gap: dict) -> dict:
    """``host_gaps``' result as the meta keeps it."""
    return {p: {"a_s": a, "per_request_s": b, "gaps": n, "mean_s": mean} for p, (a, b, n, mean) in gap.items()}


def host_gaps(gaps: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[float, float, int, float]]:
    """{policy: (a, b, gaps, mean gap)} fitted per policy (its controller's reports cost what
    they cost) and over all of them (``"*"``)."""
    from adaptspec.sim.fidelity import fit_host_gap

    out = {}
    pooled = [g for gs in gaps.values() for g in gs]
    for p, gs in [("*", pooled), *gaps.items()]:
        out[p] = (*fit_host_gap(gs), len(gs), float(np.mean([g for _, g in gs])) if gs else 0.0)
    return out


def speed_factors(live: dict, profile, enabled: bool = True,
                  tolerance: float = math.inf) -> tuple[dict, dict, list[str]]:
    """How fast the live engine ran each run against the calibration: {(policy, level label):
    [speed factor per run, in round order]} (``speed_factor`` of the mean of the run's probes
    before and after against the profile's reference, the mean of the calibration's start and
    end probes), the meta's ``speed`` entry (every run's probes and factor, min / median /
    max) and notes. ``live``: {path: {(policy, level): [Run]}}; the first path with probes
    gives the factors (the gRPC path's engine runs in another process: its cells are
    compared with the simulation at the in-process runs' speeds). Nothing to go by (disabled,
    no probes on file, a profile without a probe): no factors, i.e. factor 1.

    ``tolerance``: a run whose probe after it differs from the one before by more than this at
    any batch size gets no factor (nan: simulated at the mean of its level and policy's other
    rounds' factors, or 1): its two probes are half a second each, a minute apart, and on a
    machine whose speed switches within seconds neither says how fast the minute between them
    ran; where they agree, their mean does (measurements: simulations/FIDELITY.md)."""
    from adaptspec.sim.speed_probe import probe_to_json, speed_factor, speed_ratios, summary

    ref_file = getattr(profile, "probe", None)
    ref = ref_file.reference() if ref_file is not None else None
    meta: dict = {"applied": False, "reference_s": probe_to_json(ref), "per_run": []}
    if ref_file is not None:
        start = dict(zip(ref_file.batch_sizes, ref_file.start_s))
        end = dict(zip(ref_file.batch_sizes, ref_file.end_s))
        meta["calibration_start_s"], meta["calibration_end_s"] = probe_to_json(start), probe_to_json(end)
        meta["calibration_drift"] = speed_factor(end, start)  # end / start: the calibration's own drift
    if not enabled:
        return {}, meta, ["speed probes off (--no-probe): every run simulated at the calibration's speed"]
    if ref is None:
        return {}, meta, ["the profile has no speed probe (calibrated before probes were taken): every run "
                          "simulated at the calibration's speed (factor 1)"]
    got = _run_factors(live, "before", "after", lambda now: speed_factor(now, ref),
                       lambda now: {"ratio_by_batch": probe_to_json(speed_ratios(now, ref))}, tolerance)
    if got is None:
        return {}, meta, ["the live runs have no speed probes (measured before probes were taken): every run "
                          "simulated at the calibration's speed (factor 1)"]
    factors, meta["per_run"] = got
    meta.update(summary([f for fs in factors.values() for f in fs]))
    meta["applied"] = True
    meta["tolerance"] = None if math.isinf(tolerance) else tolerance
    untrusted = [r for r in meta["per_run"] if not r["agreed"]]
    notes = []
    if untrusted:
        notes.append(f"{len(untrusted)} of {len(meta['per_run'])} runs' speed probes before and after differ by more "
                     f"than {tolerance:.0%} (--probe-tolerance): those runs are simulated without their factor "
                     f"(`--resimulate DIR --speed-from steps` reads each run's speed off its own steps)")
    return factors, meta, notes


def _run_factors(live: dict, before: str, after: str, factor, extra=None,
                 tolerance: float = math.inf) -> tuple[dict, list] | None:
    """{(policy, level label): [``factor`` of the mean of each run's ``Run.probe[before]`` and
    ``[after]`` (nan: the run has neither, or they differ by more than ``tolerance``)]} and a
    record per probed run (its probes, how far apart they were, ``extra(mean)``, its factor),
    from the first path whose runs carry such probes (the gRPC path's engine runs in another
    process and is not probed); None when no path does."""
    from adaptspec.sim.speed_probe import mean_probe, probe_to_json, speed_ratios

    has = lambda r: bool(r.probe) and bool(r.probe.get(before) or r.probe.get(after))  # noqa: E731
    probed = next((runs for runs in live.values() if any(has(r) for rs in runs.values() for r in rs)), None)
    if probed is None:
        return None
    factors: dict = {}
    per_run = []
    for (policy, level), rs in probed.items():
        fs = []
        for i, r in enumerate(rs):
            if not has(r):
                fs.append(math.nan)
                continue
            now = mean_probe(r.probe.get(before), r.probe.get(after))
            apart = speed_ratios(r.probe.get(after) or {}, r.probe.get(before) or {})
            spread = max((abs(x - 1.0) for x in apart.values()), default=0.0)
            f = factor(now) if spread <= tolerance else math.nan
            fs.append(f)
            per_run.append({"policy": policy, "level": level, "round": i,
                            "before_s": probe_to_json(r.probe.get(before)), "after_s": probe_to_json(r.probe.get(after)),
                            **(extra(now) if extra is not None else {}), "apart": spread,
                            "agreed": spread <= tolerance, "factor": None if math.isnan(f) else f})
        factors[(policy, level)] = fs
    return factors, per_run


def prompt_factors(live: dict, profile, enabled: bool = True, tolerance: float = math.inf) -> tuple[dict, dict]:
    """Each run's prompt factor (``speed_probe.prompt_factor`` of the mean of its prompt probes
    before and after against ``profile``'s prompt table): {(policy, level label): [factor per
    run]} (nan: not probed) and the meta's ``prompt_speed`` entry. The first path with prompt
    probes gives them (as ``speed_factors``, ``tolerance`` too); nothing to go by: {} (the
    prompt table then moves with the run's speed factor)."""
    from adaptspec.sim.speed_probe import probe_to_json, prompt_factor, summary

    meta: dict = {"applied": False, "table_s": None}
    if getattr(profile, "prefill_tokens", None):
        meta["table_s"] = probe_to_json(dict(zip((int(x) for x in profile.prefill_tokens), profile.prefill_s)))
    if not enabled or meta["table_s"] is None:
        return {}, meta
    got = _run_factors(live, "prompt_before", "prompt_after", lambda now: prompt_factor(now, profile),
                       tolerance=tolerance)
    if got is None:
        return {}, meta
    factors, per_run = got
    meta.update(summary([f for fs in factors.values() for f in fs]))
    meta["per_run"] = per_run
    meta["applied"] = True
    return factors, meta


def step_factors(live: dict, cost) -> tuple[dict, dict, dict, dict, list[str]]:
    """Each run's speed read off its own engine steps instead of probes around it: the run's
    decode steps' measured time over the same steps priced on ``cost`` (the factor), and its
    prompt-carrying steps' time less their decode rows at that factor over their prompt
    chunks' price (the prompt factor). Returns (speed, prompt_speed, speed meta, prompt meta,
    notes), the factors shaped as ``speed_factors`` / ``prompt_factors`` give them (nan: a run
    with no such steps on file).

    Why: on a machine whose speed moves within a minute, half-second probes a minute apart
    often disagree, and a run simulated at the calibration's speed carries that drift
    into every cell. Read off the run's steps, the factor is one number per run taken over
    the whole window, so what is left between live and simulated is the mix of step shapes,
    the scheduler, the acceptance and the relative prices of shapes -- but no longer the
    profile's absolute level: a check of the model, not of the calibration's speed."""
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.sim.speed_probe import summary

    double = ProfileCostModel(cost.profile.scaled(1.0, 2.0))  # prompt table alone doubled
    speed: dict = {}
    prompt_speed: dict = {}
    per_run = []
    logged = next((runs for runs in live.values() if any(r.shapes for rs in runs.values() for r in rs)), None)
    if logged is None:
        return {}, {}, {"applied": False, "source": "steps"}, {"applied": False, "source": "steps"}, [
            "--speed-from steps: no live run on file logged its engine steps: every run simulated at the "
            "calibration's speed (factor 1)"]
    for key, rs in logged.items():
        fs, fps = [], []
        for i, r in enumerate(rs):
            live_d = priced_d = live_p = decode_p = table_p = 0.0
            n_d = n_p = 0
            for s in r.shapes or []:
                t = float(sum(s[6:9]))
                one = sum(step_shapes.reprice(s, cost))
                if s[2] > 0:  # a prompt chunk rode along: T = decode rows + prompt part (linear in each table)
                    prompt_part = sum(step_shapes.reprice(s, double)) - one
                    live_p, decode_p, n_p = live_p + t, decode_p + one - prompt_part, n_p + 1
                    table_p += prompt_part
                else:
                    live_d, priced_d, n_d = live_d + t, priced_d + one, n_d + 1
            f = live_d / priced_d if n_d and priced_d > 0 else math.nan
            fp = (live_p - (f if math.isfinite(f) else 1.0) * decode_p) / table_p if n_p and table_p > 0 else math.nan
            fp = fp if math.isfinite(fp) and fp > 0 else math.nan
            fs.append(f)
            fps.append(fp)
            per_run.append({"policy": key[0], "level": key[1], "round": i, "decode_steps": n_d, "prompt_steps": n_p,
                            "factor": None if math.isnan(f) else f, "prompt_factor": None if math.isnan(fp) else fp})
        speed[key], prompt_speed[key] = fs, fps
    meta = {"applied": True, "source": "steps", "per_run": per_run,
            **summary([f for fs in speed.values() for f in fs])}
    p_meta = {"applied": True, "source": "steps", **summary([f for fs in prompt_speed.values() for f in fs])}
    notes = ["--speed-from steps: every run simulated at the speed its own engine steps ran against the profile "
             "(decode steps: the factor; prompt-carrying steps: the prompt factor); the cells then check the "
             "step mix, scheduler and acceptance, not the calibration's absolute speed"]
    return speed, prompt_speed, meta, p_meta, notes


def simulate_and_report(cfg, opts: FidelityOptions, out: Path, live: dict, recording, prompt_set, cost,
                        gap: dict, meta: dict, console, ps_rows=None, inputs: tuple[Path, Path] | None = None
                        ) -> tuple[list[Cell], list, dict]:
    """The simulated side of every (level, policy) and the comparison: ``fidelity.json``,
    ``scenario.yaml``; ``live``: {path: {(policy, level label): [Run]}}; ``gap``: {path:
    ``host_gaps``' (a, b) per policy} (a path without its own: the first path's); ``ps_rows``:
    the prompt set's CSV rows, for ``cache_replay`` (with ``opts.cache_replay``); ``inputs``:
    the recording's and the prompt set's files when they are not in ``out`` (a resimulation).

    Every path whose runs logged their engine steps is simulated on its own: its runs' speed
    (the gRPC path's replica is another process, whose speed and host loop are its own), its
    host gaps and the prefix-cache hits its requests had; a path without them is compared with
    the first path's simulated runs."""
    import yaml

    from adaptspec.sim.scenario import ClassSpec

    truths, notes = truths_from_recording(recording, list(opts.classes), cfg.drafters, per_prompt=opts.per_prompt,
                                          per_position=opts.per_position)
    class_specs = [ClassSpec(name=c, acceptance={"ngram": {"bernoulli": 0.0}}) for c in opts.classes]
    paths = list(live)
    sims, speeds, path_meta = {}, {}, {}
    delays = path_delays(live) if opts.path_delay else {}
    # runs whose engine TTFT counts from the request's posting to the engine (engine_ttft_from):
    # their path delay is the path alone, and a closed loop's client pays it between requests;
    # before, it also held the wait for the engine's step in progress, which stood in for that
    pays_round_trip = meta.get("engine_ttft_from") == "posted"
    for path in paths:
        own = {path: live[path]}
        if path != paths[0] and not any(r.shapes for rs in own[path].values() for r in rs):
            # no step log of its own (a file from before the replicas logged theirs): the first
            # path's simulated runs, as they were then
            sims[path] = sims[paths[0]]
            path_meta[path] = {"simulated_as": paths[0]}
            continue
        used_gap = (gap.get(path) or gap.get(paths[0]) or {}) if opts.host_gap else {}
        speed, prompt_speed, speed_meta, prompt_meta, speed_notes = _path_speed(opts, own, cost)
        if path == paths[0]:
            notes += speed_notes
        run_prompts, served = cache_replay(ps_rows, own, list(opts.classes)) if opts.cache_replay and ps_rows \
            else ({}, {})
        sims[path] = simulate_all(cfg, opts, cost, truths, class_specs, prompt_set, host_gap=used_gap, speed=speed,
                                  run_prompts=run_prompts, prompt_speed=prompt_speed,
                                  round_trip=delays.get(path) if pays_round_trip else None)
        speeds[path] = (speed, prompt_speed)
        path_meta[path] = {
            "simulated_as": path, "speed": speed_meta, "prompt_speed": prompt_meta,
            "host_gap": {p: {"a_s": a, "per_request_s": b} for p, (a, b) in used_gap.items()},
            "cache_replay": {f"{p} {lv}": [None if math.isnan(x) else round(x, 2) for x in v]
                             for (p, lv), v in served.items()} if served else None}
    if len(paths) > 1:
        own = [p for p in paths[1:] if path_meta[p]["simulated_as"] == p]
        notes.append(f"{', '.join(own)}: simulated on its own runs' speed, host gaps and prefix-cache hits"
                     if own else f"{', '.join(paths[1:])}: compared with the {paths[0]} path's simulated runs "
                     "(no engine steps on file for it)")
    replay = position_replay(truths)
    if replay["replayed"] + replay["drawn"]:
        notes.append(f"acceptance: {replay['replayed']} of {replay['replayed'] + replay['drawn']} simulated "
                     f"request-steps replayed at their prompt's position as they went live, the rest drawn")
    if pays_round_trip and delays:
        notes.append(f"{', '.join(delays)}: a closed loop's next request reaches the simulated engine the level's "
                     "path delay after the reply (the path there and back)")
    cells = []
    for path, runs in live.items():
        cells += compare(path, runs, sims[path], list(opts.classes), delays.get(path), how=opts.median)
    goal_list = goals(cells)
    first = path_meta[paths[0]]
    meta = {**meta, "notes": notes, "median": opts.median, "speed": first["speed"],
            "prompt_speed": first["prompt_speed"],
            "position_replay": replay, "host_gap": first["host_gap"],
            "sim_snapshots_s": cfg.controller.report_interval_s if opts.snapshots else None,
            "path_delay_s": {p: {f"{pol} {lv}": d for (pol, lv), d in per.items()} for p, per in delays.items()},
            "cache_replay": first["cache_replay"], "paths": path_meta}
    (out / "fidelity.json").write_text(to_json(cells, goal_list, meta))
    tables = {}
    for path in speeds:  # the paths simulated on their own
        tables.update(shape_tables({path: live[path]}, sims[path], cost, *speeds[path]))
    if tables:
        (out / "step_shapes.md").write_text(step_shapes.markdown(tables))
        (out / "step_shapes.json").write_text(json.dumps(
            [{"path": p, "policy": pol, "level": lv, "rows": rows} for (p, pol, lv), rows in tables.items()],
            indent=1, default=lambda x: None))
    # the profile by a path relative to the folder when it lies inside it (a calibration this run
    # took), so the folder can move (into docs/results/, say) and its scenario still runs
    profile, folder = Path(meta["profile"]).resolve(), out.resolve()
    if profile.is_relative_to(folder):
        profile = profile.relative_to(folder)
    # a resimulation's scenario names the source folder's recording and prompt set, as they are kept there
    rec_file, ps_file = (Path(p).resolve() for p in (inputs or (out / "acceptance.json", out / "prompt_set.csv")))
    (out / "scenario.yaml").write_text(yaml.safe_dump(scenario_yaml(opts, cfg, str(profile), recording,
                                                                    Path(os.path.relpath(rec_file, folder)).as_posix(),
                                                                    Path(os.path.relpath(ps_file, folder)).as_posix()),
                                                      sort_keys=False))
    return cells, goal_list, meta


def _path_speed(opts: FidelityOptions, live: dict, cost) -> tuple[dict, dict, dict, dict, list[str]]:
    """(speed, prompt speed, their metas, notes) of ``live``'s runs as ``opts.speed_from`` reads them."""
    if opts.speed_from == "steps":
        return step_factors(live, cost)
    probes = opts.probe and opts.speed_from == "probes"
    speed, speed_meta, speed_notes = speed_factors(live, cost.profile, probes, opts.probe_tolerance)
    prompt_speed, prompt_meta = prompt_factors(live, cost.profile, probes and opts.prompt_probe, opts.probe_tolerance)
    if opts.speed_from == "none":
        speed_notes = ["--speed-from none: every run simulated at the calibration's speed (factor 1)"]
    return speed, prompt_speed, speed_meta, prompt_meta, speed_notes


def shape_tables(live: dict, sim: dict, cost, speed: dict, prompt_speed: dict) -> dict:
    """{(path, policy, level label): ``step_shapes.table``} for every live level whose engine
    steps were logged; live round r's steps are priced on the cost its simulated round ran on."""
    from adaptspec.control.costs import ProfileCostModel

    out = {}
    for path, runs in live.items():
        for key, rs in runs.items():
            if key not in sim or not any(r.shapes for r in rs):
                continue
            factor = _round_factors(speed.get(key, []), 1.0)
            p_factor = _round_factors(prompt_speed.get(key, []), None)

            def cost_of(r, factor=factor, p_factor=p_factor):
                f, fp = factor(r), p_factor(r)
                return cost if f == 1.0 and fp is None else ProfileCostModel(cost.profile.scaled(f, fp))

            out[(path, *key)] = step_shapes.table([r.shapes or [] for r in rs],
                                                  [r.shapes or [] for r in sim[key][0]], cost_of)
    return out


# ---- the live runs on file: simulate them again (a changed model) without running them again ---
def save_live(path: Path, live: dict, profile=None) -> None:
    """{path: {(policy, level): [Run]}} as JSON. A row keeps what the comparison reads; its
    token chunks become one chunk of the tokens that arrived inside its run's window (all
    that ``tokens_in_window`` needs for that window). A probed run keeps its speed probes, and
    for the reader its speed factor against ``profile``'s probe (a resimulation computes it
    again against the profile it uses)."""
    from adaptspec.sim.fidelity import tokens_in_window
    from adaptspec.sim.speed_probe import mean_probe, probe_to_json, speed_factor

    ref = profile.probe.reference() if profile is not None and profile.probe is not None else None

    data = {}
    for p, runs in live.items():
        data[p] = []
        for (policy, level), rs in runs.items():
            for run in rs:
                w0, w1 = run.window
                rows = [[r.request_class, r.start_s, r.first_token_s, r.end_s, r.tokens, r.cut, r.error,
                         tokens_in_window(r, w0, w1), r.prompt_index, r.arms, r.cached_tokens, r.path_s]
                        for r in run.rows]
                item = {"policy": policy, "level": level, "window": [w0, w1], "steps": run.steps,
                        "step_wall_s": run.step_wall_s, "busy_s": run.busy_s, "rows": rows}
                if run.shapes is not None:
                    item["shapes"] = [[round(x, 6) if isinstance(x, float) else x for x in sh] for sh in run.shapes]
                if run.probe:
                    item["probe"] = {k: probe_to_json(v) for k, v in run.probe.items()}
                    if ref is not None:
                        f = speed_factor(mean_probe(run.probe["before"], run.probe["after"]), ref)
                        item["speed_factor"] = None if math.isnan(f) else f
                data[p].append(item)

    def clean(x):
        return None if isinstance(x, float) and math.isnan(x) else x

    for runs in data.values():
        for run in runs:
            run["rows"] = [[clean(v) for v in row] for row in run["rows"]]
    path.write_text(json.dumps({"version": 4, "live": data}, separators=(",", ":")))


def load_live(path: Path) -> dict:
    """``save_live``'s file (or gzipped, ``.gz``: how the results folders keep the large ones);
    versions 1 (no speed probes), 2 (no path delays) and 3 (no step shapes) too."""
    from adaptspec.sim.report import read_json_file
    from adaptspec.sim.speed_probe import probe_from_json

    data = read_json_file(path)
    nan = math.nan
    out: dict = {}
    for p, runs in data["live"].items():
        per = out.setdefault(p, {})
        for run in runs:
            w0, w1 = run["window"]
            rows = [Row(c, start, nan if first is None else first, nan if end is None else end, tokens, cut, error,
                        [(w0, in_window)], idx, dict(arms), cached, nan if not rest or rest[0] is None else rest[0])
                    for c, start, first, end, tokens, cut, error, in_window, idx, arms, cached, *rest in run["rows"]]
            per.setdefault((run["policy"], run["level"]), []).append(
                Run(rows, (w0, w1), run["steps"], run["step_wall_s"], run["busy_s"],
                    probe={k: probe_from_json(v) for k, v in run["probe"].items()} if run.get("probe") else None,
                    shapes=run.get("shapes")))
    return out


def resimulate(src: Path, out: Path, console, *, config: str | None = None, host_gap: bool = True,
               snapshots: bool = True, sim_seeds: int | None = None,
               profile: str | None = None, probe: bool = True, prompt_probe: bool = True,
               cache_replay: bool = True, per_prompt: bool = True, per_position: bool = True,
               probe_tolerance: float = 0.1, path_delay: bool = True,
               speed_from: str = "probes", median: str = "hd") -> tuple[list[Cell], list, dict]:
    """The simulated side again, against the live runs a fidelity run left in ``src``
    (``live_runs.json``, ``fidelity.json`` and ``acceptance.json``, each or its ``.gz``;
    ``prompt_set.csv``; its profile): for a changed simulator, without the live runs (and the
    quiet machine) they took. ``profile``: another step-cost profile (e.g. refitted from the
    run's calibration steps) than the run's.
    ``probe``: simulate each run at the speed its probes on file say, against the profile's
    probe (none on file, or a profile without one: factor 1, and a note says so).
    ``cache_replay``: each run's prompt set from the prefix-cache hits its live run recorded."""
    import csv

    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.serve.config import load_config
    from adaptspec.serve.loadtest import Arrivals
    from adaptspec.sim.acceptance_replay import AcceptanceFile
    from adaptspec.sim.closed_loop import read_prompt_set
    from adaptspec.sim.report import read_json_file
    from adaptspec.sim.scenario import ClassSpec, PromptSetSpec

    src = Path(src)

    def found(name: str) -> Path:  # the file, or where the results folders keep it gzipped
        return next((p for p in (src / name, src / f"{name}.gz") if p.is_file()), src / name)

    live_file, report_file, acceptance_file = found("live_runs.json"), found("fidelity.json"), found("acceptance.json")
    need = [report_file, live_file, acceptance_file, src / "prompt_set.csv"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise ValueError(f"--resimulate: {src} lacks {missing} (a folder an `adaptspec fidelity` run wrote)")
    meta = read_json_file(report_file)["meta"]
    cfg = load_config(config if config is not None else (None if meta["config"] == "(embedded default)"
                                                         else meta["config"]))
    levels = []
    for lv in meta["levels"]:
        a = Arrivals(**{k: v for k, v in lv.items() if k != "label"})
        levels.append(a if a.open or a.think_s else a.clients)
    opts = FidelityOptions(config=config, levels=levels, policies=list(meta["policies"]),
                           classes=list(meta["classes"]), max_tokens=meta["max_tokens"], duration_s=meta["duration_s"],
                           warmup_s=meta["warmup_s"], rounds=meta["rounds"], profile=profile or meta["profile"],
                           sim_seeds=sim_seeds or meta["sim_seeds"], host_gap=host_gap, snapshots=snapshots,
                           probe=probe, prompt_probe=prompt_probe, cache_replay=cache_replay, per_prompt=per_prompt,
                           per_position=per_position, probe_tolerance=probe_tolerance, path_delay=path_delay,
                           speed_from=speed_from, median=median, out=Path(out))
    if profile is not None:
        meta = {**meta, "profile": str(profile), "profile_measured": meta["profile"]}
    profile = Path(meta["profile"])
    if not profile.is_file():
        profile = src / "profile.json"
    model = ProfileCostModel.load(profile)
    cost = ProfileCostModel(model.profile.model_copy(update=meta["sim_limits"]))
    recording = AcceptanceFile.load(acceptance_file)
    prompt_set = read_prompt_set(PromptSetSpec(path="prompt_set.csv"), src,
                                 [ClassSpec(name=c, acceptance={"ngram": {"bernoulli": 0.0}}) for c in opts.classes])
    with open(src / "prompt_set.csv", newline="") as f:
        ps_rows = [(r["request_class"], int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]),
                    int(r.get("num_cached_tokens") or 0)) for r in csv.DictReader(f)]
    Path(out).mkdir(parents=True, exist_ok=True)
    live = load_live(live_file)
    by_path = meta.get("host_gap_by_path") or {next(iter(live)): meta.get("host_gap_measured") or {}}
    gap = {}
    for path, gap_meta in by_path.items():
        if "a_s" in gap_meta:  # one line for every policy (the first runs of this command)
            gap_meta = {"*": gap_meta}
        gap[path] = {p: (float(g.get("a_s", 0.0)), float(g.get("per_request_s", 0.0))) for p, g in gap_meta.items()}
    meta = {**meta, "resimulated": {"from": str(src), "date": _dt.datetime.now().astimezone().isoformat(
        timespec="seconds"), "code": code_version()}}
    return simulate_and_report(cfg, opts, Path(out), live, recording, prompt_set, cost, gap, meta, console, ps_rows,
                               inputs=(acceptance_file, src / "prompt_set.csv"))


def _level_json(level) -> dict:
    from adaptspec.serve.loadtest import as_arrivals

    a = as_arrivals(level)
    return {"label": a.label, **json.loads(json.dumps(asdict(a)))}
