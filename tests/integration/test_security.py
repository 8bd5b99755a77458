"""The security rules over real gRPC: real local Ray, Serve's gRPC proxy on loopback, tiny models.

Two applications share the proxy: ``open`` (the defaults: clients may choose arms) and
``locked`` (``allow_client_speculation: false``, tight request limits, API keys from
``$ADAPTSPEC_TEST_KEYS``). The admin token is the one the operator gives in
``ADAPTSPEC_ADMIN_TOKEN`` (set before Ray starts, as a Kubernetes Secret sets it on every Ray
container).
"""
from __future__ import annotations

import os
import secrets
import stat

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

from adaptspec.proto import adaptspec_pb2 as pb  # noqa: E402
from adaptspec.serve.client import Client  # noqa: E402
from adaptspec.serve.config import ServiceConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 9517, 8517
TOKEN = "adm-" + secrets.token_urlsafe(24)
WRONG = "adm-" + secrets.token_urlsafe(24)
KEYS_ENV = "ADAPTSPEC_TEST_KEYS"
API_KEY = "key-" + secrets.token_urlsafe(24)


def _config(target, draft, **over) -> ServiceConfig:
    base = {"models": {"target": str(target), "draft": str(draft)}, "grpc_port": GRPC_PORT, "http_port": HTTP_PORT,
            "target": {"num_cpus": 0}, "controller": {"report_interval_s": 0.2, "max_k": 4, "cost_profile": None},
            "engine": {"max_num_seqs": 4, "max_model_len": 512, "max_queued": 4, "torch_threads": 1},
            "max_tokens_limit": 64, "default_max_tokens": 16}
    base.update(over)
    return ServiceConfig.model_validate(base)


@pytest.fixture(scope="module")
def service(tiny_dir, tiny_draft_dir):
    import ray
    from ray import serve

    from adaptspec.serve import app

    if ray.is_initialized():  # the token must reach the Ray processes this module starts
        app.stop()
    saved = os.environ.get("ADAPTSPEC_ADMIN_TOKEN")
    os.environ["ADAPTSPEC_ADMIN_TOKEN"] = TOKEN
    os.environ[KEYS_ENV] = f"other-key,{API_KEY}"
    try:
        app.start(_config(tiny_dir, tiny_draft_dir, app_name="open"), num_cpus=4)
        locked = _config(tiny_dir, tiny_draft_dir, app_name="locked", allow_client_speculation=False,
                         max_stop_strings=2, max_stop_chars=8, max_prompt_bytes=64,
                         http={"api_keys_env": KEYS_ENV})
        serve.run(app.build_app(locked), name="locked", route_prefix="/locked")
        yield
    finally:
        app.stop()
        os.environ.pop(KEYS_ENV, None)
        if saved is None:
            os.environ.pop("ADAPTSPEC_ADMIN_TOKEN", None)
        else:
            os.environ["ADAPTSPEC_ADMIN_TOKEN"] = saved


def _client(app_name="open", token=None, api_key=None) -> Client:
    if api_key is None:
        api_key = API_KEY if app_name == "locked" else ""
    return Client(f"127.0.0.1:{GRPC_PORT}", app_name, token=token, api_key=api_key)


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("call", ["policy", "update_policy"])
def test_admin_calls_need_the_admin_token(service, call):
    def do(c):
        return c.policy() if call == "policy" else c.update_policy("ucb")

    with _client(token="") as c:  # "": send no token
        code, details = _code(lambda: do(c))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details
    with _client(token=WRONG) as c:
        code, details = _code(lambda: do(c))
        assert code == grpc.StatusCode.PERMISSION_DENIED and WRONG not in details and TOKEN not in details
    with _client(token=TOKEN) as c:  # negative control: the right token passes
        assert do(c).policy in ("thompson", "ucb")
        c.update_policy("thompson")


def test_malformed_authorization_is_unauthenticated(service):
    from adaptspec.proto import adaptspec_pb2_grpc as pb_grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}")
    try:
        stub = pb_grpc.AdaptSpecStub(ch)
        for value in (f"Basic {TOKEN}", TOKEN, "Bearer"):
            code, _ = _code(lambda: stub.GetPolicy(pb.GetPolicyRequest(), timeout=30, metadata=(
                ("application", "open"), ("authorization", value))))
            assert code == grpc.StatusCode.UNAUTHENTICATED, value
    finally:
        ch.close()


def test_generate_and_stats_need_no_token(service):
    with _client(token="") as c:
        assert c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, timeout=60).token_ids
        assert c.stats().policy


@pytest.mark.parametrize("call", ["generate", "stream", "stats"])
def test_data_calls_need_an_api_key_where_keys_are_configured(service, call):
    def do(c):
        if call == "generate":
            return c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, timeout=60).token_ids
        if call == "stream":
            return [t for ch in c.stream(prompt_token_ids=[1, 2, 3], max_tokens=4, timeout=60) for t in ch.token_ids]
        return c.stats().policy

    with _client("locked", api_key="") as c:
        code, details = _code(lambda: do(c))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details
        assert c.health().status == c.health().SERVING  # probes need no key
    with _client("locked", api_key=WRONG) as c:
        code, details = _code(lambda: do(c))
        assert code == grpc.StatusCode.PERMISSION_DENIED and API_KEY not in details and WRONG not in details
    with _client("locked") as c:  # negative control: the right key (the second of two) passes
        assert do(c)


def test_cli_policy_reads_the_token_file(service, tmp_path):
    from typer.testing import CliRunner

    from adaptspec.cli import app

    good, bad = tmp_path / "good", tmp_path / "bad"
    for path, value in ((good, TOKEN), (bad, WRONG)):
        path.write_text(value + "\n")
        path.chmod(0o600)
    args = ["policy", "--address", f"127.0.0.1:{GRPC_PORT}", "--app", "open"]
    ok = CliRunner().invoke(app, args + ["--token-file", str(good), "--pin", "chat=ngram:2"])
    assert ok.exit_code == 0, ok.output
    assert "chat" in ok.output and "ngram:2" in ok.output and "pinned" in ok.output
    denied = CliRunner().invoke(app, args + ["--token-file", str(bad), "--unpin", "chat"])
    assert denied.exit_code == 2 and "PERMISSION_DENIED" in denied.output and WRONG not in denied.output
    bad.chmod(0o644)  # a token file others can read is refused before anything is sent
    loose = CliRunner().invoke(app, args + ["--token-file", str(bad)])
    assert loose.exit_code == 2 and "chmod 600" in loose.output
    again = CliRunner().invoke(app, args + ["--token-file", str(good), "--unpin", "chat"])
    assert again.exit_code == 0, again.output


def test_default_cli_token_comes_from_the_environment(service, monkeypatch):
    from typer.testing import CliRunner

    from adaptspec.cli import app

    monkeypatch.setenv("ADAPTSPEC_ADMIN_TOKEN", TOKEN)
    res = CliRunner().invoke(app, ["policy", "--address", f"127.0.0.1:{GRPC_PORT}", "--app", "open", "--json"])
    assert res.exit_code == 0 and '"policy"' in res.output, res.output


def test_client_speculation_only_where_allowed(service):
    with _client("locked") as c:
        for call in (c.generate, lambda **f: list(c.stream(**f))):
            code, details = _code(lambda: call(prompt_token_ids=[1, 2], max_tokens=4, speculation=("ngram", 4),
                                               timeout=30))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "speculation" in details
        assert c.generate(prompt_token_ids=[1, 2], max_tokens=4, timeout=60).token_ids  # without: served
    with _client("open") as c:  # negative control: the open app runs the client's arm
        r = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=8, speculation=("ngram", 2), timeout=60)
        assert {a.arm for a in r.speculation.arms} <= {"ngram:2", "ngram:1", "none:0"}


@pytest.mark.parametrize("fields, field", [
    (dict(prompt_token_ids=[1, 2], stop=["t1", "t2", "t3"]), "stop"),
    (dict(prompt_token_ids=[1, 2], stop=["t1", "t2 t3 t4 t5"]), "stop[1]"),
    (dict(prompt="t1 " * 30), "prompt"),
    (dict(prompt_token_ids=[1] * 600), "prompt_token_ids"),
])
def test_request_limits_are_invalid_argument(service, fields, field):
    with _client("locked") as c:
        for call in (c.generate, lambda **f: list(c.stream(**f))):
            code, details = _code(lambda: call(max_tokens=4, timeout=30, raw=True, **fields))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details


def test_the_token_is_never_logged(service):
    """After right, wrong and malformed tokens went through every layer, no Ray log holds them."""
    import ray

    with _client(token=TOKEN) as c:
        c.policy()
    with _client(token=WRONG) as c:
        _code(lambda: c.update_policy("ucb"))
    session = ray._private.worker._global_node.get_session_dir_path()
    hits, searched = [], False
    for root, _, files in os.walk(session):
        for name in files:
            path = os.path.join(root, name)
            try:
                if stat.S_ISREG(os.stat(path).st_mode) and os.path.getsize(path) < 200 * 1024**2:
                    data = open(path, "rb").read()
                    hits += [f"{path}: {w}" for w in ("TOKEN", "WRONG") if globals()[w].encode() in data]
                    searched = searched or b"UpdatePolicy" in data  # the calls were logged, the tokens not
            except OSError:
                pass
    assert searched, f"no log under {session} mentions the calls: the search looked in the wrong place"
    assert hits == []
