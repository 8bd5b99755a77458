"""A bounded closed-loop load generator on loopback gRPC, and the overhead probe.

``run_level``: ``concurrency`` client threads, each streaming one request after another
for ``duration_s`` with classes taken round-robin; per request it records TTFT (first
chunk with tokens), TPOT ((E2E - TTFT) / (tokens - 1)), E2E, tokens and the arms the
controller used. ``summarize`` turns a level into percentiles, throughput (tokens/s) and
goodput (requests/s meeting the TTFT and TPOT SLOs).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

import numpy as np

from adaptspec.serve.client import Client


def bench_prompts() -> dict[str, list[str]]:
    return json.loads(resources.files("adaptspec.data").joinpath("bench_prompts.json").read_text())


@dataclass(slots=True)
class RequestRecord:
    request_class: str
    ttft_s: float
    e2e_s: float
    tokens: int
    arms: dict[str, int] = field(default_factory=dict)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass(slots=True)
class LevelSummary:
    policy: str
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    throughput_tokens_per_s: float
    goodput_requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    arms: dict[str, dict[str, int]]  # class -> arm -> steps


@dataclass(slots=True)
class LoadSpec:
    classes: list[str]
    max_tokens: int = 64
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    temperature: float | None = None
    arm: tuple[str, int] | None = None  # fixed arm (speculation override)


def one_request(client: Client, prompt: str, cls: str, spec: LoadSpec, timeout: float = 300) -> RequestRecord:
    t0 = time.perf_counter()
    ttft, tokens, arms = 0.0, 0, {}
    try:
        for chunk in client.stream(prompt, request_class=cls, max_tokens=spec.max_tokens,
                                   temperature=spec.temperature, speculation=spec.arm, timeout=timeout):
            if chunk.token_ids and not ttft:
                ttft = time.perf_counter() - t0
            tokens += len(chunk.token_ids)
            if chunk.finished:
                arms = {a.arm: a.steps for a in chunk.speculation.arms}
    except Exception as exc:  # a refused or failed request is counted, not fatal
        code = getattr(exc, "code", lambda: None)()
        return RequestRecord(cls, 0.0, time.perf_counter() - t0, 0, error=str(code or exc))
    return RequestRecord(cls, ttft, time.perf_counter() - t0, tokens, arms)


def run_level(client: Client, concurrency: int, duration_s: float, spec: LoadSpec,
              on_record=None) -> tuple[list[RequestRecord], float]:
    prompts = bench_prompts()
    stop_at = time.perf_counter() + duration_s
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        i = w
        while time.perf_counter() < stop_at:
            cls = spec.classes[i % len(spec.classes)]
            pool = prompts.get(cls) or prompts["chat"]
            rec = one_request(client, pool[(i // len(spec.classes)) % len(pool)], cls, spec)
            with lock:
                records.append(rec)
            if on_record is not None:
                on_record(rec)
            i += concurrency
            if rec.error == "StatusCode.RESOURCE_EXHAUSTED":
                time.sleep(0.05)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def summarize(policy: str, concurrency: int, records: list[RequestRecord], wall_s: float,
              spec: LoadSpec) -> LevelSummary:
    ok = [r for r in records if not r.error and r.tokens]

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else 0.0

    ttft, tpot, e2e = [r.ttft_s for r in ok], [r.tpot_s for r in ok], [r.e2e_s for r in ok]
    good = sum(1 for r in ok if r.ttft_s <= spec.slo_ttft_s and r.tpot_s <= spec.slo_tpot_s)
    arms: dict[str, dict[str, int]] = {}
    for r in ok:
        per = arms.setdefault(r.request_class, {})
        for a, n in r.arms.items():
            per[a] = per.get(a, 0) + n
    return LevelSummary(policy, concurrency, len(ok), len(records) - len(ok), wall_s,
                        sum(r.tokens for r in ok) / wall_s, good / wall_s, pct(ttft, 50), pct(ttft, 99),
                        pct(tpot, 50), pct(tpot, 99), pct(e2e, 50), pct(e2e, 99), arms)


def top_arm(per: dict[str, int]) -> str:
    return max(per.items(), key=lambda kv: kv[1])[0] if per else "-"


def measure_overhead(client: Client, engine_factory, n: int, spec: LoadSpec) -> dict[str, float]:
    """p50 E2E through gRPC + Serve minus the in-process engine's, same prompts, same fixed arm,
    one request at a time (concurrency 1)."""
    from adaptspec import SamplingParams, SpecConfig

    prompts = [p for ps in bench_prompts().values() for p in ps][:n]
    arm = spec.arm or ("none", 0)
    svc = []
    for p in prompts:
        for _ in range(2):  # warm, then measure (unary Generate: the per-request path)
            t0 = time.perf_counter()
            client.generate(p, request_class="default", max_tokens=spec.max_tokens, speculation=arm, timeout=300)
            dt = time.perf_counter() - t0
        svc.append(dt)
    engine = engine_factory()
    local = []
    for p in prompts:
        for _ in range(2):  # warm, then measure
            t0 = time.perf_counter()
            engine.generate([p], SamplingParams(max_new_tokens=spec.max_tokens), SpecConfig(*arm))
            dt = time.perf_counter() - t0
        local.append(dt)
    diffs = [a - b for a, b in zip(svc, local)]
    return {"service_e2e_p50_s": float(np.median(svc)), "engine_e2e_p50_s": float(np.median(local)),
            "overhead_p50_s": float(np.median(diffs)), "requests": len(prompts)}


def as_json(levels: list[LevelSummary], overhead: dict | None = None) -> str:
    return json.dumps({"levels": [asdict(x) for x in levels], "overhead": overhead}, indent=2)
