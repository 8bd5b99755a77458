"""Deployment files: the profiles render, every generated object validates (KubeRay CRD,
Kubernetes types, PromQL against the exported series), nothing in deploy/ is stale, and the
validators refuse the mistakes they exist for (negative controls)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
pytest.importorskip("kubernetes", reason="the test extra (pip install -e '.[test]') validates core objects")
pytest.importorskip("promql_parser", reason="the test extra (pip install -e '.[test]') parses PromQL")

from adaptspec.serve import deploy, deploy_check  # noqa: E402

CRD = deploy_check.SHARED_CRD
PROFILES = sorted(deploy.profiles())


def _objects(profile: str) -> dict[str, dict]:
    """kind -> object, over a profile's generated files."""
    out = {}
    for f in sorted((deploy.ROOT / "kuberay" / profile).glob("*.yaml")):
        for obj in yaml.safe_load_all(f.read_text()):
            out[obj["kind"]] = obj
    return out


def test_both_profiles_are_shipped():
    assert {"cpu-demo", "gpu-8b"} <= set(PROFILES)


def test_generated_files_are_fresh():
    assert deploy.stale() == [], "run: python -m adaptspec.serve.deploy"


def test_a_stale_file_is_reported(tmp_path, monkeypatch):
    rendered = deploy.render()
    rel = "kuberay/cpu-demo/rayservice.yaml"
    rendered[rel] = rendered[rel].replace("maxReplicas: 4", "maxReplicas: 5")
    assert deploy.stale(rendered) == [rel]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_generated_object_validates(profile):
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent: the RayService cannot be checked against KubeRay's CRD")
    problems = []
    for f in sorted((deploy.ROOT / "kuberay" / profile).glob("*.yaml")):
        for i, obj in enumerate(yaml.safe_load_all(f.read_text())):
            problems += deploy_check.check_object(obj, f"{f.name}[{i}]")
    assert problems == []


def test_the_dashboard_validates():
    assert deploy_check.check_dashboard() == []


def test_make_deploy_check_passes(capsys):
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent")
    assert deploy.main(["--check"]) == 0
    assert "every object validates" in capsys.readouterr().out


# ---- negative controls: each validator refuses what it exists for ---------------------------
def _rayservice(profile="gpu-8b") -> dict:
    return copy.deepcopy(_objects(profile)["RayService"])


def test_rayservice_typo_is_refused_by_the_crd():
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent")
    rs = _rayservice()
    rs["spec"]["rayClusterConfig"]["enableInTreeAutoscalin"] = True
    problems = deploy_check.check_rayservice(rs, "rs")
    assert any("enableInTreeAutoscalin" in p for p in problems), problems


def test_pod_template_typo_and_wrong_type_are_refused():
    rs = _rayservice()
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["imagePullPolcy"] = "Always"
    worker["ports"][0]["containerPort"] = "8080"
    problems = deploy_check.check_k8s_type(rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"],
                                           "V1PodTemplateSpec", "tpl")
    assert any("imagePullPolcy" in p for p in problems) and any("containerPort" in p for p in problems), problems


def test_core_object_missing_required_field_is_refused():
    job = copy.deepcopy(_objects("gpu-8b")["Job"])
    del job["spec"]["template"]["spec"]["containers"][0]["name"]
    problems = deploy_check.check_object(job, "job")
    assert problems and any("name" in p for p in problems), problems


def test_unknown_series_and_label_are_refused():
    rules = copy.deepcopy(_objects("gpu-8b")["PrometheusRule"])
    rules["spec"]["groups"][0]["rules"][0]["expr"] = "rate(ray_adaptspec_tpot_second_bucket[5m]) > 1"
    rules["spec"]["groups"][0]["rules"][1]["expr"] = 'ray_adaptspec_kv_cache_usage{request_class="chat"} > 1'
    rules["spec"]["groups"][0]["rules"][2]["expr"] = "sum(rate(ray_adaptspec_requests_total[5m]) >"
    problems = deploy_check.check_object(rules, "rules")
    assert any("ray_adaptspec_tpot_second_bucket" in p for p in problems), problems
    assert any("no label 'request_class'" in p for p in problems), problems
    assert any("does not parse" in p for p in problems), problems


def test_monitoring_schema_refuses_unknown_fields():
    pm = copy.deepcopy(_objects("cpu-demo")["PodMonitor"])
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert any("intervall" in p for p in deploy_check.check_object(pm, "pm"))


def test_dashboard_overlap_and_unknown_series_are_refused(tmp_path):
    d = json.loads(deploy_check.DASHBOARD.read_text())
    d["panels"][1]["gridPos"] = dict(d["panels"][0]["gridPos"])
    d["panels"][2]["targets"][0]["expr"] = "rate(ray_adaptspec_nothing_total[1m])"
    path = tmp_path / "d.json"
    path.write_text(json.dumps(d))
    problems = deploy_check.check_dashboard(path)
    assert any("overlaps" in p for p in problems) and any("ray_adaptspec_nothing_total" in p for p in problems)


# ---- what the profiles promise ------------------------------------------------------------
def test_gpu_profile_workers_get_a_gpu_toleration_selector_and_the_model_volume():
    objs = _objects("gpu-8b")
    cluster = objs["RayService"]["spec"]["rayClusterConfig"]
    group = cluster["workerGroupSpecs"][0]
    pod = group["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"].startswith("NVIDIA-")
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and "/state" in mounts
    assert cluster["enableInTreeAutoscaling"] is True
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 8)
    svc = yaml.safe_load(objs["RayService"]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert svc["target"]["autoscaling"]["max_replicas"] == group["maxReplicas"]
    assert svc["allow_client_speculation"] is False
    # sized from the models: 8B + 1B in bf16 staged on the host, far above the CPU demo's pod
    assert int(limits["memory"].removesuffix("Gi")) >= 25
    assert objs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    job = objs["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert "hf download meta-llama/Llama-3.1-8B-Instruct" in job["command"][-1]
    assert svc["models"]["target"] == "/models/hub/meta-llama--Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("profile", PROFILES)
def test_ray_auth_admin_secret_and_grpc_service(profile):
    rs = _objects(profile)["RayService"]
    spec = rs["spec"]
    assert spec["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    for group in [spec["rayClusterConfig"]["headGroupSpec"], *spec["rayClusterConfig"]["workerGroupSpecs"]]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        ref = env["ADAPTSPEC_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "adaptspec-admin", "key": "token"} and "value" not in env["ADAPTSPEC_ADMIN_TOKEN"]
    ports = {p["name"]: p for p in spec["serveService"]["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9000 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_ray_container_reads_the_api_keys_from_the_mounted_secret(profile):
    spec = _objects(profile)["RayService"]["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        path = env["ADAPTSPEC_API_KEYS"]["value"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
        assert mount["readOnly"] and path == f"{mount['mountPath']}/keys"
        vol = next(v for v in pod["volumes"] if v["name"] == "api-keys")
        assert vol["secret"]["secretName"] == "adaptspec-api-keys"
        assert vol["secret"]["items"] == [{"key": "keys", "path": "keys"}]
        assert vol["secret"]["defaultMode"] & 0o007 == 0  # not readable by other users


def test_without_an_api_keys_secret_nothing_is_mounted(tmp_path):
    data = yaml.safe_load((deploy.PROFILES / "cpu-demo.yaml").read_text())
    data["kubernetes"]["api_keys_secret"] = None
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(data))
    files = deploy.profile_files(deploy.load_profile(path))
    rs = next(o for objs in files.values() for o in objs if o["kind"] == "RayService")
    spec = rs["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        c = group["template"]["spec"]["containers"][0]
        assert "ADAPTSPEC_API_KEYS" not in {e["name"] for e in c["env"]}
    assert "api-keys" not in json.dumps(files)


def test_the_service_reads_keys_from_a_secret_volume_and_follows_rotation(tmp_path, monkeypatch):
    """The layout the kubelet writes for a Secret volume: the key is a symlink through
    ``..data``, which is swapped atomically to a new folder when the Secret changes."""
    from adaptspec.serve.openai_api import ApiKeys

    root = tmp_path / "api-keys"
    root.mkdir()
    for name, keys in (("..v1", "alpha\nbeta\n"), ("..v2", "gamma\n")):
        (root / name).mkdir()
        (root / name / "keys").write_text(keys)
    (root / "..data").symlink_to("..v1")
    (root / "keys").symlink_to("..data/keys")
    monkeypatch.setenv("ADAPTSPEC_API_KEYS", str(root / "keys"))
    keys = ApiKeys("ADAPTSPEC_API_KEYS")
    assert keys.current() == ("alpha", "beta")
    (root / "..tmp").symlink_to("..v2")
    (root / "..tmp").replace(root / "..data")
    assert keys.current() == ("gamma",)


@pytest.mark.parametrize("profile", PROFILES)
def test_network_policy_keeps_ray_ports_in_the_cluster(profile):
    np = _objects(profile)["NetworkPolicy"]["spec"]
    assert np["policyTypes"] == ["Ingress"]
    labels = np["podSelector"]["matchLabels"]
    for rule in np["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        sources = rule["from"]
        if not ports:  # every port: only this Ray cluster's own pods
            assert sources == [{"podSelector": {"matchLabels": labels}}]
        if ports & {deploy.DASHBOARD_PORT, deploy.CLIENT_PORT, deploy.GCS_PORT}:
            assert ports == {deploy.DASHBOARD_PORT}  # the dashboard to the operator's namespace, nothing else
            assert sources[0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kuberay-system"}
        assert all(s != {} for s in sources)  # never "from anywhere"


def test_gateway_terminates_tls_and_keeps_admin_methods_inside():
    objs = _objects("gpu-8b")
    listener = objs["Gateway"]["spec"]["listeners"][0]
    assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
    rule = objs["GRPCRoute"]["spec"]["rules"][0]
    methods = {m["method"]["method"] for m in rule["matches"]}
    assert {"Generate", "GenerateStream", "Check"} <= methods and not methods & {"UpdatePolicy", "GetPolicy"}
    assert rule["backendRefs"] == [{"name": "adaptspec-serve", "port": 9000}]


def test_alerts_cover_the_class_targets_and_failures():
    rules = _objects("gpu-8b")["PrometheusRule"]["spec"]["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"AdaptSpecTPOTTargetMissed", "AdaptSpecTTFTTargetMissed", "AdaptSpecDrafterFaults",
            "AdaptSpecReplicaRestarts", "AdaptSpecRequestsRefused"} <= names
    tpot = next(r for r in rules if r["alert"] == "AdaptSpecTPOTTargetMissed")
    assert 'request_class="chat"' in tpot["expr"] and tpot["expr"].endswith("> 0.05")


def test_a_gpu_profile_that_does_not_fit_is_refused(tmp_path):
    data = yaml.safe_load((deploy.PROFILES / "gpu-8b.yaml").read_text())
    data["service"]["engine"]["max_model_len"] = 65536
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="kubernetes.sizing"):
        deploy.profile_files(deploy.load_profile(path))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["kubernetes"]["workers"].update(gpus=0), "kubernetes.workers.gpus"),
    (lambda d: d["kubernetes"].update(namespce="x"), "namespce"),
    (lambda d: d["service"]["models"].update(device="cpu"), "models.device"),
])
def test_bad_profile_names_the_field(tmp_path, edit, field):
    data = yaml.safe_load((deploy.PROFILES / "gpu-8b.yaml").read_text())
    edit(data)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=field.replace(".", r"\.") if "." in field else field):
        deploy.load_profile(path)


def test_metrics_registry_matches_what_the_replica_records():
    """The rules and dashboard are checked against METRICS; METRICS must be what is exported."""
    from adaptspec.serve.metrics import METRICS, ServiceMetrics

    m = ServiceMetrics()
    made = {x._name: tuple(x._tag_keys) for x in vars(m).values() if hasattr(x, "_tag_keys")}
    assert {n: set(t) for n, t in made.items()} == {n: set(t) for n, (_, t) in METRICS.items()}
