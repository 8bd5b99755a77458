"""Closed-loop workloads and prompt sets: the simulator's mirror of ``adaptspec loadtest``.

A closed loop has ``clients`` clients; each sends a request, waits for its last token,
pauses for its think time and sends the next, until ``duration_s`` (none starts after it;
those in flight finish in the drain). Arrivals therefore depend on the service's speed,
so the requests are made during the run, not drawn up front as open-loop arrivals are.

A prompt set gives each class's prompts as (prompt tokens, output tokens) rows in the
order the load test sends them (less the prompt tokens a prefix cache served, when the
row says: the simulator prefills the rest): with ``order: round_robin`` the n-th request overall takes
class ``n mod C`` and that class's prompt ``(n div C) mod len(pool)``, which is what the
in-process load test does with its counter (the gRPC load test's clients interleave the
same sequence).
"""
from __future__ import annotations

import copy
import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from adaptspec.control import Policy
from adaptspec.sim.replica import Recorder, Replica
from adaptspec.sim.scenario import ClassSpec, PromptSetSpec, Scenario, ThinkTimeSpec, WorkloadSpec
from adaptspec.sim.simulator import RunOutput, RunSetup
from adaptspec.sim.workload import Requests, arrival_times, sample_lengths


REFUSED_BACKOFF_S = 0.05  # adaptspec loadtest's pause after a RESOURCE_EXHAUSTED


@dataclass(slots=True)
class PromptSet:
    """Per class, its prompts' (prompt tokens, output tokens), in send order. ``prompt_ids``:
    which prompt each entry is (an index into the class's own prompts; a pool that holds a
    prompt more than once, as ``fidelity_run.cache_replay``'s does, repeats it); None: entry i
    is prompt i. ``cached_tokens``: the prompt tokens a prefix cache served each entry (not in
    its ``prompt_tokens``: they are read as context, not prefilled); None: none."""

    prompt_tokens: list[np.ndarray]  # [C] arrays of [P_c] ints
    output_tokens: list[np.ndarray]
    prompt_ids: list[np.ndarray] | None = None  # [C] arrays of [P_c] ints
    cached_tokens: list[np.ndarray] | None = None  # [C] arrays of [P_c] ints


def read_prompt_set(spec: PromptSetSpec, base: Path, classes: list[ClassSpec]) -> PromptSet:
    path = Path(spec.path)
    if not path.is_absolute():
        path = base / path
    if not path.exists():
        raise ValueError(f"workload.prompt_set.path: {path} does not exist")
    names = {c.name: i for i, c in enumerate(classes)}
    rows: list[list[tuple[int, int, int]]] = [[] for _ in classes]
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"request_class", "num_prefill_tokens", "num_decode_tokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"workload.prompt_set.path: {path} lacks columns "
                             f"{sorted(need - set(reader.fieldnames or ()))}")
        for line, row in enumerate(reader, start=2):
            i = names.get(row["request_class"])
            if i is None:
                continue  # a class the scenario does not run
            try:
                p, o = int(float(row["num_prefill_tokens"])), int(float(row["num_decode_tokens"]))
                cached = int(float(row.get("num_cached_tokens") or 0))
            except ValueError:
                raise ValueError(f"workload.prompt_set.path: {path} line {line}: token counts must be numbers") from None
            if p < 1 or o < 1 or not 0 <= cached:
                raise ValueError(f"workload.prompt_set.path: {path} line {line}: token counts must be >= 1 "
                                 f"(cached >= 0)")
            # the simulator has no prefix cache: what one served is not prefilled (one token always
            # is), but the request's passes still read it as context
            k = min(cached, p - 1)
            rows[i].append((p - k, o, k))
    missing = [c.name for c, r in zip(classes, rows) if c.weight > 0 and not r]
    if missing:
        raise ValueError(f"workload.prompt_set.path: {path} has no prompts of classes {missing}")
    col = lambda j: [np.array([r[j] for r in rs], dtype=np.int64) for rs in rows]  # noqa: E731
    return PromptSet(col(0), col(1), cached_tokens=col(2))


class RequestSource:
    """The class and lengths of each next request, in send order."""

    def __init__(self, classes: list[ClassSpec], prompt_set: PromptSet | None, order: str,
                 rng: np.random.Generator) -> None:
        w = np.array([c.weight for c in classes], dtype=float)
        if w.sum() <= 0:
            raise ValueError("classes: at least one weight must be > 0")
        self.classes, self.prompts, self.order, self.rng = classes, prompt_set, order, rng
        self.p = w / w.sum()
        self.active = np.flatnonzero(w > 0)
        self.count = 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(class_idx, prompt_tokens, output_tokens, prompt_idx, cached_tokens), each [n];
        prompt_idx: which prompt of its class's prompt set (``PromptSet.prompt_ids``; -1
        without a set); cached_tokens: ``PromptSet.cached_tokens`` (0 without)."""
        idx = np.arange(self.count, self.count + n)
        self.count += n
        ps = self.prompts
        if ps is not None and self.order == "round_robin":
            A = self.active.size
            cls = self.active[idx % A]
            k = idx // A
            pick = np.array([k_ % ps.prompt_tokens[c].size for c, k_ in zip(cls, k)], dtype=np.int64)
        else:
            cls = self.rng.choice(len(self.classes), size=n, p=self.p)
            pick = np.array([self.rng.integers(ps.prompt_tokens[c].size) for c in cls], dtype=np.int64) \
                if ps is not None else np.full(n, -1, dtype=np.int64)
        p = np.zeros(n, dtype=np.int64)
        o = np.zeros(n, dtype=np.int64)
        k = np.zeros(n, dtype=np.int64)
        ids = pick.copy()
        for c in np.unique(cls):
            m = cls == c
            if ps is not None:
                p[m], o[m] = ps.prompt_tokens[c][pick[m]], ps.output_tokens[c][pick[m]]
                if ps.prompt_ids is not None:
                    ids[m] = ps.prompt_ids[c][pick[m]]
                if ps.cached_tokens is not None:
                    k[m] = ps.cached_tokens[c][pick[m]]
            else:
                spec = self.classes[c]
                p[m] = sample_lengths(spec.prompt_tokens, int(m.sum()), self.rng)
                o[m] = sample_lengths(spec.output_tokens, int(m.sum()), self.rng)
        return cls.astype(np.int64), np.maximum(p, 1), np.maximum(o, 1), ids, k


def request_source(wl: WorkloadSpec, classes: list[ClassSpec], base: Path, rng: np.random.Generator) -> RequestSource:
    ps = read_prompt_set(wl.prompt_set, base, classes) if wl.prompt_set is not None else None
    return RequestSource(classes, ps, wl.prompt_set.order if wl.prompt_set else "random", rng)


def open_loop_requests(wl: WorkloadSpec, classes: list[ClassSpec], duration_s: float, base: Path,
                       rng: np.random.Generator) -> Requests:
    """Open-loop arrivals (``wl.rate``) whose classes and lengths come from the prompt set.
    The arrival times are drawn first from ``rng``, as ``synthesize`` draws them, so the same
    seed gives the same times with or without a prompt set."""
    t = arrival_times(wl, duration_s, rng)
    cls, p, o, pick, cached = request_source(wl, classes, base, rng).take(t.size)
    return Requests(t, p, o, cls, pick, cached)


def think_times(spec: ThinkTimeSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    if spec.mean_s <= 0:
        return np.zeros(n)
    if spec.dist == "fixed":
        return np.full(n, spec.mean_s)
    return rng.exponential(spec.mean_s, n)


def _grow(req: Requests, rec: Recorder, size: int) -> None:
    """Make room for ``size`` requests; replicas and the recorder read the arrays through these
    objects, so replacing the arrays is seen everywhere."""
    def pad(a: np.ndarray, fill) -> np.ndarray:
        return np.concatenate([a, np.full(size - a.size, fill, dtype=a.dtype)])

    req.arrival_s = pad(req.arrival_s, np.inf)
    req.prompt_tokens, req.output_tokens, req.class_idx = (pad(a, 1) for a in
                                                           (req.prompt_tokens, req.output_tokens, req.class_idx))
    if req.prompt_idx is not None:
        req.prompt_idx = pad(req.prompt_idx, -1)
    if req.cached_tokens is not None:
        req.cached_tokens = pad(req.cached_tokens, 0)
    rec.first_token_s, rec.finish_s = pad(rec.first_token_s, np.nan), pad(rec.finish_s, np.nan)
    if hasattr(rec, "refused"):
        rec.refused = pad(rec.refused, False)


def _replicas(setup: RunSetup, policy: Policy, req: Requests, rec: Recorder) -> list[Replica]:
    """The run's replicas, as ``simulate`` makes them (with the deployment's drafters and
    admission control where this version of the setup has them)."""
    kw = {}
    if hasattr(setup, "drafters"):
        kw["drafters"] = setup.drafters
    if getattr(setup, "admission", None) is not None:
        kw["admission"] = copy.deepcopy(setup.admission)
    if getattr(setup, "pacer", None) is not None:
        kw["pacer"] = copy.deepcopy(setup.pacer)
    if any(getattr(setup, "host_gap", ())):
        kw["host_gap"] = setup.host_gap
    return [Replica(setup.cost, policy, setup.classes, req, rec, np.random.default_rng([setup.seed, i]), setup.max_k,
                    **kw) for i in range(setup.replicas)]


def simulate_closed_loop(setup: RunSetup, policy: Policy, clients: int, think: ThinkTimeSpec, source: RequestSource,
                         *, on_shift: Callable[[], None] | None = None,
                         progress: Callable[[float], None] | None = None,
                         round_trip_s: float = 0.0) -> tuple[RunOutput, Requests]:
    """Run ``policy`` with ``clients`` closed-loop clients; ``setup.requests`` is ignored (the
    requests made are returned, in send order). Deterministic for a given seed.
    ``round_trip_s``: seconds from a request's end in the engine to the client's next request
    reaching it, on top of the think time (a service's path there and back: the reply's way
    out, the next request's way in); the arrival times are the engine's."""
    t_wall = time.perf_counter()
    rng = np.random.default_rng(setup.seed)
    think_rng = np.random.default_rng([setup.seed, 2])
    horizon = setup.duration_s + setup.drain_s
    num_bins = int(np.ceil(horizon / setup.bin_s)) + 1
    cap = max(4 * clients, 64)
    req = Requests(np.full(cap, np.inf), np.ones(cap, dtype=np.int64), np.ones(cap, dtype=np.int64),
                   np.zeros(cap, dtype=np.int64), np.full(cap, -1, dtype=np.int64), np.zeros(cap, dtype=np.int64))
    rec = Recorder(cap, len(setup.classes), policy.table.arms, setup.bin_s, num_bins,
                   step_shapes=[] if setup.record_shapes else None,
                   request_arms={} if setup.record_shapes else None)
    replicas = _replicas(setup, policy, req, rec)
    shifts = sorted({c.shift_at_s for c in setup.classes if c.shift_at_s is not None})
    next_send = np.zeros(clients)  # when each client sends its next request (inf: waiting for one, or done)
    in_flight: dict[int, int] = {}  # request -> client
    n = rr = steps = 0
    now = next_report = 0.0
    while True:
        c = int(np.argmin(next_send))
        ta = next_send[c]
        r = min(replicas, key=lambda x: x.busy_until) if len(replicas) > 1 else replicas[0]
        tr = r.busy_until
        if ta == np.inf and tr == np.inf:
            break
        if ta <= tr:
            next_send[c] = np.inf
            if ta >= setup.duration_s:
                continue  # this client is done
            if n == req.arrival_s.size:
                _grow(req, rec, 2 * n)
            cls, p, o, pick, cached = source.take(1)
            req.arrival_s[n], req.class_idx[n], req.prompt_tokens[n], req.output_tokens[n] = ta, cls[0], p[0], o[0]
            req.prompt_idx[n], req.cached_tokens[n] = pick[0], cached[0]
            if setup.router == "round_robin":
                target = replicas[rr % len(replicas)]
                rr += 1
            elif setup.router == "random":
                target = replicas[int(rng.integers(len(replicas)))]
            else:
                target = min(replicas, key=lambda x: x.load)
            target.enqueue(n, ta)
            if getattr(rec, "refused", None) is not None and rec.refused[n]:
                # refused at once (admission control): the client backs off as the load test does
                next_send[c] = ta + REFUSED_BACKOFF_S + think_times(think, 1, think_rng)[0] + round_trip_s
            else:
                in_flight[n] = c
            n += 1
            continue
        now = tr
        if now > horizon:
            break
        while shifts and now >= shifts[0]:
            shifts.pop(0)
            if on_shift is not None:
                on_shift()
        r.step(now)
        steps += 1
        done = [rid for rid in in_flight if not np.isnan(rec.finish_s[rid])]
        for rid, pause in zip(done, think_times(think, len(done), think_rng)):
            next_send[in_flight.pop(rid)] = rec.finish_s[rid] + pause + round_trip_s
        if progress is not None and now >= next_report:
            progress(min(now / horizon, 1.0))
            next_report = now + horizon / 200
    req.arrival_s, req.prompt_tokens, req.output_tokens, req.class_idx = (
        a[:n] for a in (req.arrival_s, req.prompt_tokens, req.output_tokens, req.class_idx))
    rec.first_token_s, rec.finish_s = rec.first_token_s[:n], rec.finish_s[:n]
    if hasattr(rec, "refused"):
        rec.refused = rec.refused[:n]
    rec.num_requests = n
    return RunOutput(rec, now, steps, time.perf_counter() - t_wall), req


def run_closed_loop(sc: Scenario, base: Path, specs: list, *, seed: int,
                    progress: Callable[[str, float], None] | None = None):
    """``run_scenario`` for a closed-loop workload: every client count of the sweep (or the
    workload's), every policy; each policy sees the same request sequence and think times."""
    from adaptspec.sim.metrics import SLO, compute_metrics
    from adaptspec.sim.runner import ScenarioResult, _shift_hook, build_policy, class_truths, cost_model, pacer_for
    from adaptspec.sim.scenario import policy_label

    truths = class_truths(sc, base)
    cost = cost_model(sc, base)
    loop = sc.workload.closed_loop
    levels = sc.sweep.clients if sc.sweep is not None and sc.sweep.clients else [loop.clients]
    result = ScenarioResult(sc.name)
    slos = [SLO(s.ttft_s, s.tpot_s, s.e2e_s) for s in (c.slo or sc.slo for c in sc.classes)]
    empty = Requests(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    for clients in levels:
        for spec in specs:
            label = policy_label(spec)
            clock = [0.0]
            run = build_policy(spec, sc, truths, cost, clock, seed)
            result.policy_notes[label] = run.policy.describe_targets()
            setup = RunSetup(cost, truths, empty, sc.hardware.replicas, sc.hardware.router, sc.max_k,
                             sc.duration_s, sc.drain_s, sc.timeline_bin_s, seed, pacer=pacer_for(spec, sc))
            source = request_source(sc.workload, sc.classes, base, np.random.default_rng([seed, 1]))

            def on_progress(f: float, label=label, clock=clock, clients=clients) -> None:
                clock[0] = f * (sc.duration_s + sc.drain_s)
                if progress is not None:
                    progress(f"{label} @ {clients} clients", f)

            out, requests = simulate_closed_loop(setup, run.policy, clients, loop.think_time, source,
                                                 on_shift=_shift_hook(run, clock, truths), progress=on_progress)
            st = run.policy.stats
            m = compute_metrics(label, None, requests, out.recorder, [c.name for c in sc.classes], slos, sc.warmup_s,
                                sc.duration_s, out.end_s, out.wall_s, out.steps, st.mean_decision_us,
                                st.decision_s_max * 1e6)
            m.clients = clients
            result.runs.append(m)
    return result
