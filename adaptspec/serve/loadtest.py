"""A bounded closed-loop load generator on loopback gRPC, and the overhead probe.

``run_level``: ``concurrency`` client threads, each streaming one request after another
(after a think time, if ``Arrivals`` gives one), or open-loop arrivals at a rate (Poisson
or Gamma, drawn as the simulator draws them), with classes taken round-robin, for a
warm-up and then a measured window; per request it
records when it was sent, each chunk's arrival and tokens, TTFT (first chunk with tokens),
TPOT ((E2E - TTFT) / (tokens - 1)), E2E and the arms the controller used. Requests still
running when the window closes are cancelled (the service aborts them and frees their KV
slots). ``summarize`` counts what happened inside the window(s) only: tokens that arrived
in it (throughput), requests that finished in it (latency percentiles, goodput: requests/s
meeting the TTFT and TPOT SLOs, arms). Load is steady across the window's edges (the
warm-up's clients keep going), and a request in flight at the end counts the tokens it got,
so a run's throughput does not hang on how its last few requests happened to fall.

``Probes``: background clients, in a process of their own, that keep calling
``Health/Check`` (what Kubernetes probes and monitoring do to a live service): Serve work
in the replica, next to the engine, while the load or the overhead is measured.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from adaptspec import bench_prompts
from adaptspec.serve.client import Client


def load_prompts(source: str | None, classes: list[str]) -> dict[str, list[str]] | None:
    """The prompt pools of ``--prompts``: None for the bench prompts (eight a class, the ones
    ``adaptspec bench`` runs); ``corpus:N`` or ``corpus:N:SEED`` for N prompts a class drawn
    from the held-out split of the offline distillation corpus (the draft head never trained
    on them; longer and more varied than the bench's); else a JSON file mapping each class to
    a list of prompts. Every class in ``classes`` needs a pool; ValueError names what is wrong."""
    if source is None or source == "":
        return None
    if source.startswith("corpus:"):
        from adaptspec.distill.corpus import CLASSES, build_corpus

        parts = source.split(":")[1:]
        try:
            n, seed = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
            if len(parts) > 2 or n < 1 or seed < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--prompts: corpus:N or corpus:N:SEED (N >= 1 prompts a class), got {source!r}") from None
        if missing := [c for c in classes if c not in CLASSES]:
            raise ValueError(f"--prompts: the corpus has the classes {', '.join(CLASSES)}, not {', '.join(missing)}")
        import random

        held = build_corpus(seed).held_out
        return {c: random.Random(f"{seed}:{c}").sample(held[c], min(n, len(held[c]))) for c in classes}
    try:
        with open(source, encoding="utf-8") as f:
            pools = json.load(f)
    except OSError as exc:
        raise ValueError(f"--prompts: cannot read {source!r} ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompts: {source!r} is not JSON ({exc})") from None
    if not isinstance(pools, dict):
        raise ValueError(f"--prompts: {source!r} must hold a JSON object mapping each class to a list of prompts")
    for c in classes:
        pool = pools.get(c)
        if not isinstance(pool, list) or not pool or not all(isinstance(x, str) and x.strip() for x in pool):
            raise ValueError(f"--prompts: {source!r}: class {c!r} needs a non-empty list of non-empty prompt strings"
                             + ("" if c in pools else " (it is missing)"))
    return {c: list(pools[c]) for c in classes}


@dataclass(slots=True)
class RequestRecord:
    request_class: str
    ttft_s: float
    e2e_s: float
    tokens: int
    arms: dict[str, int] = field(default_factory=dict)
    error: str = ""
    start_s: float = 0.0  # perf_counter when sent
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) per chunk
    cut: bool = False  # cancelled at the end of the measured window (not an error)
    prompt_index: int = -1  # which prompt of its class's pool (bench_prompts)
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (the last chunk's usage says)
    # the engine's own TTFT (from the request reaching the engine; the last chunk's timings):
    # the rest of ``ttft_s`` is the path (proxy, ingress, replica) there and back; 0: unknown
    engine_ttft_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s


@dataclass(slots=True, frozen=True)
class Window:
    """The measured span of a run (perf_counter seconds)."""

    start_s: float
    end_s: float

    def __contains__(self, t: float) -> bool:
        return self.start_s <= t <= self.end_s

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class LevelSummary:
    policy: str
    concurrency: int
    requests: int  # finished inside the window(s)
    errors: int
    duration_s: float  # measured seconds (the windows)
    throughput_tokens_per_s: float  # tokens that arrived inside the window(s), per second
    goodput_requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    arms: dict[str, dict[str, int]]  # class -> arm -> steps
    rate_rps: float | None = None  # open-loop arrival rate (concurrency is 0 then)
    think_s: float = 0.0  # closed loop: mean pause between a reply and the client's next request
    level: str = ""  # the level's label (Arrivals.label)
    # the time between consecutive streamed chunks of a request (a stalled request shows here)
    gap_p99_s: float = 0.0
    gap_max_s: float = 0.0
    # each round's throughput alone, in the order the rounds ran (several rounds: see
    # cli.adaptive_vs_static, which pairs them across policies)
    round_tokens_per_s: list[float] = field(default_factory=list)
    # the share of one core the controller spent over this policy's runs (warm-ups included):
    # in the policy's own calls, and in its whole process (None: not measured, or the controller
    # shares its process with the engine, in-process)
    policy_cpu_share: float | None = None
    controller_cpu_share: float | None = None
    # a model-based policy's step-cost model against the steps of its runs (the controller's
    # CostCheck rows: verify_tokens, drafted, steps, predicted_ms, measured_ms); empty: none
    cost_check: list[dict] = field(default_factory=list)
    # each round's arms (class -> arm -> steps) and, for a model-based policy, its cost check
    # (plain steps' and drafted steps' predicted / measured step time; None: no such steps), in
    # the order the rounds ran: what a policy did in the round after a load change
    round_arms: list[dict] = field(default_factory=list)
    round_cost_check: list[list] = field(default_factory=list)


@dataclass(slots=True)
class LoadSpec:
    classes: list[str]
    max_tokens: int = 64
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    temperature: float | None = None
    arm: tuple[str, int] | None = None  # fixed arm (speculation override)
    # (lo, hi): each request's prompt is its class prompt after a context of about
    # uniform(lo, hi) tokens (long documents arriving among running requests); None: as is
    prompt_tokens: tuple[int, int] | None = None
    prompts: dict[str, list[str]] | None = None  # each class's prompt pool (load_prompts); None: the bench's
    prompts_from: str = "bench"  # where they came from (--prompts), as results record it

    def pools(self) -> dict[str, list[str]]:
        return self.prompts if self.prompts is not None else bench_prompts()


@dataclass(slots=True, frozen=True)
class Arrivals:
    """How a level's requests arrive. Closed loop (``rate_rps`` 0): ``clients`` clients, each
    sending its next request ``think_s`` after its last one finished (exponential pauses of
    that mean with ``think="exponential"``). Open loop: requests at ``rate_rps`` whatever the
    service does, with Poisson or Gamma gaps (shape ``burstiness``, as vllm bench serve),
    drawn as the simulator's ``arrival_times`` draws them from ``default_rng([seed, 1])``:
    a scenario with the same rate, law and seed has the same arrival times."""

    clients: int = 0
    rate_rps: float = 0.0
    process: str = "poisson"
    burstiness: float = 1.0
    think_s: float = 0.0
    think: str = "fixed"
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.clients > 0) == (self.rate_rps > 0):
            raise ValueError(f"arrivals: give clients (closed loop) or rate_rps (open loop), got {self}")
        if self.process not in ("poisson", "gamma") or self.think not in ("fixed", "exponential"):
            raise ValueError(f"arrivals: process is poisson|gamma and think fixed|exponential, got {self}")
        if self.burstiness <= 0 or self.think_s < 0:
            raise ValueError(f"arrivals: burstiness > 0 and think_s >= 0, got {self}")

    @property
    def open(self) -> bool:
        return self.rate_rps > 0

    @property
    def label(self) -> str:
        if self.open:
            return f"{self.rate_rps:g} rps" + ("" if self.process == "poisson" else f" gamma {self.burstiness:g}")
        return f"c={self.clients}" + (f" think {self.think_s:g}s" if self.think_s else "")

    def times(self, seconds: float) -> np.ndarray:
        """Open loop: the arrival offsets (s) within ``seconds``."""
        from adaptspec.sim.scenario import WorkloadSpec
        from adaptspec.sim.workload import arrival_times

        wl = WorkloadSpec(rate={"kind": "constant", "rps": self.rate_rps},
                          arrival={"process": self.process, "burstiness": self.burstiness})
        return arrival_times(wl, seconds, np.random.default_rng([self.seed, 1]))

    def pause(self, rng: np.random.Generator) -> float:
        if self.think_s <= 0:
            return 0.0
        return float(rng.exponential(self.think_s)) if self.think == "exponential" else self.think_s


def as_arrivals(level: "int | Arrivals") -> Arrivals:
    """A level: a client count (a closed loop without think time) or ``Arrivals``."""
    return level if isinstance(level, Arrivals) else Arrivals(clients=int(level))


def pick_prompt(prompts: dict[str, list[str]], classes: list[str], n: int) -> tuple[str, int, str]:
    """The ``n``-th request overall: (class, prompt index, prompt); classes in turn, each
    class's prompts in turn (the simulator's ``round_robin`` prompt-set order)."""
    cls = classes[n % len(classes)]
    pool = prompts.get(cls) or prompts["chat"]
    i = (n // len(classes)) % len(pool)
    return cls, i, pool[i]


def with_context(prompt: str, n: int, span: tuple[int, int]) -> str:
    """Request ``n``'s prompt behind a context of about uniform(span) tokens (a word of the
    filler is about 1.3 SmolLM2 tokens), seeded by ``n``: the same requests every run."""
    rng = np.random.default_rng([7, n])
    words = int(rng.integers(span[0], span[1] + 1) / 1.3)
    pool = [w for ps in bench_prompts().values() for p in ps for w in p.split()]
    start = int(rng.integers(0, len(pool)))
    ctx = " ".join(pool[(start + j) % len(pool)] for j in range(words))
    return f"Context:\n{ctx}\n\n{prompt}"


def one_request(client: Client, prompt: str, cls: str, spec: LoadSpec, timeout: float = 300,
                stop_at: float = float("inf")) -> RequestRecord:
    """One streamed request; cancelled (``cut``) if it is still running at ``stop_at``."""
    t0 = time.perf_counter()
    ttft, tokens, arms, chunks, cached, engine_ttft = 0.0, 0, {}, [], 0, 0.0
    try:
        call = client.stream(prompt, request_class=cls, max_tokens=spec.max_tokens,
                             temperature=spec.temperature, speculation=spec.arm, timeout=timeout)
        for chunk in call:
            now = time.perf_counter()
            if chunk.token_ids:
                if not ttft:
                    ttft = now - t0
                chunks.append((now, len(chunk.token_ids)))
            tokens += len(chunk.token_ids)
            if chunk.finished:
                arms = {a.arm: a.steps for a in chunk.speculation.arms}
                cached = chunk.usage.cached_prompt_tokens
                engine_ttft = chunk.timings.ttft_s
            elif now > stop_at:
                call.cancel()
                return RequestRecord(cls, ttft, now - t0, tokens, start_s=t0, chunks=chunks, cut=True)
    except Exception as exc:  # a refused or failed request is counted, not fatal
        code = getattr(exc, "code", lambda: None)()
        return RequestRecord(cls, 0.0, time.perf_counter() - t0, 0, error=str(code or exc), start_s=t0,
                             chunks=chunks)
    return RequestRecord(cls, ttft, time.perf_counter() - t0, tokens, arms, start_s=t0, chunks=chunks,
                         cached_tokens=cached, engine_ttft_s=engine_ttft)


def run_level(client: Client, concurrency: "int | Arrivals", duration_s: float, spec: LoadSpec,
              on_record=None, warmup_s: float = 0.0) -> tuple[list[RequestRecord], Window]:
    """Load for ``warmup_s`` + ``duration_s``: a closed loop of ``concurrency`` clients, or
    the ``Arrivals`` given; returns every record and the measured window (the last
    ``duration_s``)."""
    arr = as_arrivals(concurrency)
    prompts = spec.pools()
    offsets = arr.times(warmup_s + duration_s) if arr.open else None  # drawn before the clock starts
    t0 = time.perf_counter()
    window = Window(t0 + warmup_s, t0 + warmup_s + duration_s)
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def send(i: int) -> RequestRecord:
        cls, idx, prompt = pick_prompt(prompts, spec.classes, i)
        if spec.prompt_tokens:
            prompt = with_context(prompt, i, spec.prompt_tokens)
        rec = one_request(client, prompt, cls, spec, stop_at=window.end_s)
        rec.prompt_index = idx
        with lock:
            records.append(rec)
        if on_record is not None:
            on_record(rec)
        return rec

    if arr.open:
        return _run_open(offsets, send, t0), window

    # one stream of prompts for every client, the next one to whoever sends next (as the
    # in-process load test and the simulator's closed loop take them): with a fixed share of the
    # stream per client (every N-th request), a client whose prompts run fast sent them more
    # often, and a level's prompt mix followed the prompts' speeds
    sent = itertools.count()

    def worker(w: int) -> None:
        rng = np.random.default_rng([arr.seed, 2, w])
        while time.perf_counter() < window.end_s:
            with lock:
                i = next(sent)
            rec = send(i)
            if rec.error == "StatusCode.RESOURCE_EXHAUSTED":
                time.sleep(0.05)
            pause = arr.pause(rng)
            if pause:
                time.sleep(max(min(pause, window.end_s - time.perf_counter()), 0.0))

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(arr.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, window


def _run_open(offsets: np.ndarray, send, t0: float, max_in_flight: int = 512) -> list[RequestRecord]:
    """Send request ``i`` at ``t0 + offsets[i]`` from a pool of threads (a request the pool
    cannot start at once starts late, and its TTFT counts from then: keep the rate below what
    ``max_in_flight`` streams can carry)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="loadtest") as pool:
        futures = []
        for i, at in enumerate(offsets):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(send, i))
        return [f.result() for f in futures]


def summarize(policy: str, concurrency: "int | Arrivals", records: list[RequestRecord], windows: Window | list[Window],
              spec: LoadSpec) -> LevelSummary:
    """What happened inside the measured window(s) (runs' windows do not overlap)."""
    windows = [windows] if isinstance(windows, Window) else list(windows)
    inside = lambda t: any(t in w for w in windows)  # noqa: E731
    seconds = sum(w.seconds for w in windows)
    tokens = sum(n for r in records for t, n in r.chunks if inside(t))
    done = [r for r in records if not r.cut and inside(r.end_s)]
    ok = [r for r in done if not r.error and r.tokens]

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else 0.0

    ttft, tpot, e2e = [r.ttft_s for r in ok], [r.tpot_s for r in ok], [r.e2e_s for r in ok]
    gaps = [b[0] - a[0] for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    good = sum(1 for r in ok if r.ttft_s <= spec.slo_ttft_s and r.tpot_s <= spec.slo_tpot_s)
    arms: dict[str, dict[str, int]] = {}
    for r in ok:
        per = arms.setdefault(r.request_class, {})
        for a, n in r.arms.items():
            per[a] = per.get(a, 0) + n
    rate = (lambda x: x / seconds) if seconds > 0 else (lambda x: 0.0)  # noqa: E731
    arr = as_arrivals(concurrency)
    return LevelSummary(policy, arr.clients, len(ok), len(done) - len(ok), seconds, rate(tokens), rate(good),
                        pct(ttft, 50), pct(ttft, 99), pct(tpot, 50), pct(tpot, 99), pct(e2e, 50), pct(e2e, 99), arms,
                        arr.rate_rps or None, arr.think_s, arr.label, pct(gaps, 99), max(gaps, default=0.0))


def top_arm(per: dict[str, int]) -> str:
    return max(per.items(), key=lambda kv: kv[1])[0] if per else "-"


@dataclass(slots=True)
class OverheadPair:
    """One prompt run once through the service (unary Generate over gRPC) and once through
    the in-process engine, back to back (alternating which goes first)."""

    service_s: float  # client-side wall time of the gRPC call
    service_engine_s: float  # the replica's engine time for it (arrival to finish, from the response)
    engine_s: float  # wall time of Engine.generate in this process
    same_tokens: bool


def measure_overhead(client: Client, engine, prompts: list[str], max_tokens: int, reps: int = 1,
                     arm: tuple[str, int] = ("none", 0), warmup: int = 2, health_checks: int = 0) -> dict:
    """gRPC + Serve overhead over the in-process engine, measured as paired differences.

    Each prompt runs ``reps`` times through both paths back to back (greedy, ``ignore_eos`` so
    both produce exactly ``max_tokens``, the same fixed arm, one request at a time), and the
    order alternates, so drift in machine load hits both sides alike. Reported: p50 of each
    side, p50 of the per-pair differences (the overhead, with a 95% bootstrap interval) and of
    the ratios, and the split of the difference into time outside the replica's engine (gRPC,
    proxy, Serve's hop: client wall minus the engine time the response reports) and time
    inside it (the engine running slower in the replica than here; with its interval too).
    ``health_checks`` > 0 also times that many ``Health/Check`` calls: the same gRPC, proxy
    and Serve path with no engine work.
    """
    from adaptspec import SamplingParams, SpecConfig

    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    spec = SpecConfig(*arm)

    def via_service(p: str):
        t0 = time.perf_counter()
        r = client.generate(p, request_class="default", max_tokens=max_tokens, speculation=arm,
                            ignore_eos=True, timeout=300)
        return time.perf_counter() - t0, r.timings.e2e_s, list(r.token_ids)

    def in_process(p: str):
        t0 = time.perf_counter()
        out = engine.generate([p], params, spec)[0]
        return time.perf_counter() - t0, list(out.token_ids)

    for i in range(warmup):  # first calls pay for lazy init on both sides
        via_service(prompts[i % len(prompts)])
        in_process(prompts[i % len(prompts)])
    pairs: list[OverheadPair] = []
    for rep in range(reps):
        for i, p in enumerate(prompts):
            if (i + rep) % 2 == 0:
                svc, svc_eng, a = via_service(p)
                loc, b = in_process(p)
            else:
                loc, b = in_process(p)
                svc, svc_eng, a = via_service(p)
            pairs.append(OverheadPair(svc, svc_eng, loc, a == b))
    out = overhead_summary(pairs, max_tokens)
    if health_checks:
        rtt = []
        for _ in range(health_checks):
            t0 = time.perf_counter()
            client.health()
            rtt.append(time.perf_counter() - t0)
        out["health_check_p50_s"] = float(np.median(rtt))
    return out


def median_ci95(xs: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% bootstrap interval for the median of ``xs`` (percentile method, fixed seed).

    The overhead goal compares a median of paired differences with a few milliseconds, while
    each side of a pair moves by several percent of a 0.5 s request on a shared machine: the
    interval says whether a run settles the verdict or not."""
    if len(xs) < 2:
        return [float(xs[0]), float(xs[0])] if xs else [0.0, 0.0]
    a = np.asarray(xs, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    meds = np.median(a[idx], axis=1)
    return [float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))]


def overhead_summary(pairs: list[OverheadPair], max_tokens: int) -> dict:
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    diff = [p.service_s - p.engine_s for p in pairs]
    inside = [p.service_engine_s - p.engine_s for p in pairs]
    return {
        "requests": len(pairs),
        "max_tokens": max_tokens,
        "service_e2e_p50_s": med([p.service_s for p in pairs]),
        "engine_e2e_p50_s": med([p.engine_s for p in pairs]),
        "overhead_p50_s": med(diff),
        "overhead_p50_ci95_s": median_ci95(diff),
        "overhead_p90_s": float(np.percentile(diff, 90)) if pairs else 0.0,
        "ratio_p50": med([p.service_s / p.engine_s for p in pairs if p.engine_s > 0]),
        "outside_engine_p50_s": med([p.service_s - p.service_engine_s for p in pairs]),
        "inside_engine_p50_s": med(inside),
        "inside_engine_p50_ci95_s": median_ci95(inside),
        "same_tokens": sum(p.same_tokens for p in pairs),
    }


def measure_http_overhead(client: Client, http: "HttpClient", n: int, max_tokens: int, classes: list[str],
                          warmup: int = 2) -> dict:
    """The OpenAI-compatible HTTP API's per-request cost over gRPC on the same deployment, as
    paired differences: request ``i``'s prompt goes through both, streamed and greedy, back to
    back, the order alternating, one request at a time, so drift in the machine's load hits
    both sides alike (separate runs of each protocol differed by more than the effect).
    Reported: p50 of each side's E2E and TTFT, and of the per-pair differences (HTTP - gRPC)
    with 95% bootstrap intervals; ``same_tokens``: pairs that streamed as many tokens."""
    prompts, spec = bench_prompts(), LoadSpec(classes, max_tokens)
    for i in range(warmup):  # first calls pay for connections and lazy init on both sides
        for c in (client, http):
            one_request(c, pick_prompt(prompts, classes, i)[2], classes[0], spec)
    pairs, errors = [], 0
    for i in range(n):
        cls, _, prompt = pick_prompt(prompts, classes, i)
        got = {}
        for name in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
            got[name] = one_request(client if name == "grpc" else http, prompt, cls, spec)
        if got["grpc"].error or got["http"].error:
            errors += 1
            continue
        pairs.append((got["grpc"], got["http"]))
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    d_e2e = [h.e2e_s - g.e2e_s for g, h in pairs]
    d_ttft = [h.ttft_s - g.ttft_s for g, h in pairs]
    return {
        "requests": len(pairs), "errors": errors, "max_tokens": max_tokens,
        "grpc_e2e_p50_s": med([g.e2e_s for g, _ in pairs]), "http_e2e_p50_s": med([h.e2e_s for _, h in pairs]),
        "grpc_ttft_p50_s": med([g.ttft_s for g, _ in pairs]), "http_ttft_p50_s": med([h.ttft_s for _, h in pairs]),
        "e2e_diff_p50_s": med(d_e2e), "e2e_diff_p50_ci95_s": median_ci95(d_e2e),
        "ttft_diff_p50_s": med(d_ttft), "ttft_diff_p50_ci95_s": median_ci95(d_ttft),
        "same_tokens": sum(g.tokens == h.tokens for g, h in pairs),
    }


def as_json(levels: list[LevelSummary], overhead: dict | None = None, probes: dict | None = None,
            prompts: str = "bench") -> str:
    """``prompts``: where the requests' prompts came from (``--prompts``; "bench": the bench prompts)."""
    return json.dumps({"levels": [asdict(x) for x in levels], "overhead": overhead, "probes": probes,
                       "prompts": prompts}, indent=2)


class HttpError(Exception):
    """A refused or failed request on the HTTP API; ``code()`` names the gRPC status the HTTP
    status stands for, so the load loop treats both protocols alike (backs off on a full queue)."""

    _CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
              429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status

    def code(self):
        import grpc

        return getattr(grpc.StatusCode, self._CODES.get(self.status, "INTERNAL"))


@dataclass(slots=True)
class _ArmSteps:
    arm: str
    steps: int


@dataclass(slots=True)
class _Speculation:
    arms: list[_ArmSteps] = field(default_factory=list)


@dataclass(slots=True)
class _Usage:
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class _Timings:
    ttft_s: float = 0.0  # the engine's own TTFT: the HTTP API does not say (0: unknown)


@dataclass(slots=True)
class _HttpChunk:
    token_ids: list[int]
    finished: bool
    speculation: _Speculation
    usage: _Usage = field(default_factory=_Usage)
    timings: _Timings = field(default_factory=_Timings)


class HttpClient:
    """The OpenAI-compatible HTTP API behind the part of ``Client`` that ``one_request`` uses:
    ``stream(...)`` returns an iterable of chunks (``token_ids``, ``finished``,
    ``speculation.arms``, ``usage``, ``timings``) with ``cancel()``. Each request is a streamed chat completion (the
    server applies the chat template, as it does for a gRPC prompt) with ``return_token_ids``;
    ``temperature`` None is greedy, the gRPC default. The standard library's ``http.client``
    with one keep-alive connection per thread, so no client library's own cost is measured."""

    def __init__(self, base_url: str, api_key: str | None = None):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"--http-url: expected http://HOST:PORT[/PREFIX], got {base_url!r}")
        self.host, self.port, self.prefix = u.hostname, u.port or 80, u.path.rstrip("/")
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self._model: str | None = None

    def _request(self, method: str, path: str, body: dict | None, headers: dict, timeout: float):
        """(connection, response with its status read); a kept-alive connection the server
        closed is reopened once."""
        import http.client

        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            fresh = conn is None
            if fresh:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            conn.timeout = timeout
            try:
                conn.request(method, self.prefix + path, body=None if body is None else json.dumps(body),
                             headers={**self.headers, **headers})
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionError):
                self.drop(conn)
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def drop(self, conn) -> None:
        """Close ``conn`` (hanging up on a request in flight); this thread opens a new one next."""
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    @property
    def model(self) -> str:
        """The served model's id (``GET /v1/models``), asked once."""
        if self._model is None:
            _, resp = self._request("GET", "/v1/models", None, {}, 30)
            data = resp.read()
            if resp.status != 200:
                raise HttpError(resp.status, data.decode(errors="replace")[:300])
            self._model = json.loads(data)["data"][0]["id"]
        return self._model

    def stream(self, prompt: str, *, request_class: str = "", max_tokens: int | None = None,
               temperature: float | None = None, speculation=None, timeout: float = 300) -> "_HttpStream":
        if speculation is not None:
            raise ValueError("speculation: the HTTP API has no per-request arm (use --protocol grpc)")
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
                "temperature": 0.0 if temperature is None else temperature}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        conn, resp = self._request("POST", "/v1/chat/completions", body,
                                   {"x-adaptspec-class": request_class} if request_class else {}, timeout)
        if resp.status != 200:
            data = resp.read()
            try:
                message = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = data.decode(errors="replace")[:300]
            raise HttpError(resp.status, message)
        return _HttpStream(self, conn, resp)


class _HttpStream:
    def __init__(self, client: HttpClient, conn, resp):
        self.client, self.conn, self.resp = client, conn, resp

    def cancel(self) -> None:
        self.client.drop(self.conn)

    def __iter__(self):
        last = None  # the finishing chunk waits for the usage chunk right behind it (its cached tokens)
        try:
            for line in self.resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    self.resp.read()  # the end of the chunked body: the connection is reused
                    if last is not None:
                        yield last
                    return
                event = json.loads(data)
                if "error" in event:
                    raise HttpError(500, event["error"].get("message", ""))
                if not event["choices"]:  # the usage chunk
                    if last is not None:
                        details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                        last.usage.cached_prompt_tokens = int(details.get("cached_tokens") or 0)
                        yield last
                        last = None
                    continue
                choice = event["choices"][0]
                finished = choice["finish_reason"] is not None
                arms = [_ArmSteps(a, n) for a, n in (event.get("adaptspec") or {}).get("arms", {}).items()]
                chunk = _HttpChunk(choice.get("token_ids") or [], finished, _Speculation(arms))
                if finished:
                    last = chunk
                else:
                    yield chunk
            raise HttpError(500, "the event stream ended without [DONE]")
        except BaseException:
            self.cancel()
            raise


class Probes:
    """``clients`` closed-loop ``Health/Check`` callers in a child process (so they take
    nothing from this process's GIL, where the overhead's in-process engine runs), counted
    from when they are all connected; ``stop()`` (idempotent) returns ``{"clients",
    "seconds", "calls", "calls_per_s", "errors"}``, or None when there were none."""

    def __init__(self, address: str, app_name: str, clients: int, ready_timeout_s: float = 60.0):
        self.clients = clients
        self.proc = None
        self.t0: float | None = None  # set once every client is connected
        if clients <= 0:
            return
        # the child stops at EOF on its stdin, so it also stops if this process dies
        self.proc = subprocess.Popen([sys.executable, "-m", "adaptspec.serve.loadtest", "--probe", address, app_name,
                                      str(clients)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = _readline(self.proc.stdout, ready_timeout_s)
        if ready.strip() != "ready":
            self.stop()
            raise RuntimeError(f"the Health/Check probes did not start (said {ready!r})")
        self.t0 = time.perf_counter()

    def stop(self) -> dict | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        seconds = time.perf_counter() - self.t0 if self.t0 is not None else 0.0
        try:
            out, _ = proc.communicate(timeout=30)  # closes stdin: the child stops and prints its counts
            calls, errors = (int(x) for x in out.split()[-2:])
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.communicate()
            calls = errors = -1
        return {"clients": self.clients, "seconds": seconds, "calls": calls, "errors": errors,
                "calls_per_s": calls / seconds if calls >= 0 and seconds > 0 else 0.0}


def _readline(stream, timeout_s: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else ""


def _probe_main(address: str, app_name: str, clients: int) -> None:
    counts = [[0, 0] for _ in range(clients)]
    stop = threading.Event()
    connected = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        with Client(address, app_name) as c:
            connected.wait()
            while not stop.is_set():
                try:
                    c.health(timeout=10)
                    counts[i][0] += 1
                except Exception:
                    counts[i][1] += 1
                    time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    connected.wait(timeout=60)  # BrokenBarrierError: a client could not start; the parent says so
    print("ready", flush=True)
    sys.stdin.read()  # until the load generator closes our stdin (or dies)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    print(sum(c[0] for c in counts), sum(c[1] for c in counts), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
