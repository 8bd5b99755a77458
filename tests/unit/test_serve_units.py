"""Service pieces without Ray: drafter guards, the engine loop, the controller core, validation."""
from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from adaptspec.serve.config import FaultInjection, ServiceConfig


@pytest.fixture(scope="module")
def engines(tiny_dir, tiny_draft_dir):
    from adaptspec import Engine

    def make(**kw):
        return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_draft_dir), max_num_seqs=kw.get("seqs", 4),
                                      max_model_len=256)
    return make


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6], [7, 7, 7, 7, 8]]


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_a_raising_drafter_means_plain_decoding_and_the_exact_output(engines, drafter):
    from adaptspec import SamplingParams, SpecConfig
    from adaptspec.serve.faults import guard_proposers

    params = SamplingParams(max_new_tokens=40)
    want = [o.token_ids for o in engines().generate(PROMPTS, params, SpecConfig("none", 0))]
    eng = engines()
    # fails on calls 3, 5, 7, ...: mid-stream, between good calls
    guards = guard_proposers(eng, inject=FaultInjection(drafter=drafter, after_calls=2, every=2), cooldown_s=0.0)
    got = [o.token_ids for o in eng.generate(PROMPTS, params, SpecConfig(drafter, 4))]
    assert got == want
    assert sum(g.faults for g in guards) > 0


def _collect(loop_, req):
    async def run():
        return [c async for c in loop_.generate(req)]
    return asyncio.run(run())


def _req(rid, ids, n=8, **kw):
    from adaptspec.engine.params import SamplingParams
    from adaptspec.serve.types import EngineRequest

    return EngineRequest(rid, "chat", SamplingParams(max_new_tokens=n, ignore_eos=True), prompt_token_ids=ids, **kw)


def test_engine_loop_streams_exact_tokens_and_refuses_a_full_queue(engines):
    from adaptspec import SamplingParams
    from adaptspec.control import Arm
    from adaptspec.serve.loop import EngineLoop
    from adaptspec.serve.types import PolicySnapshot

    want = engines().generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    loop_ = EngineLoop(engines(seqs=1), max_queued=0)
    loop_.snapshot = PolicySnapshot(1, {"chat": Arm("ngram", 3)})
    try:
        chunks = _collect(loop_, _req("a", PROMPTS[0], 12, stream=True))
        assert [t for c in chunks for t in c.token_ids] == want and chunks[-1].finished
        assert "ngram:3" in chunks[-1].arms
        unary = _collect(loop_, _req("a2", PROMPTS[0], 12))  # one chunk, every token: one wake-up
        assert len(unary) == 1 and unary[0].finished and unary[0].token_ids == want

        async def two():
            first = loop_.generate(_req("b", PROMPTS[1], 200, stream=True))
            c1 = await first.__anext__()  # admitted and running: the only slot
            refused = [c async for c in loop_.generate(_req("c", PROMPTS[2]))]
            await first.aclose()  # the consumer goes away: abort, free the slot
            return c1, refused

        c1, refused = asyncio.run(two())
        assert c1.token_ids and refused[0].error.code == "RESOURCE_EXHAUSTED"
        for _ in range(100):
            if not loop_.engine.requests and loop_.engine.free_seqs == 1:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not loop_.engine.requests and loop_.engine.free_seqs == 1
        bad = _collect(loop_, _req("d", [1, 99]))
        assert bad[0].error.code == "INVALID_ARGUMENT" and "prompt_token_ids" in bad[0].error.message
    finally:
        loop_.stop()


@pytest.mark.timeout(180)
def test_engine_process_streams_exact_tokens_frees_slots_and_fails_callers_when_it_dies(engines, tiny_dir,
                                                                                     tiny_draft_dir):
    """The default isolation: the engine in a process of its own behind the same caller API."""
    from adaptspec import SamplingParams
    from adaptspec.control import Arm
    from adaptspec.serve.engine_proc import ProcessEngineLoop
    from adaptspec.serve.types import PolicySnapshot

    ref = engines().generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    want = [o.token_ids for o in ref]
    cfg = ServiceConfig.model_validate({
        "models": {"target": str(tiny_dir), "draft": str(tiny_draft_dir)},
        "engine": {"max_num_seqs": 1, "max_queued": 0, "max_model_len": 256, "torch_threads": 1},
        "faults": {"drafter": "draft", "after_calls": 1, "every": 2}})

    async def run():
        loop_ = await ProcessEngineLoop.start(cfg, replica_id="r0")
        try:
            assert loop_.alive and loop_.drafters == ("none", "ngram", "suffix", "draft")
            loop_.snapshot = PolicySnapshot(1, {"chat": Arm("draft", 3)})
            streamed = [c async for c in loop_.generate(_req("a", PROMPTS[0], 12, stream=True))]
            unary = [c async for c in loop_.generate(_req("b", PROMPTS[1], 12))]
            first = loop_.generate(_req("c", PROMPTS[2], 200, stream=True))
            c1 = await first.__anext__()  # admitted and running: the only slot
            refused = [c async for c in loop_.generate(_req("d", PROMPTS[2]))]
            await first.aclose()  # the consumer goes away: abort, free the slot
            for _ in range(200):
                st = loop_.state()
                if st.free_slots == 1 and st.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            bad = [c async for c in loop_.generate(_req("e", [1, 99]))]
            stats, finished = loop_.take_step_stats(), loop_.take_finished()
            # the engine process dies mid-request: the caller gets an error, later ones are refused
            doomed = loop_.generate(_req("f", PROMPTS[0], 200, stream=True))
            await doomed.__anext__()
            loop_.proc.kill()
            rest = await asyncio.wait_for(_drain_all(doomed), 60)
            after = [c async for c in loop_.generate(_req("g", PROMPTS[0]))]
            return streamed, unary, c1, refused, st, bad, stats, finished, rest, after, loop_.alive
        finally:
            loop_.stop()

    streamed, unary, c1, refused, st, bad, stats, finished, rest, after, alive = asyncio.run(run())
    assert [t for c in streamed for t in c.token_ids] == want[0] and streamed[-1].finished
    assert "draft:3" in streamed[-1].arms and "".join(c.text for c in streamed) == ref[0].text
    assert len(unary) == 1 and unary[0].finished and unary[0].token_ids == want[1]
    assert c1.token_ids and refused[0].error.code == "RESOURCE_EXHAUSTED"
    assert (st.replica_id, st.free_slots, st.in_flight) == ("r0", 1, 0)
    assert st.drafter_faults > 0  # the injected faults ran in the engine process; the output stayed exact
    assert bad[0].error.code == "INVALID_ARGUMENT" and "prompt_token_ids" in bad[0].error.message
    assert stats and sum(1 for cls, reason, _ in finished if cls == "chat" and reason == "length") == 2
    assert rest[-1].error.code == "UNAVAILABLE" and "engine process" in rest[-1].error.message
    assert after[0].error.code == "UNAVAILABLE" and not alive


async def _drain_all(gen) -> list:
    return [c async for c in gen]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_engine_that_dies_or_stops_fails_its_callers_instead_of_leaving_them_waiting(engines, tiny_dir, isolation):
    """A replica stopping with requests in flight, and a bug that kills the engine thread
    outside a step (here: a malformed command): every caller gets UNAVAILABLE (a retry can go
    to another replica), later ones are refused with it. A request that cannot start for a
    reason other than its input (an arm without a k) fails alone, with INTERNAL, while the
    running one finishes."""
    from types import SimpleNamespace

    from adaptspec.serve.engine_proc import ProcessEngineLoop
    from adaptspec.serve.loop import EngineLoop

    cfg = ServiceConfig.model_validate({"models": {"target": str(tiny_dir), "draft": None},
                                        "engine": {"max_num_seqs": 2, "max_model_len": 256, "torch_threads": 1}})

    async def start():
        if isolation == "process":
            return await ProcessEngineLoop.start(cfg)
        return EngineLoop(engines(seqs=2), max_queued=4)

    async def run():
        loop_ = await start()
        try:  # the replica stops while a request runs
            running = loop_.generate(_req("a", PROMPTS[0], 200, stream=True))
            await running.__anext__()
            loop_.stop()
            stopped = await asyncio.wait_for(_drain_all(running), 60)
        finally:
            loop_.stop()
        loop_ = await start()
        try:
            running = loop_.generate(_req("b", PROMPTS[0], 200, stream=True))
            first = await running.__anext__()
            bad_arm = _req("c", [1, 2], arm=SimpleNamespace(drafter="none"))
            broken = await asyncio.wait_for(_drain_all(loop_.generate(bad_arm)), 60)
            rest = [first] + await asyncio.wait_for(_drain_all(running), 60)
            doomed = loop_.generate(_req("e", PROMPTS[0], 200, stream=True))
            await doomed.__anext__()
            loop_._post(("malformed",))  # the engine thread dies unpacking it
            dead = await asyncio.wait_for(_drain_all(doomed), 60)
            after = await asyncio.wait_for(_drain_all(loop_.generate(_req("d", PROMPTS[1]))), 60)
            return stopped, broken, rest, dead, after, loop_.alive
        finally:
            loop_.stop()

    stopped, broken, rest, dead, after, alive = asyncio.run(run())
    assert stopped[-1].error.code == "UNAVAILABLE" and "shutting down" in stopped[-1].error.message
    assert broken[-1].error.code == "INTERNAL" and "could not start" in broken[-1].error.message
    assert rest[-1].finished and rest[-1].error is None and sum(len(c.token_ids) for c in rest) == 200
    for name, chunks in (("dead", dead), ("after", after)):
        assert chunks[-1].finished and chunks[-1].error is not None, (name, chunks[-1])
        assert chunks[-1].error.code == "UNAVAILABLE", (name, chunks[-1].error)
    assert "engine" in dead[-1].error.message and not alive


def test_steps_that_keep_failing_end_the_engine(engines):
    """One failed step fails its batch (INTERNAL) and the engine goes on; a sticky error
    (three failed steps in a row) ends it, so health fails and Serve replaces the replica."""
    from adaptspec.serve.loop import MAX_FAILED_STEPS, EngineLoop

    eng = engines(seqs=2)
    real, calls = eng.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 1 or calls["n"] > 2:  # fails, works once, then fails for good
            raise RuntimeError("injected: device-side assert")
        return real()

    eng.step = step
    loop_ = EngineLoop(eng, max_queued=4)
    try:
        outs = [_collect(loop_, _req(f"r{i}", PROMPTS[1], 4)) for i in range(MAX_FAILED_STEPS + 2)]
    finally:
        alive = loop_.alive
        loop_.stop()
    codes = [o[-1].error.code if o[-1].error else None for o in outs]
    # r0 fails in step 1; r1 gets step 2 (works) then fails in step 3, r2 and r3 fail in steps 4-5:
    # three in a row, the engine is gone and r4 is refused
    assert codes[:4] == ["INTERNAL"] * 4 and "device-side assert" in outs[0][-1].error.message
    assert codes[4] == "UNAVAILABLE" and "in a row" in outs[4][-1].error.message and not alive


def test_engine_process_that_cannot_load_says_why(tmp_path):
    from adaptspec.serve.engine_proc import ProcessEngineLoop

    cfg = ServiceConfig.model_validate({"models": {"target": str(tmp_path / "missing"), "draft": None}})
    with pytest.raises(RuntimeError, match="engine process failed to start") as err:
        asyncio.run(ProcessEngineLoop.start(cfg))
    assert "missing" in str(err.value)


def test_isolation_resolves_and_refuses_process_for_disaggregated():
    assert ServiceConfig().engine_isolation == "process"
    dis = {"placement": "disaggregated", "models": {"draft": "some/folder"}}
    assert ServiceConfig.model_validate(dis).engine_isolation == "thread"
    assert ServiceConfig.model_validate({"engine": {"isolation": "thread"}}).engine_isolation == "thread"
    with pytest.raises(ValueError, match="engine.isolation"):
        ServiceConfig.model_validate({**dis, "engine": {"isolation": "process"}})


def test_controller_core_aggregates_pins_and_refuses_bad_updates():
    from adaptspec.control import Arm, StepOutcome
    from adaptspec.control.types import RequestOutcome
    from adaptspec.serve.controller import ControlCore, PolicyUpdate
    from adaptspec.serve.types import ClassDelta, ReplicaReport, ReplicaState

    cfg = ServiceConfig.model_validate({"models": {"draft": None}, "classes": [
        {"name": "chat", "pin": {"drafter": "ngram", "k": 3}}, {"name": "code_edit"}]})
    core = ControlCore(cfg)
    out = StepOutcome.from_requests([RequestOutcome("r", "code_edit", "ngram", 2, 1, 2)], batch_size=1,
                                    num_prefill=0, verify_tokens=3, context_tokens=10, draft_s=0.001,
                                    verify_s=0.01, other_s=0.001, wall_s=0.012)
    snap = core.report(ReplicaReport(ReplicaState("r1", batch_size=1), [out],
                                     [ClassDelta("code_edit", requests=1, drafted=2, accepted=1, emitted=2, steps=1)],
                                     0.25))
    assert snap.arm_for("chat") == Arm("ngram", 3)  # pinned
    assert snap.arm_for("unknown") == snap.arms["default"]
    assert snap.arm_for("code_edit").drafter in ("none", "ngram")  # no draft model configured
    st = core.stats()
    code = next(c for c in st.classes if c.request_class == "code_edit")
    assert (code.requests, code.acceptance_rate, code.mean_accepted_length) == (1, 0.5, 2.0)
    assert st.replicas[0].replica_id == "r1"
    for upd, field in ((PolicyUpdate(policy="nope"), "policy"),
                       (PolicyUpdate(pins=[("chat", Arm("draft", 2))]), "pin[0].arm.drafter"),
                       (PolicyUpdate(pins=[("chat", Arm("ngram", 12))]), "pin[0].arm.k"),
                       (PolicyUpdate(unpins=["code_edit"]), "unpin[0]"),
                       (PolicyUpdate(policy="static:draft:2"), "policy")):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            core.update(upd)
    view = core.update(PolicyUpdate(policy="static:ngram:2", unpins=["chat"]))
    assert view.policy == "static:ngram:2" and all(arm == "ngram:2" and not p for _, arm, p in view.classes)
    # switching back resumes what a policy learned; reset starts it afresh
    learned = core._policies[cfg.controller.policy]
    assert learned.stats.observed_steps == 1
    assert core.update(PolicyUpdate(policy=cfg.controller.policy)).policy == cfg.controller.policy
    assert core.policy is learned
    core.update(PolicyUpdate(reset=True))
    assert core.policy is not learned and core.policy.stats.observed_steps == 0


def test_auto_cost_prior_is_the_measured_cpu_profile_of_the_default_models():
    from adaptspec.serve.policies import load_cost_prior
    from adaptspec.control.gpu_profiles import builtin_profile

    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        prior = load_cost_prior("auto", target="smollm2-135m", dtype=dtype, device="cpu")
        assert prior.profile.calibrated and "measured" in prior.profile.name and dtype in prior.profile.name
        # not the built-in from the issues' stated numbers, which prices a batch of 8 verify
        # tokens at 2.5-4x what the engine takes (and kept the policy from trying them)
        stated = builtin_profile(f"cpu-smollm2-135m-{short}")
        assert not stated.profile.calibrated
        assert prior.verify_s(8.0, 0.0) < 0.5 * stated.verify_s(8.0, 0.0)
    # the service's default dtype ("auto") is float32 on the CPU: the same measured prior
    auto = load_cost_prior("auto", target="smollm2-135m", dtype="auto", device="cpu")
    assert auto is not None and "float32" in auto.profile.name
    assert load_cost_prior("auto", target="some/other-model", dtype="float32", device="cpu") is None
    assert load_cost_prior(None, target="smollm2-135m", dtype="float32", device="cpu") is None


def test_validation_names_the_field_and_resolves_classes():
    from adaptspec.serve.client import request
    from adaptspec.serve.convert import to_engine_request

    cfg = ServiceConfig()
    ok = to_engine_request(request("hi", request_class="poetry"), cfg, stream=False)
    assert ok.request_class == "default" and ok.params.max_new_tokens == cfg.default_max_tokens
    strict = ServiceConfig(strict_classes=True)
    with pytest.raises(ValueError, match="request_class"):
        to_engine_request(request("hi", request_class="poetry"), strict, stream=False)
    for fields, field in ((dict(prompt="hi", top_k=-1), "top_k"), (dict(prompt="hi", stop=[""]), "stop"),
                          (dict(prompt="hi", prompt_token_ids=[1]), "prompt"),
                          (dict(prompt="hi", speculation=("none", 2)), "speculation.k"),
                          (dict(prompt="hi", temperature=float("nan")), "temperature")):
        with pytest.raises(ValueError, match=field):
            to_engine_request(request(**fields), cfg, stream=False)


def test_ingress_and_controller_replicas_stay_torch_free():
    import subprocess
    import sys

    code = ("import sys, adaptspec.serve.ingress, adaptspec.serve.controller, adaptspec.serve.app; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('adaptspec.models')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_disaggregated_drafter_core_matches_the_colocated_draft(engines, tiny_dir, tiny_draft_dir):
    """The Drafter's mirrors give the same greedy drafts as the co-located draft model."""
    from types import SimpleNamespace

    from adaptspec import Engine, SamplingParams, SpecConfig
    from adaptspec.models.loader import load_model
    from adaptspec.serve.drafter import DraftService, RemoteDraftProposer

    params = SamplingParams(max_new_tokens=30)
    colocated = engines().generate(PROMPTS, params, SpecConfig("draft", 3))
    core = DraftService(load_model(str(tiny_draft_dir), quiet=True).model, num_slots=2, max_len=256)  # < 3: evicts

    async def answer(job):  # the handle call, awaited on the replica's event loop
        return core.propose(job)

    handle = SimpleNamespace(propose=SimpleNamespace(remote=answer))
    eng = Engine.from_pretrained(str(tiny_dir), max_num_seqs=4, max_model_len=256)  # no co-located draft
    with _event_loop_thread() as loop:
        eng.proposers["draft"] = RemoteDraftProposer(handle, "r1", loop)
        remote = eng.generate(PROMPTS, params, SpecConfig("draft", 3))
    assert [o.token_ids for o in remote] == [o.token_ids for o in colocated]
    assert sum(o.stats.accepted for o in remote) > 0


def test_remote_draft_call_times_out_and_is_cancelled():
    """A Drafter that does not answer raises TimeoutError in time (the guard turns it into
    k = 0) and the pending call is cancelled on the loop, not left running."""
    import time
    from types import SimpleNamespace

    from adaptspec.serve.drafter import RemoteDraftProposer

    cancelled = []

    async def never(job):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    seq = SimpleNamespace(request_id="a", token_ids=[1, 2, 3], params=None)
    with _event_loop_thread() as loop:
        prop = RemoteDraftProposer(SimpleNamespace(propose=SimpleNamespace(remote=never)), "r1", loop, timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="Drafter"):
            prop.propose([seq], [3])
        assert time.monotonic() - t0 < 5
        for _ in range(100):
            if cancelled:
                break
            time.sleep(0.01)
    assert cancelled == [True]


@contextlib.contextmanager
def _event_loop_thread():
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


class _Ctx:
    def __init__(self, metadata=()):
        self.code = self.details = None
        self.metadata = list(metadata)

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def test_health_check_answers_for_the_server_and_the_service_and_refuses_others():
    import grpc

    from adaptspec.proto import health_pb2
    from adaptspec.serve.ingress import SERVICE_NAME, Ingress

    class Host(Ingress):
        up = True

        def serving(self):
            return self.up

    host, ok = Host(), health_pb2.HealthCheckResponse
    for name in ("", SERVICE_NAME):
        assert asyncio.run(host.Check(health_pb2.HealthCheckRequest(service=name), _Ctx())).status == ok.SERVING
    ctx = _Ctx()
    asyncio.run(host.Check(health_pb2.HealthCheckRequest(service="other.Service"), ctx))
    assert ctx.code == grpc.StatusCode.NOT_FOUND and "other.Service" in ctx.details
    host.up = False  # the engine thread died
    assert asyncio.run(host.Check(health_pb2.HealthCheckRequest(), _Ctx())).status == ok.NOT_SERVING

    async def first_watch():
        stream = host.Watch(health_pb2.HealthCheckRequest(service="other.Service"), _Ctx())
        try:
            return await stream.__anext__()
        finally:
            await stream.aclose()

    assert asyncio.run(first_watch()).status == ok.SERVICE_UNKNOWN


def test_overhead_is_the_median_of_paired_differences():
    from types import SimpleNamespace

    from adaptspec.serve.loadtest import OverheadPair, measure_overhead, overhead_summary

    # service 1.0 s with 0.9 s in the replica's engine vs the engine alone in 0.95 s: 50 ms overhead,
    # 100 ms of it outside the replica's engine and -50 ms inside
    pairs = [OverheadPair(1.0, 0.9, 0.95, True), OverheadPair(2.0, 1.9, 1.95, True),
             OverheadPair(3.0, 2.9, 2.95, False)]
    s = overhead_summary(pairs, 8)
    assert s["overhead_p50_s"] == pytest.approx(0.05) and s["outside_engine_p50_s"] == pytest.approx(0.1)
    assert s["inside_engine_p50_s"] == pytest.approx(-0.05) and s["same_tokens"] == 2 and s["requests"] == 3
    assert s["service_e2e_p50_s"] == 2.0 and s["engine_e2e_p50_s"] == 1.95
    lo, hi = s["overhead_p50_ci95_s"]
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)  # every pair the same difference

    # the interval says whether a run settles the verdict: 200 noisy pairs around 5 ms put it
    # inside (0, 10 ms); 6 pairs of the same noise (negative control) cannot exclude 10 ms
    rng = np.random.default_rng(1)
    many = [OverheadPair(0.5 + d, 0.5, 0.5, True) for d in rng.normal(0.005, 0.02, 200)]
    lo, hi = overhead_summary(many, 8)["overhead_p50_ci95_s"]
    assert 0.0 < lo < 0.005 < hi < 0.01
    lo, hi = overhead_summary(many[:6], 8)["overhead_p50_ci95_s"]
    assert lo <= overhead_summary(many[:6], 8)["overhead_p50_s"] <= hi and hi - lo > 0.01 and hi > 0.01

    calls = []  # both paths get the same prompts, in alternating order
    client = SimpleNamespace(generate=lambda p, **kw: calls.append(("svc", p, kw["max_tokens"], kw["ignore_eos"]))
                             or SimpleNamespace(token_ids=[1, 2], timings=SimpleNamespace(e2e_s=0.0)))
    engine = SimpleNamespace(generate=lambda ps, params, spec: calls.append(
        ("eng", ps[0], params.max_new_tokens, params.ignore_eos)) or [SimpleNamespace(token_ids=[1, 2])])
    out = measure_overhead(client, engine, ["p", "q"], 8, reps=2, warmup=0)
    assert out["requests"] == 4 and out["same_tokens"] == 4
    assert [c[0] for c in calls] == ["svc", "eng", "eng", "svc", "eng", "svc", "svc", "eng"]
    assert {c[1:] for c in calls} == {("p", 8, True), ("q", 8, True)}


def test_bf16_on_a_cpu_without_the_kernel_warns(monkeypatch, caplog):
    from adaptspec.models import cpu_gemm
    from adaptspec.serve.engine_proc import warn_slow_bf16 as _warn_slow_bf16

    monkeypatch.setattr(cpu_gemm, "enabled", lambda: False)
    with caplog.at_level("WARNING", logger="adaptspec.serve.engine_proc"):
        _warn_slow_bf16(ServiceConfig.model_validate({"models": {"dtype": "bfloat16"}}))
        _warn_slow_bf16(ServiceConfig())  # the default, float32
        _warn_slow_bf16(ServiceConfig.model_validate({"models": {"dtype": "bfloat16", "device": "cuda"}}))
    assert len(caplog.records) == 1 and "models.dtype: float32" in caplog.records[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(cpu_gemm, "enabled", lambda: True)
    _warn_slow_bf16(ServiceConfig.model_validate({"models": {"dtype": "bfloat16"}}))
    assert not caplog.records


def test_streamed_text_with_a_stop_string_adds_up_to_the_final_text(engines):
    """A stop string that spans tokens: its beginning is held back while it could still
    match, so the deltas add up to the final (stop-cut) text, never repeating it."""
    from adaptspec import SamplingParams
    from adaptspec.engine.params import SamplingParams as SP
    from adaptspec.serve.loop import EngineLoop, _stop_prefix_len
    from adaptspec.serve.types import EngineRequest

    assert _stop_prefix_len("ab xy", ("xyz", "q")) == 2 and _stop_prefix_len("ab x", ("xyz",)) == 1
    assert _stop_prefix_len("ab", ("xyz",)) == 0 and _stop_prefix_len("abxyz", ("xyz",)) == 0  # whole: the engine's
    eng = engines()
    full = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].text  # varied words
    words = full.split(" ")
    assert len(words) >= 8, full
    # two tokens' worth that first occur after a few tokens: the first arrives a step before the match
    at = next(i for i in range(2, len(words) - 1) if full.find(" ".join(words[i:i + 2])) == len(" ".join(words[:i])) + 1)
    stop = " ".join(words[at:at + 2])
    loop_ = EngineLoop(engines(), max_queued=0)
    try:
        def req(rid, stream):
            return EngineRequest(rid, "chat", SP(max_new_tokens=12, ignore_eos=True, stop=[stop]),
                                 prompt_token_ids=PROMPTS[1], stream=stream)
        unary = _collect(loop_, req("u", False))
        streamed = _collect(loop_, req("s", True))
    finally:
        loop_.stop()
    final = unary[-1].text
    assert final and stop not in final and full.startswith(final) and unary[-1].finish_reason == "stop"
    assert "".join(c.text for c in streamed) == final and streamed[-1].finish_reason == "stop"


def test_ingress_closes_the_engine_stream_at_once_and_answers_unavailable_without_a_controller(monkeypatch):
    from types import SimpleNamespace

    import grpc

    from adaptspec.proto import adaptspec_pb2 as pb
    from adaptspec.serve.ingress import Ingress
    from adaptspec.serve.types import EngineChunk

    closed = []

    class Broken:
        def remote(self, *a):
            raise RuntimeError("actor died")

    class Host(Ingress):
        config = ServiceConfig.model_validate({"models": {"draft": None}})
        controller = SimpleNamespace(stats=Broken(), policy=Broken(), update_policy=Broken())

        async def engine_stream(self, req):
            try:
                for i in range(100):
                    yield EngineChunk(req.request_id, [i])
                    await asyncio.sleep(0)
            finally:
                closed.append(req.request_id)  # where the engine loop aborts the request

    async def cancel_mid_stream():
        stream = Host().GenerateStream(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=4), _Ctx())
        await stream.__anext__()
        await stream.aclose()  # what Serve does when the client cancels or its deadline passes
        return list(closed)

    assert len(asyncio.run(cancel_mid_stream())) == 1  # the engine's cleanup ran before aclose returned
    for call, req in ((Host().GetStats, pb.GetStatsRequest()), (Host().GetPolicy, pb.GetPolicyRequest()),
                      (Host().UpdatePolicy, pb.UpdatePolicyRequest(policy="ucb"))):
        monkeypatch.setenv("ADAPTSPEC_ADMIN_TOKEN", "t0ken")  # GetPolicy and UpdatePolicy are admin calls
        ctx = _Ctx([("authorization", "Bearer t0ken")])
        asyncio.run(call(req, ctx))
        assert ctx.code == grpc.StatusCode.UNAVAILABLE and "controller" in ctx.details


def test_a_step_that_never_returns_ends_the_engine(engines):
    """A hung step keeps the engine thread alive but serves nobody: past the stall timeout the
    callers get UNAVAILABLE and the replica stops counting as alive (health fails)."""
    import threading

    from adaptspec.serve.loop import EngineLoop

    eng = engines()
    release = threading.Event()
    real = eng.step

    def hung_step():
        release.wait(30)  # a device that does not answer
        return real()

    eng.step = hung_step
    loop_ = EngineLoop(eng, max_queued=2, stall_timeout_s=0.5)
    try:
        assert loop_.alive
        out = _collect(loop_, _req("a", PROMPTS[1], 4))
        alive = loop_.alive
        after = _collect(loop_, _req("b", PROMPTS[1], 4))
    finally:
        release.set()
        loop_.stop()
    assert out[-1].error.code == "UNAVAILABLE" and "stalled" in out[-1].error.message and not alive
    assert after[0].error.code == "UNAVAILABLE"


def test_a_request_posted_during_a_step_counts_that_wait_in_its_ttft(engines):
    """The loop hands requests to the engine between steps; the engine's TTFT (the replica's
    timings and TTFT metric) starts when the request was posted, so a request that came in
    during a long step counts the rest of it, as its client does. Control: the engine's own
    clock at the hand-over (the old TTFT) would miss that wait."""
    import threading

    from adaptspec.serve.loop import EngineLoop

    eng = engines()
    real, started, calls = eng.step, threading.Event(), []

    def slow_first_step():
        calls.append(1)
        if len(calls) == 1:
            started.set()
            time.sleep(0.6)  # a long step: a big batch, a slow device
        return real()

    eng.step = slow_first_step
    loop_ = EngineLoop(eng, max_queued=4)

    async def both():
        a = asyncio.ensure_future(_agen(loop_, _req("a", PROMPTS[0], 4)))
        while not started.is_set():
            await asyncio.sleep(0.005)
        posted = time.perf_counter()
        b = await _agen(loop_, _req("b", PROMPTS[1], 4))
        return await a, b, time.perf_counter() - posted

    try:
        a, b, client_s = asyncio.run(both())
    finally:
        loop_.stop()
    assert a[-1].finished and b[-1].finished
    ttft = b[-1].ttft_s
    assert 0.5 < ttft <= client_s  # the rest of the 0.6 s step, and no more than the caller saw


async def _agen(loop_, req):
    return [c async for c in loop_.generate(req)]


def test_loadtest_in_process_drives_the_engine_and_the_controller(tiny_dir, tiny_draft_dir, tmp_path):
    """``adaptspec loadtest --in-process``: the replica's engine and the controller in one
    process (no Ray, no gRPC), closed-loop per policy, the controller's step-time check."""
    import json

    import yaml
    from typer.testing import CliRunner

    from adaptspec.cli import app

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": {"target": str(tiny_dir), "draft": str(tiny_draft_dir)},
        "controller": {"report_interval_s": 0.05, "max_k": 4},
        "engine": {"max_num_seqs": 4, "max_model_len": 512, "torch_threads": 1}}))
    out = tmp_path / "r.json"
    common = ["loadtest", "--in-process", "--config", str(cfg), "--max-tokens", "8"]
    res = CliRunner().invoke(app, common + ["--concurrency", "3", "--duration", "1.0", "--warmup", "0.3",
                                            "--policies", "thompson,static:none:0", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["in_process"] and [(x["policy"], x["concurrency"]) for x in data["levels"]] == [
        ("thompson", 3), ("static:none:0", 3)]
    for lv in data["levels"]:
        assert lv["requests"] > 0 and lv["errors"] == 0 and lv["throughput_tokens_per_s"] > 0
        assert lv["decode_tokens_per_s"] > 0
        assert set(lv["arms"]) <= {"chat", "code_edit", "extraction"}
    static = data["levels"][1]["arms"]
    assert {a for per in static.values() for a in per} == {"none:0"}  # the policy switch took effect
    rows = data["cost_check"]["thompson"]  # the model-based policy's predictions, checked against the steps
    assert rows and all(r["steps"] > 0 and r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in rows)
    assert data["levels"][0]["cost_check"] and not data["levels"][1]["cost_check"]  # per level, thompson's only
    assert "static:none:0" not in data["cost_check"]  # a static policy predicts nothing
    bad = CliRunner().invoke(app, common + ["--start"])
    assert bad.exit_code == 2 and "--in-process" in bad.output and "--start" in bad.output


def test_the_controller_lowers_every_thread_of_its_process():
    """controller.niceness reaches every thread (Linux sets niceness per thread), in a child
    process so the test's own priority is untouched."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_nice_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    want = got["want"]  # a few steps below where the child started (it inherits the test's niceness)
    assert got["returned"] == want
    assert got["threads"] and all(n == want for n in got["threads"].values()), got
    assert got["later_thread"] == want  # a thread started afterwards inherits it
    assert got["unchanged"] is None  # 0: leave the priority alone


def _nice_child(q) -> None:
    import os
    import threading
    import time

    from adaptspec.serve.controller import lower_priority

    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()  # a thread that exists before the call
    time.sleep(0.05)
    unchanged = lower_priority(0)
    want = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    returned = lower_priority(want)
    later = {}
    t2 = threading.Thread(target=lambda: later.setdefault("n", os.getpriority(os.PRIO_PROCESS, 0)))
    t2.start()
    t2.join()
    threads = {int(x): os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir("/proc/self/task")}
    stop.set()
    q.put({"returned": returned, "threads": threads, "later_thread": later["n"], "want": want, "unchanged": unchanged})


def test_controller_core_counts_the_policys_cpu_and_stats_carry_it():
    """``policy_cpu_s`` is the CPU time spent inside the policy's calls (here an observe that burns
    a known 30 ms of this thread's CPU); the process's CPU is reported only by a controller that
    has its process to itself; the cost check sums the model-based policy's predicted and measured
    step times apart for steps with drafted rows and plain ones."""
    import time

    from adaptspec.control import StepOutcome
    from adaptspec.control.types import RequestOutcome
    from adaptspec.serve.controller import ControlCore, PolicyUpdate
    from adaptspec.serve.convert import to_stats
    from adaptspec.serve.types import ClassDelta, ReplicaReport, ReplicaState

    cfg = ServiceConfig.model_validate({"models": {"draft": None}, "classes": [{"name": "chat"}]})
    shared, own = ControlCore(cfg), ControlCore(cfg, own_process=True)
    out = StepOutcome.from_requests([RequestOutcome("r", "chat", "ngram", 2, 1, 2)], batch_size=1, num_prefill=0,
                                    verify_tokens=3, context_tokens=10, draft_s=0.001, verify_s=0.01,
                                    other_s=0.001, wall_s=0.012)
    observe = shared.policy.observe

    def burning(outcome):
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.03:
            pass
        observe(outcome)

    shared.policy.observe = burning
    rep = ReplicaReport(ReplicaState("r1", batch_size=1), [out],
                        [ClassDelta("chat", requests=1, drafted=2, accepted=1, emitted=2, steps=1)], 0.25)
    before = shared.stats().policy_cpu_s  # the first choice of arms, at start
    shared.report(rep)
    st = shared.stats()
    assert 0.03 <= st.policy_cpu_s - before < 1.0 and st.process_cpu_s is None
    pb = to_stats(st)
    assert pb.policy_cpu_s == st.policy_cpu_s and not pb.HasField("controller_cpu_s")
    own.report(rep)
    st = own.stats()
    assert st.process_cpu_s >= st.policy_cpu_s > 0.0  # the process's CPU since it started holds the policy's
    assert to_stats(st).controller_cpu_s == st.process_cpu_s
    # the model-based policy's cost model against the step, predicted before it learned from it
    (row,) = to_stats(st).cost_check
    assert (row.verify_tokens_from, row.verify_tokens_to, row.drafted, row.steps) == (0, 7, True, 1)
    assert row.measured_s == pytest.approx(0.012) and row.predicted_s > 0
    plain = StepOutcome.from_requests([RequestOutcome("r", "chat", "none", 0, 0, 1)], batch_size=1, num_prefill=0,
                                      verify_tokens=1, context_tokens=10, draft_s=0.0, verify_s=0.01,
                                      other_s=0.001, wall_s=0.011)
    own.report(ReplicaReport(ReplicaState("r1", batch_size=1), [plain], [], 0.25))
    assert [(r["drafted"], r["steps"]) for r in own.stats().cost_check.table()] == [(False, 1), (True, 1)]
    own.update(PolicyUpdate(policy="static:none:0"))  # a static policy predicts nothing
    own.report(rep)
    assert own.stats().cost_check is None and not to_stats(own.stats()).cost_check


def test_stats_table_shows_the_controllers_cpu_and_cost_check():
    from rich.console import Console

    from adaptspec.proto import adaptspec_pb2 as pb
    from adaptspec.serve.cli import stats_table

    st = pb.GetStatsResponse(policy="thompson", uptime_s=100.0, policy_cpu_s=1.5, controller_cpu_s=4.0, cost_check=[
        pb.CostCheckRow(verify_tokens_from=0, verify_tokens_to=7, drafted=False, steps=10, predicted_s=0.9,
                        measured_s=1.0),
        pb.CostCheckRow(verify_tokens_from=8, verify_tokens_to=15, drafted=True, steps=5, predicted_s=0.4,
                        measured_s=0.5)])
    con = Console(record=True, width=200)
    con.print(stats_table(st))
    text = " ".join(con.export_text().split())  # the caption wraps at the table's width
    assert "controller: 4.0 CPU s since start (4.0% of a core), 1.5 of them in the policy" in text
    assert "plain steps 0.900 (10), steps with drafted rows 0.800 (5)" in text
    bare = Console(record=True, width=200)
    bare.print(stats_table(pb.GetStatsResponse(policy="static:none:0", uptime_s=1.0)))
    assert "controller:" not in bare.export_text() and "predicted" not in bare.export_text()
