"""Soak test: many concurrent gRPC streams for a while; every request must end.

``N`` clients each send one streaming request after another until ``duration`` passes (the
last ones finish). Each request ends in exactly one of:

- ``ok``: a final chunk (``finished``) arrived;
- ``refused``: RESOURCE_EXHAUSTED (every replica and the proxies' queues were full; the
  client backs off and sends the next one);
- ``unavailable``: UNAVAILABLE (a replica or engine went away; retryable);
- ``hung``: no final chunk within ``request_timeout_s`` (DEADLINE_EXCEEDED);
- ``lost``: the stream closed without a final chunk and without an error, or any other
  status (INTERNAL, UNKNOWN, ...).

Goal: ``lost == hung == 0``, and ``refused == 0`` while the clients fit in the replicas'
capacity. ``python -m adaptspec.serve.soak`` runs it against an address, or (``--cluster``)
starts a local two-node Ray cluster with two TargetEngine replicas on tiny random models
(``--model``: a real one) and records the numbers to a Markdown file (``--record``).
Loopback only.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import time

import grpc

from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.proto import adaptspec_pb2_grpc as pb_grpc
from adaptspec.serve.client import API_KEY_ENV


@dataclasses.dataclass
class SoakResult:
    streams: int
    duration_s: float
    wall_s: float = 0.0
    outcomes: dict[str, int] = dataclasses.field(default_factory=lambda: collections.Counter())
    other_codes: dict[str, int] = dataclasses.field(default_factory=lambda: collections.Counter())
    # status details (first words) of refused, unavailable, hung and lost requests: who refused and why
    details: dict[str, int] = dataclasses.field(default_factory=lambda: collections.Counter())
    killed_at: float | None = None  # monotonic time of the replica kill (--kill-after)
    killed: str = ""  # what the kill callable returned (the replica's actor name)
    first_ok_after_kill_s: dict[int, float] = dataclasses.field(default_factory=dict, repr=False)
    ttft_s: list[float] = dataclasses.field(default_factory=list, repr=False)
    e2e_s: list[float] = dataclasses.field(default_factory=list, repr=False)
    tokens: int = 0

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return 0.0
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))]

    def summary(self) -> dict:
        extra = {}
        if self.killed_at is not None:
            firsts = list(self.first_ok_after_kill_s.values())
            extra = {"killed": self.killed, "clients_served_after_kill": len(firsts),
                     "first_ok_after_kill_p50_s": round(self.pct(firsts, 0.5), 3),
                     "first_ok_after_kill_p99_s": round(self.pct(firsts, 0.99), 3)}
        return {**extra, "streams": self.streams, "duration_s": self.duration_s, "wall_s": round(self.wall_s, 2),
                "requests": self.requests, **{k: self.outcomes.get(k, 0) for k in
                                              ("ok", "refused", "unavailable", "hung", "lost")},
                "other_codes": dict(self.other_codes), "details": dict(self.details), "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
                "ttft_p50_s": round(self.pct(self.ttft_s, 0.5), 4), "ttft_p99_s": round(self.pct(self.ttft_s, 0.99), 4),
                "e2e_p50_s": round(self.pct(self.e2e_s, 0.5), 4), "e2e_p99_s": round(self.pct(self.e2e_s, 0.99), 4)}


async def _client(stubs, i: int, res: SoakResult, end_t: float, *, app_name: str, max_tokens: int,
                  request_timeout_s: float, backoff_s: float, prompt_ids) -> None:
    key = os.environ.get(API_KEY_ENV, "").strip()  # as the Client sends it
    md = (("application", app_name),) + ((("authorization", f"Bearer {key}"),) if key else ())
    stub = stubs[i % len(stubs)]
    n = 0
    while time.monotonic() < end_t:
        req = pb.GenerateRequest(prompt_token_ids=prompt_ids(i, n), max_tokens=max_tokens, ignore_eos=True,
                                 request_class=("chat", "code_edit", "extraction", "default")[(i + n) % 4])
        n += 1
        t0 = time.monotonic()
        first = None
        finished = False
        tokens = 0
        try:
            async for ch in stub.GenerateStream(req, metadata=md, timeout=request_timeout_s):
                if first is None:
                    first = time.monotonic() - t0
                tokens += len(ch.token_ids)
                finished = finished or ch.finished
            outcome = "ok" if finished else "lost"
        except grpc.aio.AioRpcError as e:
            code = e.code()
            outcome = {grpc.StatusCode.RESOURCE_EXHAUSTED: "refused", grpc.StatusCode.UNAVAILABLE: "unavailable",
                       grpc.StatusCode.DEADLINE_EXCEEDED: "hung"}.get(code, "lost")
            if outcome == "lost":
                res.other_codes[code.name] += 1
            res.details[f"{code.name}: {(e.details() or '')[:48]}"] += 1
        res.outcomes[outcome] += 1
        if outcome == "ok" and res.killed_at is not None and i not in res.first_ok_after_kill_s:
            res.first_ok_after_kill_s[i] = time.monotonic() - res.killed_at
        if outcome == "ok":
            res.tokens += tokens
            res.e2e_s.append(time.monotonic() - t0)
            if first is not None:
                res.ttft_s.append(first)
        elif outcome in ("refused", "unavailable"):
            await asyncio.sleep(backoff_s)


async def soak_async(address: str, *, streams: int = 200, duration_s: float = 60.0, app_name: str = "adaptspec",
                     max_tokens: int = 16, request_timeout_s: float = 120.0, backoff_s: float = 0.05,
                     channels: int = 8, vocab: int = 16, kill_after_s: float | None = None,
                     kill=None) -> SoakResult:
    """``kill``: a blocking callable run ``kill_after_s`` into the soak (kills a replica)."""
    res = SoakResult(streams, duration_s)
    chans = [grpc.aio.insecure_channel(address) for _ in range(max(1, min(channels, streams)))]
    try:
        stubs = [pb_grpc.AdaptSpecStub(c) for c in chans]

        def prompt_ids(i: int, n: int) -> list[int]:  # token ids every vocabulary of >= `vocab` holds
            return [(i * 7 + n * 3 + j) % vocab for j in range(3 + (i + n) % 5)]

        t0 = time.monotonic()
        end_t = t0 + duration_s

        async def killer():
            await asyncio.sleep(kill_after_s)
            res.killed = await asyncio.to_thread(kill)
            res.killed_at = time.monotonic()
            await asyncio.sleep(5)
            res.killed += f"; 5 s later: {await asyncio.to_thread(replica_names)}"

        extra = [killer()] if kill is not None and kill_after_s is not None else []
        await asyncio.gather(*extra, *(_client(stubs, i, res, end_t, app_name=app_name, max_tokens=max_tokens,
                                               request_timeout_s=request_timeout_s, backoff_s=backoff_s,
                                               prompt_ids=prompt_ids) for i in range(streams)))
        res.wall_s = time.monotonic() - t0
    finally:
        for c in chans:
            await c.close()
    return res


def soak(address: str, **kw) -> SoakResult:
    """``soak_async`` on a fresh event loop (from synchronous code and tests)."""
    return asyncio.run(soak_async(address, **kw))


def local_cluster_config(target: str, draft: str | None, *, grpc_port: int, http_port: int, streams: int,
                         max_num_seqs: int = 8, replicas: int = 2):
    """The service the soak and the scale-out tests run: ``replicas`` TargetEngine replicas
    (one per node), each holding ``streams / replicas`` requests (KV slots + queue), so the
    clients fit without a refusal when routing works."""
    from adaptspec.serve.config import ServiceConfig

    per = -(-streams // replicas)
    return ServiceConfig.model_validate({
        "models": {"target": target, "draft": draft}, "grpc_port": grpc_port, "http_port": http_port,
        "target": {"num_replicas": replicas, "num_cpus": 1},
        "controller": {"report_interval_s": 0.2, "max_k": 4, "checkpoint": "ray", "checkpoint_interval_s": 0.5,
                       "cost_profile": None},
        "engine": {"max_num_seqs": max_num_seqs, "max_model_len": 512, "max_queued": max(per - max_num_seqs, 0),
                   "torch_threads": 1},
        "max_tokens_limit": 400})


def start_local_cluster(nodes: int = 2, cpus_per_node: int = 1):
    """A local multi-node Ray cluster (``ray.cluster_utils.Cluster``) with Serve's request-path
    settings and this process connected to it; returns the cluster (``.shutdown()``)."""
    import os

    import ray
    from ray.cluster_utils import Cluster

    from adaptspec.serve.app import SERVE_LATENCY_ENV

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for k, v in SERVE_LATENCY_ENV.items():  # the raylets and their workers inherit them
        os.environ.setdefault(k, v)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False,
                                                            "object_store_memory": 256 * 1024**2})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node, object_store_memory=256 * 1024**2)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    return cluster


def kill_one_replica(part: str = "#TargetEngine#") -> str:
    """Kill one TargetEngine replica's actor as a crash would (no graceful shutdown); its name
    and the replicas there are a few seconds later (Serve starts a replacement)."""
    import ray

    before = replica_names(part)
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if part in a["name"])
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    return f"{actor['name']} of {before}"


def replica_names(part: str = "#TargetEngine#") -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if part in a["name"])


def _record(path: str, summary: dict, args) -> None:
    from pathlib import Path

    lines = [f"## Soak: {summary['streams']} concurrent gRPC streams for {summary['duration_s']:.0f} s"
             + (" (a replica killed)" if "first_ok_after_kill_p99_s" in summary else ""),
             "", f"Command: `python -m adaptspec.serve.soak {' '.join(args)}`", "",
             "| " + " | ".join(summary) + " |", "|" + "---|" * len(summary),
             "| " + " | ".join(json.dumps(v) if isinstance(v, dict) else str(v) for v in summary.values()) + " |", ""]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import tempfile
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m adaptspec.serve.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default="127.0.0.1:9000", help="a running service (ignored with --cluster)")
    ap.add_argument("--app", default="adaptspec")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds after which a request counts as hung")
    ap.add_argument("--cluster", action="store_true", help="start a local 2-node Ray cluster, 2 replicas")
    ap.add_argument("--model", default=None, help="with --cluster: the target (default: a tiny random model)")
    ap.add_argument("--draft", default=None, help="with --cluster and --model: the draft")
    ap.add_argument("--record", default=None, help="append the numbers to this Markdown file")
    ap.add_argument("--kill-after", type=float, default=None,
                    help="with --cluster: kill one TargetEngine replica this many seconds in")
    args = ap.parse_args(argv)
    cluster = None
    address = args.address
    vocab = 16
    try:
        if args.cluster:
            from adaptspec.serve import app

            if args.model is None:
                from tests.conftest import make_tiny_model  # the repository's tiny-model helper

                tmp = Path(tempfile.mkdtemp(prefix="adaptspec-soak-"))
                target, draft = str(make_tiny_model(tmp / "t", seed=0)), str(make_tiny_model(tmp / "d", seed=1,
                                                                                             layers=1))
            else:
                target, draft, vocab = args.model, args.draft, 1000
            cluster = start_local_cluster()
            cfg = local_cluster_config(target, draft, grpc_port=9717, http_port=8717, streams=args.streams)
            app.start(cfg)
            address = "127.0.0.1:9717"
        kill = None
        if args.kill_after is not None:
            if cluster is None:
                raise SystemExit("--kill-after needs --cluster")
            kill = kill_one_replica
        res = soak(address, streams=args.streams, duration_s=args.duration, app_name=args.app,
                   max_tokens=args.max_tokens, request_timeout_s=args.timeout, vocab=vocab,
                   kill_after_s=args.kill_after, kill=kill)
    finally:
        if cluster is not None:
            from adaptspec.serve import app

            app.stop()
            cluster.shutdown()
    summary = res.summary()
    print(json.dumps(summary, indent=1))
    if args.record:
        _record(args.record, summary, sys.argv[1:] if argv is None else argv)
    return 0 if summary["lost"] == 0 and summary["hung"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
