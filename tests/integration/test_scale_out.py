"""Scaling out and failing safely, on a local two-node Ray cluster (``ray.cluster_utils.Cluster``)
with two TargetEngine replicas (one per node: each node has the one CPU a replica reserves),
real Serve gRPC proxies on loopback and tiny random models.

- many concurrent streams (a short CI version of ``python -m adaptspec.serve.soak``): none
  lost or hung, none refused while the clients fit in the replicas' capacity (Serve's
  router sends a replica no more than its engine holds);
- the controller restarted: the policy, pins and per-class counters come back from its
  checkpoint in Ray's GCS;
- a replica killed under load: every accepted request ends in a response or UNAVAILABLE,
  new requests succeed, and Serve starts a replacement. The time from the kill to each
  client's first success is printed (a number for docs/results, not an assertion).

Destructive tests run last.
"""
from __future__ import annotations

import os
import secrets
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

from adaptspec.serve.client import Client  # noqa: E402

pytestmark = pytest.mark.timeout(400)

GRPC_PORT, HTTP_PORT = 9617, 8617
STREAMS = 200


@pytest.fixture(scope="module")
def cluster(tiny_dir, tiny_draft_dir):
    import ray

    from adaptspec.serve import app
    from adaptspec.serve.soak import local_cluster_config, start_local_cluster

    if ray.is_initialized():  # a previous module's Ray: this one needs its own cluster
        app.stop()
    token = secrets.token_urlsafe(16)
    saved = os.environ.get("ADAPTSPEC_ADMIN_TOKEN")
    os.environ["ADAPTSPEC_ADMIN_TOKEN"] = token  # the raylets (and so the replicas) inherit it
    c = start_local_cluster(nodes=2, cpus_per_node=1)
    try:
        cfg = local_cluster_config(str(tiny_dir), str(tiny_draft_dir), grpc_port=GRPC_PORT, http_port=HTTP_PORT,
                                   streams=STREAMS)
        app.start(cfg)
        client = Client(f"127.0.0.1:{GRPC_PORT}", token=token)
        client.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, timeout=60)
        yield cfg, client
        client.close()
    finally:
        app.stop()
        c.shutdown()
        if saved is None:
            os.environ.pop("ADAPTSPEC_ADMIN_TOKEN", None)
        else:
            os.environ["ADAPTSPEC_ADMIN_TOKEN"] = saved


def _named(part: str) -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if part in a["name"]]


def _kill(actor: dict) -> None:
    import ray

    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def _wait_for(fn, what: str, limit_s: float = 60.0, every_s: float = 0.2):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            out = fn()
        except grpc.RpcError:
            out = None
        if out:
            return out
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def test_replicas_are_spread_over_both_nodes(cluster):
    import ray

    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and len(_named("#TargetEngine#")) == 2


def test_many_concurrent_streams_end_without_loss(cluster):
    from adaptspec.serve.soak import soak

    res = soak(cluster[1].address, streams=STREAMS, duration_s=8.0, max_tokens=16, request_timeout_s=90.0)
    s = res.summary()
    print("soak", s)
    assert s["requests"] >= STREAMS and s["ok"] > 0
    assert s["lost"] == 0 and s["hung"] == 0 and s["unavailable"] == 0, s
    # the clients fit in the two replicas' capacity: Serve routes before an engine refuses
    assert s["refused"] == 0, s


def test_controller_restart_brings_the_learned_state_back(cluster):
    cfg, client = cluster
    client.update_policy("ucb", pins={"chat": ("ngram", 3)})
    for i in range(6):
        client.generate(prompt_token_ids=[1 + i, 2, 3], max_tokens=8, request_class="extraction", timeout=60)
    before = _wait_for(lambda: (s := client.stats()) and next(c for c in s.classes if c.request_class == "extraction")
                       .requests >= 6 and s, "the replicas' reports")
    time.sleep(3 * cfg.controller.checkpoint_interval_s)  # a checkpoint after `before`
    old = _named("#Controller#")
    assert len(old) == 1
    _kill(old[0])
    pol = _wait_for(lambda: (p := client.policy(timeout=5)) and p.version > 0 and p, "the restarted controller")
    assert {a["name"] for a in _named("#Controller#")} != {old[0]["name"]}  # a new actor, not the old one
    assert pol.policy == "ucb"
    assert [(c.arm, c.pinned) for c in pol.classes if c.request_class == "chat"] == [("ngram:3", True)]
    after = client.stats()
    req = {c.request_class: c.requests for c in after.classes}
    assert req["extraction"] >= next(c.requests for c in before.classes if c.request_class == "extraction")
    client.update_policy("thompson", unpin=["chat"])


def test_killing_a_replica_under_load_loses_nothing(cluster):
    cfg, client = cluster
    outcomes: list[str] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        try:
            last = None
            for last in client.stream(prompt_token_ids=[1 + i % 9, 2, 3], max_tokens=400, ignore_eos=True,
                                      timeout=120):
                pass
            out = "ok" if last is not None and last.finished else "lost"
        except grpc.RpcError as e:
            out = e.code().name
        with lock:
            outcomes.append(out)

    before = {a["name"] for a in _named("#TargetEngine#")}
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(24)]
    for t in threads:
        t.start()
    busy = _wait_for(lambda: [r for r in client.stats().replicas if r.in_flight > 0 and r.replica_id], "load",
                     every_s=0.05)
    victim = next(a for a in _named("#TargetEngine#") if a["name"].endswith(busy[0].replica_id))
    _kill(victim)
    killed_at = time.monotonic()

    firsts: list[float] = []

    def probe() -> None:  # each a client that retries until it gets an answer
        while time.monotonic() - killed_at < 60:
            try:
                client.generate(prompt_token_ids=[4, 5], max_tokens=4, timeout=10)
                firsts.append(time.monotonic() - killed_at)
                return
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), e.details()
                time.sleep(0.05)

    probes = [threading.Thread(target=probe, daemon=True) for _ in range(16)]
    for t in probes:
        t.start()
    for t in probes + threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads + probes), "a request hung"
    print("kill outcomes", {o: outcomes.count(o) for o in set(outcomes)})
    firsts.sort()
    print(f"time to first success after the kill: p50 {firsts[len(firsts) // 2]:.3f} s, "
          f"p99 {firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))]:.3f} s over {len(firsts)} clients")
    assert len(outcomes) == 24 and set(outcomes) <= {"ok", "UNAVAILABLE"}, outcomes
    assert "UNAVAILABLE" in outcomes  # the kill hit requests in flight (else this test proved nothing)
    assert len(firsts) == 16
    # Serve replaces the replica; both then serve
    _wait_for(lambda: len(now := {a["name"] for a in _named("#TargetEngine#")}) == 2 and now != before,
              "a replacement replica")
    for i in range(8):
        assert client.generate(prompt_token_ids=[i % 9 + 1, 3], max_tokens=4, timeout=60).finish_reason
