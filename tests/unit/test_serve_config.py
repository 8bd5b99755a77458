"""Service config: the pydantic model, the written Serve config, the deploy/ files."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adaptspec.serve.config import ServiceConfig, check_serve_config, load_config, serve_config, write_serve_config

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayservices.yaml"


def test_default_config_writes_a_valid_serve_config(tmp_path):
    pytest.importorskip("ray.serve")
    path = write_serve_config(ServiceConfig(), tmp_path / "serve.yaml")
    data = yaml.safe_load(path.read_text())
    check_serve_config(data)  # ServeDeploySchema + unknown keys + our args
    app = data["applications"][0]
    assert app["import_path"] == "adaptspec.serve.app:app_builder"
    assert ServiceConfig.model_validate(app["args"]) == ServiceConfig()


def test_the_builder_named_in_the_serve_config_builds_the_app():
    pytest.importorskip("ray.serve")
    from ray.serve import Application

    from adaptspec.serve.app import app_builder

    assert isinstance(app_builder(serve_config(ServiceConfig())["applications"][0]["args"]), Application)


@pytest.mark.parametrize("where, key", [((), "grpc_option"), (("grpc_options",), "grpc_servicer_function"),
                                         (("http_options",), "hots")])
def test_unknown_serve_keys_are_refused(where, key):
    pytest.importorskip("ray.serve")
    data = serve_config(ServiceConfig())
    node = data
    for w in where:
        node = node[w]
    node[key] = 1
    with pytest.raises(ValueError, match=key):
        check_serve_config(data)


def test_unknown_app_arg_is_refused():
    pytest.importorskip("ray.serve")
    data = serve_config(ServiceConfig())
    data["applications"][0]["args"]["engine"]["max_num_seq"] = 3
    with pytest.raises(ValueError, match="max_num_seq"):
        check_serve_config(data)


@pytest.mark.parametrize("data, field", [
    ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
    ({"controller": {"policy": "magic"}}, "policy"),
    ({"classes": [{"name": "a", "pin": {"drafter": "none", "k": 3}}]}, "k"),
    ({"classes": [{"name": "a"}, {"name": "a"}]}, "classes"),
    ({"modles": {}}, "modles"),
    ({"controller": {"fade_min_steps": 0}}, "fade_min_steps"),
    ({"placement": "disaggregated", "models": {"draft": None}}, "placement"),
    ({"placement": "disaggregated", "models": {"draft": "smollm2-135m-draft"}}, "draft head"),
])
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):  # the word, not letters inside another
        ServiceConfig.model_validate(data)


def test_the_controller_fading_settings_reach_the_policy():
    from adaptspec.serve.policies import make_policy

    # values other than the defaults, or the test would pass without the settings reaching it
    c = ServiceConfig.model_validate({"controller": {"fade_half_life_s": 45.0, "fade_min_steps": 200}}).controller
    p = make_policy("thompson", drafters=("ngram",), max_k=4, fade_half_life_s=c.fade_half_life_s,
                    fade_min_steps=c.fade_min_steps)
    assert (p.ts.fade_half_life_s, p.ts.fade_min_steps) == (45.0, 200)


def test_the_fading_defaults_are_the_policys_own():
    """The service config and the scenario schema repeat thompson's fading defaults (they import
    no numpy); a default changed in one place only would make the service, the simulator and the
    policy built in code fade at different rates."""
    from adaptspec.control import ThompsonConfig
    from adaptspec.serve.config import ControllerOptions
    from adaptspec.serve.policies import make_policy
    from adaptspec.sim.scenario import ThompsonSpec

    ts = ThompsonConfig()
    want = (ts.fade_half_life_s, ts.fade_min_steps)
    for schema in (ControllerOptions, ThompsonSpec):
        f = schema.model_fields
        assert (f["fade_half_life_s"].default, f["fade_min_steps"].default) == want, schema.__name__
    p = make_policy("thompson", drafters=("ngram",), max_k=4)
    assert (p.ts.fade_half_life_s, p.ts.fade_min_steps) == want


def test_a_static_policy_takes_an_arm_per_class_and_names_what_is_wrong():
    from adaptspec.control import Load
    from adaptspec.serve.policies import make_policy

    kw = dict(drafters=("draft", "ngram"), max_k=4, classes=("chat", "extraction", "default"))
    p = make_policy("static:draft:1/extraction=ngram:2", **kw)
    assert [str(a) for a in p.choose_many(["chat", "extraction", "default"], Load())] == ["draft:1", "ngram:2", "draft:1"]
    assert str(make_policy("static:ngram:3", **kw).choose("extraction", Load())) == "ngram:3"
    for name, words in (("static:none:0/poetry=ngram:2", "class 'poetry'"), ("static:none:0/extraction", "<class>="),
                        ("static:none:0/chat=ngram:9", "k=9 exceeds max_k=4"),
                        ("static:none:0/chat=suffix:2", "drafter 'suffix'"),
                        ("static:none:0/chat=ngram:1/chat=draft:1", "twice")):
        with pytest.raises(ValueError, match=r"^policy: ") as err:
            make_policy(name, **kw)
        assert words in str(err.value), (name, err.value)


def test_default_class_is_always_there():
    assert "default" in ServiceConfig.model_validate({"classes": [{"name": "chat"}]}).class_names


def test_deploy_files_are_fresh_and_valid():
    pytest.importorskip("ray.serve")
    from adaptspec.serve.deploy import ROOT as DEPLOY, render

    for rel, text in render().items():
        assert (DEPLOY / rel).read_text() == text, f"deploy/{rel} is stale: python -m adaptspec.serve.deploy"
    check_serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    load_config(DEPLOY / "adaptspec.yaml")


@pytest.mark.parametrize("profile", ["cpu-demo", "gpu-8b"])
def test_rayservice_validates_against_the_kuberay_crd(profile):
    if not CRD.exists():
        pytest.skip("../shared/schemas/kuberay is absent")
    pytest.importorskip("ray.serve")
    jsonschema = pytest.importorskip("jsonschema")
    # a 1 MB document: libyaml's loader where PyYAML has it (10x the pure-Python one)
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    manifest = yaml.safe_load((ROOT / "deploy" / "kuberay" / profile / "rayservice.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == manifest["apiVersion"].split("/")[1])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    # one validator for both checks: jsonschema.validate checks the (large) schema itself first
    validator = jsonschema.validators.validator_for(schema)(schema)
    validator.validate(manifest)
    manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # negative control: a typo
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(manifest)
    del manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"]
    assert manifest["kind"] == crd["spec"]["names"]["kind"]
    check_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]))


def _strict(schema):
    """The CRD schema, refusing unknown fields as the API server prunes them (typos vanish)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_cli_writes_a_serve_config(tmp_path):
    pytest.importorskip("ray.serve")
    from typer.testing import CliRunner

    from adaptspec.cli import app

    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--config", str(ROOT / "deploy" / "adaptspec.yaml"), "--port", "9100",
                                   "--write-serve-config", str(out)])
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(out.read_text())
    check_serve_config(data)
    assert data["grpc_options"]["port"] == 9100


@pytest.mark.parametrize("profile", ["cpu-demo", "gpu-8b"])
def test_every_ray_container_gets_the_request_path_settings(profile):
    """Serve reads them in each Ray process at start-up: the head (proxy, Serve controller) and
    every worker (replicas, their proxies) need them, or the proxy keeps Ray actor calls."""
    pytest.importorskip("ray.serve")
    from adaptspec.serve.app import SERVE_LATENCY_ENV

    manifest = yaml.safe_load((ROOT / "deploy" / "kuberay" / profile / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}  # secrets: valueFrom
            assert env == {**env, **SERVE_LATENCY_ENV}, container["name"]
    assert SERVE_LATENCY_ENV["RAY_SERVE_PROXY_USE_GRPC"] == "1"


def test_the_engine_cuda_graph_settings_reach_the_replicas_engine(tiny_dir):
    """engine.cuda_graphs / cuda_graph_max_tokens are passed to the engine a replica builds
    (on the CPU, ``true`` runs the padded static-buffer path without capturing)."""
    from adaptspec.serve.engine_proc import build_engine

    cfg = ServiceConfig.model_validate({"models": {"target": str(tiny_dir), "draft": None},
                                        "engine": {"max_num_seqs": 2, "max_model_len": 64, "cuda_graphs": True,
                                                   "cuda_graph_max_tokens": 16}})
    engine = build_engine(cfg, torch_threads=1)
    assert engine.config.cuda_graphs is True and engine.config.cuda_graph_max_tokens == 16
    assert engine.graphs is not None
    off = build_engine(cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"cuda_graphs": False})}),
                       torch_threads=1)
    assert off.graphs is None


def test_a_bad_cuda_graph_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        ServiceConfig.model_validate({"engine": {"cuda_graph_max_tokens": 0}})
