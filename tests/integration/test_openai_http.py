"""The OpenAI-compatible HTTP API end to end: real local Ray, Serve's HTTP and gRPC proxies on
loopback, the official ``openai`` client and plain ``httpx``, a tiny model with a chat template.

One Serve application for the module (API keys from a key file, so every call carries one);
the last test kills its engine. The greedy outputs are checked against the gRPC path of the
same deployment, token for token.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from adaptspec.serve.client import Client  # noqa: E402
from adaptspec.serve.config import ServiceConfig  # noqa: E402
from tests.conftest import first_fresh_word  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 9327, 8327
MAX_NUM_SEQS, MAX_QUEUED = 4, 2
LONG = 8000  # tokens: seconds of plain decoding on the tiny model, far past any disconnect
KEYS_ENV = "ADAPTSPEC_TEST_HTTP_KEYS"
KEY_A, KEY_B = "sk-test-a", "sk-test-b"
MODEL = "tiny"
# word-level tokens t0..t15: every role marker and the assistant's opening are tokens themselves
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}t1 {% elif m['role'] == 'user' %}t2 "
            "{% else %}t3 {% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t4{% endif %}")


def _chat_model(src, dst):
    """The tiny target with a chat template, and rotary positions for long requests (its
    weights do not depend on them)."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (dst / "config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dst)
    return dst


def _config(target, **over) -> ServiceConfig:
    base = {"models": {"target": str(target), "draft": None}, "grpc_port": GRPC_PORT, "http_port": HTTP_PORT,
            "target": {"num_cpus": 0},
            "controller": {"report_interval_s": 0.1, "max_k": 4},
            "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_model_len": 8192, "max_queued": MAX_QUEUED,
                       "torch_threads": 1},
            "max_tokens_limit": LONG,
            "classes": [{"name": "chat"}, {"name": "code_edit"}, {"name": "plain", "pin": {"drafter": "none", "k": 0}},
                        {"name": "default"}],
            "http": {"api_keys_env": KEYS_ENV, "default_class": "chat", "model_name": MODEL}}
    base.update(over)
    return ServiceConfig.model_validate(base)


@pytest.fixture(scope="module")
def service(tiny_dir, tmp_path_factory):
    from adaptspec.serve import app

    root = tmp_path_factory.mktemp("openai_http")
    model = _chat_model(tiny_dir, root / "tiny_chat")
    key_file = root / "api-keys"
    key_file.write_text(f"{KEY_A}\n{KEY_B}\n")
    # the replicas read the variable: it must be in the environment Ray starts them with
    os.environ[KEYS_ENV] = str(key_file)
    cfg = _config(model)
    before = _engine_pids()
    app.start(cfg, num_cpus=4)
    engine_pids = _engine_pids() - before
    assert len(engine_pids) == 1, engine_pids
    client = Client(f"127.0.0.1:{GRPC_PORT}", api_key=KEY_A)  # the same keys guard gRPC
    base = f"http://127.0.0.1:{HTTP_PORT}/{cfg.app_name}"
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0, timeout=60)
    http = httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY_A}"}, timeout=60)
    yield {"cfg": cfg, "grpc": client, "oai": oai, "http": http, "base": base, "keys": key_file, "model": model,
           "engine_pid": engine_pids.pop()}
    http.close()
    oai.close()
    client.close()
    app.stop()
    os.environ.pop(KEYS_ENV, None)


def _engine_pids() -> set[int]:
    """Engine processes of this module's Ray cluster (descendants of this process) only."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "adaptspec.serve.engine_proc" in p.cmdline():
                out.add(p.pid)
    return out


def _wait_for(fn, what: str, limit_s: float = 60.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        out = fn()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _idle(client: Client):
    st = client.stats()
    reps = st.replicas
    return bool(reps) and all(r.in_flight == 0 and r.free_slots == MAX_NUM_SEQS for r in reps) and st


def _wait_idle(client: Client, what: str):
    """The first stats showing the replica idle; on a timeout the message shows its last state."""
    last = []

    def idle():
        st = _idle(client)
        last[:] = [client.stats().replicas] if not st else []
        return st
    try:
        return _wait_for(idle, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last replica state: {last}") from None


def _finished(st, cls: str) -> int:
    return next(c.requests for c in st.classes if c.request_class == cls)


def _sse(lines) -> list[dict]:
    """The JSON events of an SSE body, checking it ends with [DONE]."""
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_models_and_health(service):
    assert [m.id for m in service["oai"].models.list()] == [MODEL]
    assert service["oai"].models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{service['base']}/health", timeout=30)  # no key: probes have none
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_chat_equals_grpc_greedy_streamed_and_not(service):
    """One user message: the HTTP server applies the template the engine applies for gRPC."""
    oai, client = service["oai"], service["grpc"]
    want = client.generate("t3 t5 t7", max_tokens=12, timeout=60)
    msgs = [{"role": "user", "content": "t3 t5 t7"}]
    got = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12,
                                      extra_body={"return_token_ids": True})
    ch = got.choices[0]
    assert ch.message.content == want.text and ch.model_extra["token_ids"] == list(want.token_ids)
    assert ch.finish_reason == "length" and got.object == "chat.completion" and got.model == MODEL
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (5, 12, 17)
    ext = got.model_extra["adaptspec"]
    assert ext["request_class"] == "chat" and ext["steps"] >= 1 and sum(ext["arms"].values()) == ext["steps"]
    assert 0 <= ext["accepted"] <= ext["drafted"]

    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == list(want.token_ids)
    done = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(done) == 1 and done[0].choices[0].finish_reason == "length" and done[0].model_extra["adaptspec"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_template_with_a_system_message(service):
    """System + user messages render as the template says; the engine gets that text as is."""
    want = service["grpc"].generate("t1 t9 t2 t3 t5 t4", raw=True, max_tokens=10, timeout=60)
    got = service["oai"].chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=10,
        messages=[{"role": "system", "content": "t9"}, {"role": "user", "content": [{"type": "text", "text": "t3 t5"}]}])
    assert got.choices[0].message.content == want.text and got.usage.prompt_tokens == 6


def test_completion_equals_grpc_text_and_token_ids(service):
    oai, client, http = service["oai"], service["grpc"], service["http"]
    want = client.generate("t2 t4 t6", raw=True, max_tokens=9, timeout=60)
    got = oai.completions.create(model=MODEL, prompt="t2 t4 t6", temperature=0, max_tokens=9)
    assert got.choices[0].text == want.text and got.object == "text_completion"
    ids = client.generate(prompt_token_ids=[2, 4, 6, 8], max_tokens=9, timeout=60)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [2, 4, 6, 8], "temperature": 0, "max_tokens": 9,
                                           "stream": True, "return_token_ids": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text.splitlines())
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == list(ids.token_ids)
    assert "".join(e["choices"][0]["text"] for e in events) == ids.text
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "adaptspec" in events[-1]


def test_stop_strings_streamed_and_not(service):
    oai = service["oai"]
    msgs = [{"role": "user", "content": "t14 t3"}]  # a greedy output that does not repeat one word
    full = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30).choices[0].message.content
    words = full.split(" ")
    i = first_fresh_word(full, 3)
    stop = words[i]
    cut = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30, stop=[stop, "t99"])
    assert cut.choices[0].message.content == " ".join(words[:i]) + " " and cut.choices[0].finish_reason == "stop"
    streamed = list(oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30, stop=stop,
                                                stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_and_class_comes_from_header_metadata_or_default(service):
    oai = service["oai"]

    def sample(seed, **kw):
        r = oai.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=20, temperature=1.0, seed=seed, **kw)
        return r.choices[0].text, r.model_extra["adaptspec"]["request_class"]

    # the class "plain" is pinned to no speculation: a seed reproduces tokens under one arm
    a, cls = sample(7, extra_headers={"x-adaptspec-class": "plain"})
    assert cls == "plain"
    assert sample(7, extra_headers={"x-adaptspec-class": "plain"})[0] == a
    assert sample(8, extra_headers={"x-adaptspec-class": "plain"})[0] != a  # the control: the seed matters
    assert sample(7, extra_body={"metadata": {"request_class": "plain"}}) == (a, "plain")
    # the header wins over metadata; nothing named: http.default_class; unknown: "default"
    assert sample(1, extra_headers={"x-adaptspec-class": "code_edit"},
                  extra_body={"metadata": {"request_class": "plain"}})[1] == "code_edit"
    assert sample(1)[1] == "chat"
    assert sample(1, extra_headers={"x-adaptspec-class": "poetry"})[1] == "default"


def _chat(**over):
    return {"model": MODEL, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 4, **over}


def _cmpl(**over):
    return {"model": MODEL, "prompt": "t1 t2", "max_tokens": 4, **over}


@pytest.mark.parametrize("route, body, param", [
    ("chat", _chat(n=2), "n"),
    ("chat", _chat(logprobs=True), "logprobs"),
    ("chat", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("chat", _chat(presence_penalty=0.5), "presence_penalty"),
    ("chat", _chat(response_format={"type": "json_object"}), "response_format"),
    ("chat", _chat(frobnicate=1), "frobnicate"),
    ("chat", _chat(temperature=2.5), "temperature"),
    ("chat", _chat(top_p=0), "top_p"),
    ("chat", _chat(max_tokens=0), "max_tokens"),
    ("chat", _chat(max_tokens=LONG + 1), "max_tokens"),
    ("chat", _chat(max_tokens=4, max_completion_tokens=5), "max_completion_tokens"),
    ("chat", _chat(stop=["t1", ""]), "stop"),
    ("chat", _chat(messages=[]), "messages"),
    ("chat", _chat(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    ("chat", _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content"),
    ("chat", _chat(stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
    ("cmpl", _cmpl(prompt=["t1", "t2"]), "prompt"),
    ("cmpl", _cmpl(prompt=""), "prompt"),
    ("cmpl", _cmpl(prompt=[1, 99]), "prompt"),  # outside the vocabulary (16): the engine refuses it
    ("cmpl", _cmpl(echo=True), "echo"),
    ("cmpl", _cmpl(best_of=3), "best_of"),
    ("cmpl", _cmpl(max_tokens=LONG, prompt=[1] * 200), "max_tokens"),  # past the context: the engine refuses it
])
def test_bad_input_is_400_naming_the_field(service, route, body, param):
    path = {"chat": "/v1/chat/completions", "cmpl": "/v1/completions"}[route]
    for stream in (False, True):
        r = service["http"].post(path, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param or (err["param"] or "").startswith(param), err
        assert param.split(".")[0] in err["message"]


def test_bad_input_through_the_official_client(service):
    with pytest.raises(openai.BadRequestError) as exc:
        service["oai"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t1"}], n=3)
    assert exc.value.param == "n" and exc.value.code == "unsupported_parameter"
    r = service["http"].post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(service):
    with pytest.raises(openai.NotFoundError) as exc:
        service["oai"].completions.create(model="gpt-4o", prompt="t1", max_tokens=2)
    assert exc.value.code == "model_not_found" and exc.value.param == "model"


def test_api_keys_missing_wrong_and_rotated(service):
    base, keys = service["base"], service["keys"]
    r = httpx.post(f"{base}/v1/completions", json=_cmpl(), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.PermissionDeniedError) as exc:
        wrong.completions.create(model=MODEL, prompt="t1", max_tokens=2)
    assert exc.value.code == "invalid_api_key" and "sk-wrong" not in str(exc.value)
    second = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_B, max_retries=0, timeout=30)
    assert second.completions.create(model=MODEL, prompt="t1", max_tokens=2).choices[0].text
    # a Kubernetes Secret volume is updated in place: the replica re-reads the changed file
    try:
        keys.write_text("sk-rotated\n")
        with pytest.raises(openai.PermissionDeniedError):
            second.completions.create(model=MODEL, prompt="t1", max_tokens=2)
        rotated = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-rotated", max_retries=0, timeout=30)
        assert rotated.completions.create(model=MODEL, prompt="t1", max_tokens=2).choices[0].text
    finally:
        keys.write_text(f"{KEY_A}\n{KEY_B}\n")


def _hold(client: Client):
    """A long unary gRPC call (a future, so it can be cancelled) in the class pinned to plain
    decoding. Unary: the replica does no work per token for it, however long it runs."""
    from adaptspec.serve.client import request

    return client.stub.Generate.future(request(prompt_token_ids=[1, 2, 3], max_tokens=LONG, ignore_eos=True,
                                               request_class="plain"), metadata=client.data_metadata, timeout=120)


def _in_flight_by_controller(cfg: ServiceConfig):
    """Calls the replicas hold, as they report them to the Controller, asked over a Serve handle
    of its own: a stats call through the proxy would wait in its queue behind a full replica."""
    from ray import serve

    controller = serve.get_deployment_handle("Controller", app_name=cfg.app_name)
    return lambda: sum(r.in_flight for r in controller.stats.remote().result(timeout_s=10).replicas)


def _ended(held) -> list[str]:
    """How each holding call that already ended ended (none may: each runs for seconds)."""
    out = []
    for f in held:
        if f.done():
            exc = f.exception()
            out.append("finished" if exc is None else f"{exc.code().name}: {exc.details()}")
    return out


def test_usage_reports_cached_prompt_tokens_as_openai_does(service):
    """``usage.prompt_tokens_details.cached_tokens``: the second of two requests with the same
    40-token prompt is served two full blocks (16 positions each) from the prefix cache; the
    first none."""
    oai = service["oai"]
    prompt = " ".join(f"t{(j * 7 + j // 4) % 16}" for j in range(40))
    got = [oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0) for _ in range(2)]
    assert [g.usage.prompt_tokens for g in got] == [40, 40]
    assert [g.usage.prompt_tokens_details.cached_tokens for g in got] == [0, 32]


def test_full_queue_is_429(service):
    """Serve sends a replica no more calls than its engine holds (KV slots + queue); with the
    replica full, the proxy holds ``max_queued_requests`` (default: engine.max_queued) calls
    and refuses the rest: over HTTP with 429 and Retry-After (Serve's plain-text body; a
    refusal by the engine itself carries OpenAI's JSON error). gRPC and HTTP share that queue."""
    client, http = service["grpc"], service["http"]
    _wait_idle(client, "an idle replica")
    in_flight = _in_flight_by_controller(service["cfg"])
    # Every place is held by a call that stays (no probe that may take a place and leave it),
    # sent one at a time and seen on the replica before the next: Serve's router counts a call
    # as queued until it is assigned, so a burst can be refused with places still open.
    held = []
    try:
        for n in range(1, MAX_NUM_SEQS + MAX_QUEUED + 1):
            held.append(_hold(client))
            _wait_for(lambda: _ended(held) or in_flight() == n, f"hold call {n} to reach the replica")
            assert not _ended(held), f"a holding call ended or was refused: {_ended(held)}"
        held += [_hold(client) for _ in range(MAX_QUEUED)]  # the proxy's queue: nothing else is pending
        time.sleep(1.0)  # they reach the proxy's queue; none may be refused or end
        assert not _ended(held), f"a holding call ended or was refused: {_ended(held)}"
        assert in_flight() == MAX_NUM_SEQS + MAX_QUEUED, "a queued call reached the full replica"
        # the queue is full: refusals come at once (a request that waits found a place open)
        r = http.post("/v1/completions", json=_cmpl(), timeout=20)
        assert r.status_code == 429, (r.status_code, r.text)
        assert r.headers["retry-after"] == "1"
        r = http.post("/v1/chat/completions", json=_chat(stream=True), timeout=30)
        assert r.status_code == 429
        with pytest.raises(openai.RateLimitError):
            service["oai"].chat.completions.create(**_chat())
    finally:
        for f in held:
            f.cancel()
    _wait_idle(client, "the cancelled requests to free their slots")


def test_client_disconnect_mid_stream_aborts_and_frees_the_slot(service):
    """The request would run for seconds; the client reads three events and hangs up. The
    engine aborts it: the replica is idle again and the request never finished (the class's
    count of finished requests, reported with the same state, does not move; had the request
    not been aborted, the replica would be idle only once it had finished)."""
    client = service["grpc"]
    st0 = _wait_idle(client, "an idle replica")
    steps0, before = st0.replicas[0].steps, _finished(st0, "plain")
    body = _chat(max_tokens=LONG, ignore_eos=True, stream=True, temperature=0)
    with httpx.Client(base_url=service["base"], headers={"authorization": f"Bearer {KEY_A}",
                                                         "x-adaptspec-class": "plain"}, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            got = []
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    got.append(json.loads(ln[len("data: "):]))
                if len(got) >= 3:
                    break
            assert got[-1]["choices"][0]["finish_reason"] is None  # mid-stream
    # leaving both blocks closed the response and the connection mid-stream. The state to check
    # is one reported after the request ran (the replica's step count moved on), and idle
    st = _wait_for(lambda: (x := _idle(client)) and x.replicas[0].steps > steps0 and x,
                   "the abandoned request to free its slot")
    assert _finished(st, "plain") == before, "the request ran to its end instead of being aborted"


@pytest.mark.slow
def test_smollm_chat_over_http_equals_grpc(service, smollm_dir):
    """SmolLM2's own chat template: the same greedy text through the openai client and gRPC."""
    from ray import serve

    from adaptspec.serve import app

    cfg = ServiceConfig.model_validate({
        "app_name": "smollm", "grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "target": {"num_cpus": 0},
        "models": {"dtype": "float32"}, "engine": {"max_num_seqs": 2, "max_model_len": 1024, "torch_threads": 1},
        "controller": {"report_interval_s": 0.1}, "http": {"api_keys_env": KEYS_ENV}})
    serve.run(app.build_app(cfg), name="smollm", route_prefix="/smollm")
    client = Client(f"127.0.0.1:{GRPC_PORT}", app_name="smollm", api_key=KEY_A)
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/smollm/v1", api_key=KEY_A, max_retries=0,
                        timeout=120)
    try:
        prompt = "Name three prime numbers."
        want = client.generate(prompt, max_tokens=16, request_class="chat", timeout=120)
        got = oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=16, extra_body={"return_token_ids": True})
        assert got.choices[0].message.content == want.text
        assert got.choices[0].model_extra["token_ids"] == list(want.token_ids)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    finally:
        oai.close()
        client.close()
        serve.delete("smollm")


def test_loadtest_command_over_http(service, tmp_path):
    """``adaptspec loadtest --protocol http``: the load through the HTTP API, every request
    answered; the policy switch still goes through gRPC; ``--http-overhead``: paired requests."""
    from typer.testing import CliRunner

    from adaptspec.cli import app

    client = service["grpc"]
    _wait_idle(client, "an idle replica")
    out = tmp_path / "lt.json"
    res = CliRunner().invoke(app, ["loadtest", "--address", client.address, "--protocol", "http", "--http-url",
                                   f"http://127.0.0.1:{HTTP_PORT}", "--api-key", KEY_A, "--concurrency", "2",
                                   "--duration", "1.0", "--warmup", "0.5", "--max-tokens", "8",
                                   "--classes", "chat,plain", "--policies", "static:none:0", "--http-overhead", "4",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    (level,) = data["levels"]
    assert level["requests"] > 0 and level["errors"] == 0 and level["ttft_p50_s"] > 0
    assert set(level["arms"]) <= {"chat", "plain"} and all(set(a) == {"none:0"} for a in level["arms"].values())
    # the paired comparison: greedy on one arm, so each prompt streams as many tokens both ways
    pairs = data["overhead"]["http_vs_grpc"]
    assert pairs["requests"] == 4 and pairs["errors"] == 0 and pairs["same_tokens"] == 4
    assert pairs["grpc_e2e_p50_s"] > 0 and pairs["http_e2e_p50_s"] > 0


def test_engine_gone_is_503(service):
    """Kill the replica's engine process: requests and /health answer 503 in OpenAI's shape
    until Serve replaces the replica. Last in the module: it takes the app's engine away."""
    import psutil

    psutil.Process(service["engine_pid"]).kill()
    h = {"authorization": f"Bearer {KEY_A}"}

    def refused():
        r = httpx.post(f"{service['base']}/v1/completions", json=_cmpl(), headers=h, timeout=30)
        return r.status_code == 503 and r
    r = _wait_for(refused, "a 503")
    assert r.json()["error"]["type"] == "service_unavailable_error" and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "engine_unavailable"
    health = httpx.get(f"{service['base']}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
