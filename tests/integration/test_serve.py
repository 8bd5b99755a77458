"""The service end to end: real local Ray, real Serve gRPC proxy on loopback, tiny models.

One Ray/Serve instance for the module. Two applications share its proxy: `adaptspec`
(the default config on tiny random models) and `faulty` (strict classes, an n-gram
drafter that raises, every class pinned to n-gram). A third, `smollm`, deploys SmolLM2 and
its draft for one end-to-end test and is deleted after it.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

from adaptspec.serve.client import Client  # noqa: E402
from adaptspec.serve.config import ServiceConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 9317, 8317
MAX_NUM_SEQS, MAX_QUEUED = 4, 4
CLASSES = ["chat", "code_edit", "extraction", "default"]


def _config(target, draft, **over) -> ServiceConfig:
    base = {"models": {"target": str(target), "draft": str(draft)}, "grpc_port": GRPC_PORT, "http_port": HTTP_PORT,
            "target": {"num_cpus": 0}, "controller": {"report_interval_s": 0.1, "max_k": 4},
            "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_model_len": 512, "max_queued": MAX_QUEUED,
                       "torch_threads": 1},
            "max_tokens_limit": 400}
    base.update(over)
    return ServiceConfig.model_validate(base)


@pytest.fixture(scope="module")
def service(tiny_dir, tiny_draft_dir):
    from ray import serve

    from adaptspec.serve import app

    cfg = _config(tiny_dir, tiny_draft_dir)
    app.start(cfg, num_cpus=4)
    faulty = _config(tiny_dir, tiny_draft_dir, app_name="faulty", strict_classes=True,
                     faults={"drafter": "ngram", "after_calls": 3, "every": 2},
                     classes=[{"name": c, "pin": {"drafter": "ngram", "k": 4}} for c in CLASSES])
    serve.run(app.build_app(faulty), name="faulty", route_prefix="/faulty")
    client = Client(f"127.0.0.1:{GRPC_PORT}")
    yield cfg, client
    client.close()
    app.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The engine alone (no Ray), for greedy equality."""
    from adaptspec import Engine, SamplingParams

    eng = Engine.from_pretrained(str(tiny_dir), max_num_seqs=4, max_model_len=512)

    def run(ids, max_tokens):
        return eng.generate([ids], SamplingParams(max_new_tokens=max_tokens))[0].token_ids

    return run


def _prompt(i: int) -> list[int]:
    return [(i * 7 + j * 3) % 16 for j in range(3 + i % 5)]


def _wait_for(fn, what: str, limit_s: float = 30.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        out = fn()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _idle(client: Client) -> bool:
    reps = client.stats().replicas
    return bool(reps) and all(r.in_flight == 0 and r.free_slots == MAX_NUM_SEQS for r in reps)


def test_unary_matches_engine(service, reference):
    _, client = service
    r = client.generate(prompt_token_ids=_prompt(1), max_tokens=12, request_class="chat", timeout=60)
    assert list(r.token_ids) == reference(_prompt(1), 12)
    assert r.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(_prompt(1)) and r.usage.completion_tokens == len(r.token_ids)
    assert r.request_class == "chat" and r.speculation.steps >= 1 and r.timings.e2e_s > 0


def test_stream_yields_the_same_tokens(service, reference):
    _, client = service
    chunks = list(client.stream(prompt_token_ids=_prompt(2), max_tokens=10, request_class="code_edit", timeout=60))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference(_prompt(2), 10)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert "".join(c.text for c in chunks).split() == [f"t{t}" for t in tokens]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(service):
    """The same 40-token prompt twice: the second is served its full blocks (16 positions each)
    from the prefix cache, and its usage says so; the first prefilled them (control: nothing
    cached for a prompt no request sent before)."""
    _, client = service
    prompt = [(j * 5 + j // 3) % 16 for j in range(40)]
    first = client.generate(prompt_token_ids=prompt, max_tokens=4, request_class="chat", timeout=60)
    again = client.generate(prompt_token_ids=prompt, max_tokens=4, request_class="chat", timeout=60)
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == 32 and again.usage.prompt_tokens == 40
    chunks = list(client.stream(prompt_token_ids=prompt, max_tokens=4, request_class="chat", timeout=60))
    assert chunks[-1].usage.cached_prompt_tokens == 32


def test_32_concurrent_mixed_classes(service, reference):
    _, client = service

    def one(i):
        return client.generate(prompt_token_ids=_prompt(i), max_tokens=8 + i % 9, request_class=CLASSES[i % 4],
                               speculation=None if i % 3 else ("draft", 1 + i % 4), timeout=120)

    # 32 > max_num_seqs + max_queued: callers retry on RESOURCE_EXHAUSTED like a client should
    def with_retry(i):
        while True:
            try:
                return one(i)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                time.sleep(0.05)

    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(with_retry, range(32)))
    for i, r in enumerate(outs):
        assert list(r.token_ids) == reference(_prompt(i), 8 + i % 9), f"request {i}"
        assert r.request_class == CLASSES[i % 4]


def test_stats_and_policy_update(service):
    _, client = service
    client.generate(prompt_token_ids=_prompt(3), max_tokens=6, request_class="extraction", timeout=60)
    st = _wait_for(lambda: (s := client.stats()) and sum(c.requests for c in s.classes) > 0 and s, "stats")
    assert {c.request_class for c in st.classes} >= set(CLASSES)
    assert st.policy == "thompson" and st.replicas and st.replicas[0].steps > 0
    # the controller's own CPU (its Serve actor's process) and thompson's cost model against the steps
    assert st.HasField("controller_cpu_s") and st.controller_cpu_s >= st.policy_cpu_s > 0
    st = _wait_for(lambda: (s := client.stats()) and s.cost_check and s, "the cost check's first steps")
    assert all(r.steps > 0 and r.predicted_s > 0 and r.measured_s > 0 for r in st.cost_check)

    pol = client.update_policy("ucb", pins={"chat": ("ngram", 2)})
    assert pol.policy == "ucb"
    assert [(c.arm, c.pinned) for c in pol.classes if c.request_class == "chat"] == [("ngram:2", True)]
    # replicas pick the snapshot up at their next report (0.1 s here; a request in flight then
    # switches mid-way): poll until a whole request runs on the pinned arm. The engine records
    # the effective k: smaller near max_tokens (none on the last token)
    def on_pin():
        x = client.generate(prompt_token_ids=_prompt(4), max_tokens=8, request_class="chat", timeout=60)
        arms = {a.arm for a in x.speculation.arms}
        return arms <= {"ngram:2", "ngram:1", "none:0"} and "ngram:2" in arms and x
    _wait_for(on_pin, "a chat request to run on the pinned arm ngram:2 alone")
    pol = client.update_policy("thompson", unpin=["chat"])
    assert not any(c.pinned for c in pol.classes) and client.policy().policy == "thompson"
    # a static arm per class (the fair static reference when classes differ), then back
    pol = client.update_policy("static:none:0/extraction=ngram:2")
    assert {c.request_class: c.arm for c in pol.classes} == {"chat": "none", "code_edit": "none",
                                                           "extraction": "ngram:2", "default": "none"}
    client.update_policy("thompson")
    assert client.policy().policy == "thompson"


@pytest.mark.parametrize("fields, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="   "), "prompt"),
    (dict(prompt_token_ids=[1, 2], max_tokens=0), "max_tokens"),
    (dict(prompt_token_ids=[1, 2], max_tokens=401), "max_tokens"),
    (dict(prompt_token_ids=[1] * 300, max_tokens=300), "max_tokens"),  # past the context (512)
    (dict(prompt_token_ids=[1, 2], temperature=-0.5), "temperature"),
    (dict(prompt_token_ids=[1, 2], top_p=0.0), "top_p"),
    (dict(prompt_token_ids=[1, 2], top_p=1.5), "top_p"),
    (dict(prompt_token_ids=[1, 2], speculation=("ngram", 17)), "speculation.k"),
    (dict(prompt_token_ids=[1, 2], speculation=("medusa", 2)), "speculation.drafter"),
    (dict(prompt_token_ids=[1, 99]), "prompt_token_ids"),  # outside the vocabulary (16)
])
def test_bad_input_is_invalid_argument(service, fields, field):
    _, client = service
    for call in (client.generate, lambda **f: list(client.stream(**f))):
        with pytest.raises(grpc.RpcError) as err:
            call(timeout=30, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()


def test_bad_policy_update_is_invalid_argument(service):
    _, client = service
    for kwargs, field in ((dict(policy="greedy-magic"), "policy"), (dict(pins={"chat": ("ngram", 17)}), "k"),
                          (dict(policy="static:none:0/poetry=ngram:2"), "policy"),
                          (dict(unpin=["code_edit"]), "unpin")):
        with pytest.raises(grpc.RpcError) as err:
            client.update_policy(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(rf"\b{field}\b", err.value.details()), err.value.details()


def _long(client: Client):
    # plain decoding: 400 engine steps whatever the controller has learned by now (with the
    # n-gram drafter on a repetitive tiny model, 400 tokens can take a few dozen steps)
    return client.stream(prompt_token_ids=[1, 2, 3], max_tokens=400, ignore_eos=True, speculation=("none", 0),
                         timeout=120)


def _still_running(streams: list, ended: list) -> list:
    """The streams not done; the (code, details) of each that is goes into ``ended``."""
    live = []
    for s in streams:
        if s.done():
            ended.append((s.code(), s.details()))
        else:
            live.append(s)
    return live


def test_full_queue_is_resource_exhausted_and_cancel_frees_slots(service):
    _, client = service
    _wait_for(lambda: _idle(client), "an idle replica")
    # Serve sends a replica no more calls than its engine holds (max_ongoing_requests =
    # max_num_seqs + max_queued) and the proxy then holds up to max_queued_requests (default
    # max_queued) before refusing. Send more streams than both hold (the surplus is refused
    # itself), then probe with a unary call whose deadline is long enough that it never leaves a
    # place it took (one that times out client-side can, and open a place for the next). A probe
    # that is served found a place open (a stream had ended): top the streams up and try again.
    capacity = MAX_NUM_SEQS + 2 * MAX_QUEUED
    streams: list = []
    ended: list = []  # (code, details) of the streams that ended, refused ones included
    refused = None
    try:
        for _ in range(20):
            streams = _still_running(streams, ended)
            refused = next((d for c, d in ended if c == grpc.StatusCode.RESOURCE_EXHAUSTED), None)
            if refused is not None:
                break
            streams += [_long(client) for _ in range(capacity + 2 - len(streams))]
            time.sleep(0.2)  # they reach the replica and the proxy's queue
            try:
                client.generate(prompt_token_ids=[1, 2], max_tokens=4, timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
                refused = e.details()
                break
        streams = _still_running(streams, ended)
        odd = [(c, d) for c, d in ended if c not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)]
        assert not odd, f"streams ended with another status: {odd}"
        assert refused is not None, (f"never RESOURCE_EXHAUSTED with the replica and the proxy's queue full; "
                                     f"{len(ended)} streams ended first, all OK")
    finally:
        for s in streams:
            s.cancel()
    _wait_for(lambda: _idle(client), "cancelled requests to free their slots")
    assert client.generate(prompt_token_ids=[1, 2], max_tokens=4, timeout=30).token_ids


def test_deadline_aborts_and_frees_the_slot(service):
    _, client = service
    _wait_for(lambda: _idle(client), "an idle replica")
    # plain decoding (no speculation): 400 engine steps, far longer than the deadline (a step
    # of the tiny model takes 0.3-1 ms here: 0.15 s was once too long, 400 steps finished in it)
    slow = dict(prompt_token_ids=[1, 2, 3], max_tokens=400, ignore_eos=True, speculation=("none", 0), timeout=0.05)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**slow)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(**slow))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: _idle(client), "the expired requests to free their slots")


def test_drafter_that_raises_still_gives_the_target_output(service, reference):
    _, client = service
    faulty = Client(client.address, app_name="faulty")
    try:
        for i in range(3):
            chunks = list(faulty.stream(prompt_token_ids=_prompt(i), max_tokens=30, request_class="chat",
                                        timeout=60))
            assert [t for c in chunks for t in c.token_ids] == reference(_prompt(i), 30)
            assert chunks[-1].finished
        # replicas report to the controller every report_interval_s: the stats lag the steps
        _wait_for(lambda: (r := faulty.stats().replicas) and r[0].drafter_faults > 0, "the replica's drafter faults")
        with pytest.raises(grpc.RpcError) as err:  # strict classes
            faulty.generate(prompt_token_ids=[1, 2], request_class="poetry", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_class" in err.value.details()
    finally:
        faulty.close()


def test_server_reflection_lists_the_service(service):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, client = service
    assert "adaptspec.v1.AdaptSpec" in ProtoReflectionDescriptorDatabase(client.channel).get_services()


def test_standard_grpc_health_checking(service):
    """grpc.health.v1.Health through Serve's proxy: Check for the server and the API service,
    NOT_FOUND for other names, Watch streams the status. (This module runs several apps, so
    the calls carry the `application` metadata; with one app the proxy routes them without.)"""
    from adaptspec.proto import health_pb2, health_pb2_grpc

    _, client = service
    stub, ok = health_pb2_grpc.HealthStub(client.channel), health_pb2.HealthCheckResponse
    for name in ("", "adaptspec.v1.AdaptSpec"):
        assert client.health(name, timeout=30).status == ok.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), metadata=client.metadata, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    watch = stub.Watch(health_pb2.HealthCheckRequest(), metadata=client.metadata, timeout=30)
    try:
        assert next(watch).status == ok.SERVING
    finally:
        watch.cancel()


def test_unknown_class_goes_to_default(service):
    _, client = service
    r = client.generate(prompt_token_ids=[1, 2], max_tokens=3, request_class="poetry", timeout=30)
    assert r.request_class == "default"


def test_disaggregated_placement_end_to_end(service, reference, tiny_dir, tiny_draft_dir):
    """The draft model in a Drafter replica: every class pinned to draft:3, outputs exact."""
    from ray import serve

    from adaptspec.serve import app

    cfg = _config(tiny_dir, tiny_draft_dir, app_name="disagg", placement="disaggregated",
                  drafter={"num_cpus": 0}, classes=[{"name": c, "pin": {"drafter": "draft", "k": 3}} for c in CLASSES])
    serve.run(app.build_app(cfg), name="disagg", route_prefix="/disagg")
    client = Client(service[1].address, app_name="disagg")
    try:
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda i: client.generate(prompt_token_ids=_prompt(i), max_tokens=20,
                                                           request_class=CLASSES[i % 4], timeout=120), range(6)))
        for i, r in enumerate(outs):
            assert list(r.token_ids) == reference(_prompt(i), 20)
            assert any(a.arm.startswith("draft:") for a in r.speculation.arms)
        assert sum(r.speculation.drafted for r in outs) > 0
        # a report that has seen this app's steps (the stats lag them by a report interval)
        assert _wait_for(lambda: (r := client.stats().replicas) and r[0].steps > 0 and r[0], "a report").drafter_faults == 0
    finally:
        client.close()
        serve.delete("disagg")


@pytest.mark.slow
def test_smollm_end_to_end(service, smollm_engine):
    """SmolLM2 and its draft behind the same proxy: greedy text equals the engine's."""
    from ray import serve

    from adaptspec import SamplingParams
    from adaptspec.serve import app

    cfg = ServiceConfig.model_validate({
        "app_name": "smollm", "grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "target": {"num_cpus": 0},
        "models": {"dtype": "float32"},  # token for token against the fp32 reference engine
        "engine": {"max_num_seqs": 4, "max_model_len": 1024, "torch_threads": 1},
        "controller": {"report_interval_s": 0.1}})
    serve.run(app.build_app(cfg), name="smollm", route_prefix="/smollm")
    client = Client(f"127.0.0.1:{GRPC_PORT}", app_name="smollm")
    try:
        prompts = ["What causes the seasons on Earth?", "Name three prime numbers."]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: client.generate(p, max_tokens=24, request_class="chat", timeout=120),
                                 prompts))
        ref = smollm_engine.generate(prompts, SamplingParams(max_new_tokens=24))
        for got, want in zip(outs, ref):
            assert list(got.token_ids) == want.token_ids and got.text == want.text
        assert client.stats().classes
    finally:
        client.close()
        serve.delete("smollm")


def test_background_probes_count_their_calls(service):
    """``loadtest --probes``: Health/Check callers in a child process; a wrong app only errors."""
    from adaptspec.serve.loadtest import Probes

    _, client = service
    ok = Probes(client.address, "adaptspec", 2)
    proc = ok.proc
    time.sleep(2.0)
    got = ok.stop()
    assert proc.returncode == 0  # the child stopped at EOF on its stdin
    bad = Probes(client.address, "no-such-app", 1)
    time.sleep(2.0)
    miss = bad.stop()
    assert got["calls"] > 0 and got["errors"] == 0 and got["calls_per_s"] > 0
    assert miss["calls"] == 0 and miss["errors"] > 0
    assert ok.stop() is None  # idempotent
    # the rate is over the seconds the clients were connected (no wall-clock bound: the machine may be slow)
    assert 0 < got["seconds"] < 2.0 + 60 and got["calls_per_s"] == pytest.approx(got["calls"] / got["seconds"])


def test_loadtest_command_over_grpc_interleaves_policies_and_restores_the_deployed_one(service, tmp_path):
    """``adaptspec loadtest`` against the running service: a level per policy, every request
    answered, the policy switched by UpdatePolicy and switched back at the end; prompts from a
    file (``--prompts``), which the JSON names."""
    import json

    from typer.testing import CliRunner

    from adaptspec.cli import app

    _, client = service
    _wait_for(lambda: _idle(client), "an idle replica")
    deployed = client.policy().policy
    out, pools = tmp_path / "lt.json", tmp_path / "pools.json"
    pools.write_text(json.dumps({"chat": ["Say hello."], "code_edit": ["Fix: def f(: pass"],
                                 "extraction": ["Name the city: I live in Oslo.",
                                                "List the numbers: 3 apples, 4 pears."]}))
    # replicas take a new policy's arms at their next report (0.1 s here): a second of warm-up
    # lets the requests that ran on the previous policy's arms finish before the window
    res = CliRunner().invoke(app, ["loadtest", "--address", client.address, "--concurrency", "2", "--duration", "1.0",
                                   "--warmup", "1.0", "--max-tokens", "8", "--rounds", "2", "--prompts", str(pools),
                                   "--policies", "static:none:0,static:ngram:2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["prompts"] == str(pools)  # the file says where its requests' prompts came from
    levels = got["levels"]
    assert [(x["policy"], x["concurrency"]) for x in levels] == [("static:none:0", 2), ("static:ngram:2", 2)]
    for lv in levels:
        assert lv["requests"] > 0 and lv["errors"] == 0
        # the controller's CPU over the policy's runs, read off GetStats; a static policy has no cost model
        assert 0 < lv["controller_cpu_share"] < 2 and lv["policy_cpu_share"] >= 0
        assert lv["cost_check"] == [] and len(lv["round_arms"]) == 2
    top = [{max(per, key=per.get) for per in lv["arms"].values()} for lv in levels]
    assert top[0] == {"none:0"} and top[1] <= {"ngram:2", "ngram:1"}, top
    assert client.policy().policy == deployed
