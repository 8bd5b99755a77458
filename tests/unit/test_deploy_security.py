"""Security and scaling rules without a cluster: the admin token (where it comes from, how it
is checked), the ingress's admin gate and request limits, Serve's options from the engine's
capacity, the controller's checkpoints, and the proxy's answer for a lost replica."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest

from adaptspec.serve import auth
from adaptspec.serve.config import ServiceConfig

grpc = pytest.importorskip("grpc")


# ---- auth ---------------------------------------------------------------------------------
def test_generated_token_file_is_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPTSPEC_TEST_TOKEN", raising=False)
    path = tmp_path / "home" / auth.TOKEN_FILE_NAME
    tok, created = auth.ensure_token("ADAPTSPEC_TEST_TOKEN", path)
    assert created and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(tok.secret) >= 40 and tok.secret not in repr(tok) and tok.secret not in str(tok)
    again, created = auth.ensure_token("ADAPTSPEC_TEST_TOKEN", path)
    assert not created and again.secret == tok.secret
    monkeypatch.setenv("ADAPTSPEC_TEST_TOKEN", "from-env")  # the operator's variable wins
    assert auth.ensure_token("ADAPTSPEC_TEST_TOKEN", path)[0].secret == "from-env"


def test_token_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "admin-token"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        auth.read_token_file(path)


def test_default_token_file_is_under_adaptspec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTSPEC_HOME", str(tmp_path))
    assert auth.token_file() == tmp_path / "admin-token"


@pytest.mark.parametrize("value, token", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc"), (b"Bearer abc", "abc"),
    ("Basic abc", None), ("Bearer", None), ("Bearer a b", None), ("", None), (None, None), ("abc", None),
])
def test_bearer_parsing(value, token):
    assert auth.parse_bearer(value) == token


def test_check_tells_missing_from_wrong_and_closes_without_a_server_token():
    good = auth.Token("right-token", "env:X")
    assert auth.check("right-token", good) is auth.Verdict.OK
    assert auth.check(None, good).grpc_code == "UNAUTHENTICATED"
    assert auth.check("wrong-token", good).grpc_code == "PERMISSION_DENIED"
    assert auth.check("right-token-and-more", good) is auth.Verdict.WRONG
    assert auth.check("right-token", None) is auth.Verdict.NOT_CONFIGURED
    assert auth.check("b", ["a", "b"]) is auth.Verdict.OK  # several accepted tokens (API keys)
    assert "right-token" not in auth.refusal_message(auth.Verdict.WRONG)


def test_check_compares_in_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    auth.check("x", ["a", "x", "c"])
    assert len(calls) == 3  # every accepted token compared, not stopping at the first match


# ---- the ingress ------------------------------------------------------------------------------
class _Ctx:
    def __init__(self, metadata=()):
        self.code = self.details = None
        self._md = list(metadata)

    def invocation_metadata(self):
        return self._md

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def _host(**config):
    from types import SimpleNamespace

    from adaptspec.serve.controller import PolicyView
    from adaptspec.serve.ingress import Ingress

    calls = []

    class Remote:
        def __init__(self, name):
            self.name = name

        async def remote(self, *args):
            calls.append(self.name)
            return PolicyView("thompson", [("chat", "none:0", False)], 1, ("ngram",), 4)

    class Host(Ingress):
        pass

    h = Host()
    h.config = ServiceConfig.model_validate({"models": {"draft": None}, **config})
    h.controller = SimpleNamespace(policy=Remote("policy"), update_policy=Remote("update_policy"))
    return h, calls


@pytest.mark.parametrize("method", ["GetPolicy", "UpdatePolicy"])
def test_admin_calls_need_the_token(monkeypatch, method):
    from adaptspec.proto import adaptspec_pb2 as pb

    monkeypatch.setenv("ADAPTSPEC_ADMIN_TOKEN", "t0k3n-value")
    req = pb.GetPolicyRequest() if method == "GetPolicy" else pb.UpdatePolicyRequest(policy="ucb")
    for md, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                     ((("authorization", "Bearer nope"),), grpc.StatusCode.PERMISSION_DENIED),
                     ((("authorization", "Basic t0k3n-value"),), grpc.StatusCode.UNAUTHENTICATED),
                     ((("authorization", "Bearer t0k3n-value"),), None)):
        host, calls = _host()
        ctx = _Ctx(md)
        asyncio.run(getattr(host, method)(req, ctx))
        assert ctx.code == code, (md, ctx.details)
        assert bool(calls) == (code is None)  # refused calls never reach the controller
        if code is not None:
            assert "t0k3n-value" not in (ctx.details or "")


def test_data_calls_check_api_keys_before_anything_else(monkeypatch, tmp_path):
    from adaptspec.proto import adaptspec_pb2 as pb

    monkeypatch.setenv("ADAPTSPEC_API_KEYS", "k-one,k-two")
    req = pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2)
    for md, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                     ((("authorization", "Bearer k-three"),), grpc.StatusCode.PERMISSION_DENIED)):
        host, calls = _host()
        ctx = _Ctx(md)
        asyncio.run(host.Generate(req, ctx))
        assert ctx.code == code and "k-one" not in ctx.details and "k-two" not in ctx.details
        ctx = _Ctx(md)
        asyncio.run(host.GetStats(pb.GetStatsRequest(), ctx))
        assert ctx.code == code and not calls
    host, _ = _host()  # negative controls: the right key, or keys not asked of gRPC, pass the check
    assert host._key_refusal(_Ctx((("authorization", "Bearer k-two"),)), "Generate") is None
    host, _ = _host(auth={"grpc_api_keys": False})
    assert host._key_refusal(_Ctx(), "Generate") is None
    monkeypatch.setenv("ADAPTSPEC_API_KEYS", str(tmp_path / "missing"))  # a Secret not mounted: closed
    host, _ = _host()
    assert host._key_refusal(_Ctx((("authorization", "Bearer k-two"),)), "Generate")[0] == "UNAVAILABLE"
    monkeypatch.delenv("ADAPTSPEC_API_KEYS")  # no keys configured: open, as before
    host, _ = _host()
    assert host._key_refusal(_Ctx(), "Generate") is None


def test_admin_calls_are_closed_without_a_server_token(monkeypatch, tmp_path):
    from adaptspec.proto import adaptspec_pb2 as pb

    monkeypatch.delenv("ADAPTSPEC_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("ADAPTSPEC_HOME", str(tmp_path))  # no token file there either
    host, calls = _host()
    ctx = _Ctx([("authorization", "Bearer anything")])
    asyncio.run(host.UpdatePolicy(pb.UpdatePolicyRequest(policy="ucb"), ctx))
    assert ctx.code == grpc.StatusCode.PERMISSION_DENIED and "no admin token" in ctx.details and not calls


def test_the_token_variable_is_the_configs(monkeypatch):
    from adaptspec.proto import adaptspec_pb2 as pb

    monkeypatch.setenv("MY_ADMIN", "mine")
    host, calls = _host(auth={"admin_token_env": "MY_ADMIN"})
    ctx = _Ctx([("authorization", "Bearer mine")])
    asyncio.run(host.GetPolicy(pb.GetPolicyRequest(), ctx))
    assert ctx.code is None and calls == ["policy"]


@pytest.mark.parametrize("fields, config, code, field", [
    (dict(speculation=("ngram", 4)), dict(allow_client_speculation=False), "PERMISSION_DENIED", "speculation"),
    (dict(stop=["a"] * 9), dict(max_stop_strings=8), "INVALID_ARGUMENT", "stop"),
    (dict(stop=["ok", "x" * 129]), dict(max_stop_chars=128), "INVALID_ARGUMENT", "stop[1]"),
    (dict(prompt="é" * 600), dict(max_prompt_bytes=1000), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt_token_ids=[1] * 2000), dict(), "INVALID_ARGUMENT", "prompt_token_ids"),
])
def test_request_limits(fields, config, code, field):
    from adaptspec.serve.client import request
    from adaptspec.serve.ingress import request_refusal

    cfg = ServiceConfig.model_validate({"models": {"draft": None}, **config})
    got = request_refusal(request(**{"prompt": "hi", **fields}) if "prompt_token_ids" not in fields
                          else request(**fields), cfg)
    assert got is not None and got[0] == code and got[1].startswith(field), got
    # negative control: the same request within the default limits passes
    if config:
        assert request_refusal(request(**{"prompt": "hi", **fields}), ServiceConfig.model_validate(
            {"models": {"draft": None}})) is None


def test_refused_generate_is_counted_with_its_code(monkeypatch):
    from adaptspec.proto import adaptspec_pb2 as pb

    host, _ = _host(allow_client_speculation=False)
    seen = []
    host.metrics = type("M", (), {"observe_refused": lambda self, c, code: seen.append((c, code))})()
    ctx = _Ctx()
    req = pb.GenerateRequest(prompt="hi", request_class="no-such-class", speculation=pb.Arm(drafter="ngram", k=2))
    asyncio.run(host.Generate(req, ctx))
    assert ctx.code == grpc.StatusCode.PERMISSION_DENIED
    assert seen == [("default", "PERMISSION_DENIED")]  # the configured class, not the client's string


# ---- Serve options from the engine's capacity ------------------------------------------------
def test_serve_limits_follow_the_engine():
    from adaptspec.serve.app import target_options

    cfg = ServiceConfig.model_validate({"engine": {"max_num_seqs": 24, "max_queued": 40}})
    opts = target_options(cfg)
    assert opts["max_ongoing_requests"] == 64 and opts["num_replicas"] == 1 and opts["max_queued_requests"] == 40
    auto = target_options(ServiceConfig.model_validate(
        {"engine": {"max_num_seqs": 24}, "target": {"autoscaling": {"min_replicas": 2, "max_replicas": 6}}}))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 24.0
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**auto["autoscaling_config"])  # Serve accepts it
    with pytest.raises(ValueError, match="min_replicas"):
        ServiceConfig.model_validate({"target": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}})


# ---- controller checkpoints ---------------------------------------------------------------------
def _core(**controller):
    from adaptspec.serve.controller import ControlCore

    return ControlCore(ServiceConfig.model_validate({"models": {"draft": None}, "controller": {
        "cost_profile": None, **controller}}))


def test_checkpoint_round_trip_through_a_file(tmp_path):
    from adaptspec.control import Arm
    from adaptspec.serve.controller import CheckpointStore, PolicyUpdate

    a = _core()
    a.update(PolicyUpdate("ucb", pins=[("chat", Arm("ngram", 3))]))
    store = CheckpointStore(str(tmp_path / "vol" / "ckpt.pkl"), "adaptspec")
    store.save(a.state_bytes())
    assert stat.S_IMODE(os.stat(tmp_path / "vol" / "ckpt.pkl").st_mode) == 0o600
    b = _core()
    assert b.policy_name == "thompson"
    assert b.restore(store.load())
    assert b.policy_name == "ucb" and b.pins == {"chat": Arm("ngram", 3)}
    assert b.policy is b._policies["ucb"] and "thompson" in b._policies  # switching back resumes it


def test_checkpoint_for_another_deployment_shape_is_not_restored(tmp_path):
    from adaptspec.serve.controller import PolicyUpdate

    a = _core()
    a.update(PolicyUpdate("ucb"))
    b = _core(max_k=3)
    assert not b.restore(a.state_bytes()) and b.policy_name == "thompson"


def test_a_damaged_checkpoint_starts_afresh(tmp_path):
    from adaptspec.serve.controller import Controller

    path = tmp_path / "ckpt.pkl"
    path.write_bytes(b"not a pickle")
    # niceness 0: built in the test's own process, the controller must not lower its priority
    cfg = {"models": {"draft": None}, "controller": {"cost_profile": None, "checkpoint": str(path), "niceness": 0}}
    ctl = asyncio.run(_construct(Controller.func_or_class, cfg))
    assert ctl.core.policy_name == "thompson"
    assert ctl.checkpoint() and path.read_bytes() != b"not a pickle"


async def _construct(cls, cfg):
    """The deployment's class built as Serve builds it (an async __init__), its timer stopped."""
    obj = cls.__new__(cls)
    await obj.__init__(cfg)
    obj._task.cancel()
    return obj


# ---- a lost replica ---------------------------------------------------------------------------------
def test_lost_replica_is_unavailable_other_errors_unchanged():
    pytest.importorskip("ray.serve")
    from ray.exceptions import ActorUnavailableError, RayTaskError

    from adaptspec.serve import proxy_status
    from ray.serve._private import proxy

    assert proxy_status.install()
    status = proxy.get_grpc_response_status
    lost = status(ActorUnavailableError("gone", b"\x00" * 16), None, "r1")
    assert lost.code == grpc.StatusCode.UNAVAILABLE and "retry" in lost.message
    other = status(ValueError("boom"), None, "r2")
    assert other.code == grpc.StatusCode.INTERNAL  # negative control: a bug stays INTERNAL
    assert proxy_status.replica_lost(RayTaskError("f", "tb", ValueError("x"))) is False
