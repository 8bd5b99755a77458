"""Validation of the generated deployment files (``make deploy-check``, ``tests/unit/test_deploy_*``).

Each ``check_*`` returns a list of problems (strings naming the file and the field); empty
means valid. What each kind of object is checked against:

- ``RayService``: the KubeRay CRD's OpenAPI schema (``../shared/schemas/kuberay``) with
  ``jsonschema``, plus unknown fields (the API server would prune them silently); its pod
  templates and serve Service as Kubernetes core types; its ``serveConfigV2`` with Serve's
  own schema and our ``ServiceConfig``.
- core objects (Namespace, PersistentVolumeClaim, Job, NetworkPolicy, Service, pod
  templates): the Kubernetes API types of the ``kubernetes`` client: every field must be a
  field of the type (camelCase, as in a manifest), of its type, with the required ones set.
- prometheus-operator ``PodMonitor`` / ``PrometheusRule`` and Gateway API ``Gateway`` /
  ``GRPCRoute``: the subset of their CRD schemas these manifests use (below; unknown fields
  refused), every PromQL expression parsed with ``promql-parser`` and every metric it reads
  checked against what the service and Ray Serve export (``metrics.METRICS``), including
  the labels it filters on.
- the Grafana dashboard: panel structure, unique ids, non-overlapping grid, and its queries
  like the rules'.

Needs the test extra (``kubernetes``, ``jsonschema``, ``promql-parser``).
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from adaptspec.serve.deploy import ROOT

SHARED_CRD = ROOT.parents[1] / "shared" / "schemas" / "kuberay" / "ray.io_rayservices.yaml"
DASHBOARD = ROOT / "grafana" / "adaptspec.json"
CORE_KINDS = {("v1", "Namespace"): "V1Namespace", ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
              ("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret", ("batch/v1", "Job"): "V1Job",
              ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy", ("apps/v1", "Deployment"): "V1Deployment"}
# labels every Ray metric may carry besides its own tags
RAY_LABELS = {"application", "deployment", "replica", "route", "SessionName", "NodeAddress", "Version", "Component",
              "WorkerId", "JobId", "ip", "pod", "namespace", "container", "instance", "job", "le", "quantile",
              "ray_io_cluster", "ray_io_node_type"}
# Ray Serve's own series the rules and the dashboard read (name -> labels of its own)
SERVE_SERIES = {
    "ray_serve_deployment_replica_starts_total": set(),
    "ray_serve_deployment_replica_healthy": set(),
    "ray_serve_deployment_queued_queries": set(),
    "ray_serve_num_ongoing_requests_at_replicas": set(),
    "ray_serve_autoscaling_target_replicas": set(),
    "ray_serve_deployment_request_counter_total": set(),
}


# ---- known series -------------------------------------------------------------------------
def known_series() -> dict[str, set[str]]:
    """Every series name Prometheus sees from the service -> the labels it may carry."""
    from adaptspec.serve.metrics import METRICS

    out: dict[str, set[str]] = {}
    for name, (kind, tags) in METRICS.items():
        full = f"ray_{name}"
        suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}[kind]
        for sfx in suffixes:
            out[full + sfx] = set(tags) | RAY_LABELS
    for name, tags in SERVE_SERIES.items():
        out[name] = tags | RAY_LABELS
    return out


def check_promql(expr: str, where: str, series: dict[str, set[str]] | None = None) -> list[str]:
    """Parse ``expr``; every selector must name a known series and filter on its labels only."""
    import promql_parser

    series = series if series is not None else known_series()
    try:
        tree = promql_parser.parse(expr)
    except Exception as exc:  # the parser's error names the position
        return [f"{where}: PromQL does not parse: {exc}"]
    problems: list[str] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name not in series:
                problems.append(f"{where}: series {node.name!r} is not exported by the service or Ray Serve")
            else:
                for m in node.matchers.matchers:
                    if m.name not in series[node.name]:
                        problems.append(f"{where}: {node.name} has no label {m.name!r}")
        return True

    promql_parser.walk(tree, visit)
    return problems


# ---- Kubernetes core types ------------------------------------------------------------------
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:[Dd]ict\[str, (.+)\]|dict\(str, (.+)\))$")


def check_k8s_type(data, type_name: str, where: str) -> list[str]:
    """``data`` (as in a manifest) against the Kubernetes type ``type_name`` (e.g. ``V1Job``)."""
    problems = _walk(data, type_name, where)
    if problems:
        return problems
    from kubernetes.client import ApiClient

    try:  # required fields and value types, as the client's models check them
        ApiClient().deserialize(json.dumps(data), type_name, "application/json")
    except Exception as exc:
        return [f"{where}: {type_name}: {exc}"]
    return []


def _walk(data, type_name: str, where: str) -> list[str]:
    import kubernetes.client as k8s

    if m := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{where}: expected a list ({type_name})"]
        return [p for i, item in enumerate(data) for p in _walk(item, m.group(1), f"{where}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{where}: expected a mapping ({type_name})"]
        inner = m.group(1) or m.group(2)
        return [p for key, v in data.items() for p in _walk(v, inner, f"{where}.{key}")]
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str,
              "bytes": str}
    if type_name in simple:
        ok = isinstance(data, simple[type_name]) and not (type_name in ("int", "float") and isinstance(data, bool))
        return [] if ok else [f"{where}: expected {type_name}, got {type(data).__name__} {data!r}"]
    if type_name == "object":  # int-or-string, quantities, free-form
        return []
    cls = getattr(k8s, type_name, None)
    if cls is None:
        return [f"{where}: unknown Kubernetes type {type_name}"]
    if not isinstance(data, dict):
        return [f"{where}: expected a mapping ({type_name})"]
    by_json = {v: k for k, v in cls.attribute_map.items()}
    problems = []
    for key, value in data.items():
        attr = by_json.get(key)
        if attr is None:
            problems.append(f"{where}.{key}: not a field of {type_name} (known: {', '.join(sorted(by_json))})")
            continue
        problems += _walk(value, cls.openapi_types[attr], f"{where}.{key}")
    return problems


# ---- CRD schemas ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def crd_schema(crd_path: Path, api_version: str) -> dict:
    """The CRD's schema for ``api_version`` (the file is a megabyte of YAML: parsed once)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(Path(crd_path).read_text(), Loader=loader)  # noqa: S506 - a safe loader
    version = api_version.split("/")[1]
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def check_schema(data, schema: dict, where: str) -> list[str]:
    """jsonschema validation plus unknown fields: a structural CRD schema lists every field,
    and the API server drops the ones it does not know without a word."""
    import jsonschema

    problems = [f"{where}.{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(data)]
    return problems + _unknown(data, schema, where)


def _unknown(data, schema: dict, where: str) -> list[str]:
    if isinstance(data, dict) and schema.get("type", "object") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = []
        for key, value in data.items():
            if props is not None and key in props:
                out += _unknown(value, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                out += _unknown(value, extra, f"{where}.{key}")
            elif props is not None and extra is not True:
                out.append(f"{where}.{key}: unknown field (known: {', '.join(sorted(props))})")
        return out
    if isinstance(data, list) and isinstance(schema.get("items"), dict):
        return [p for i, item in enumerate(data) for p in _unknown(item, schema["items"], f"{where}[{i}]")]
    return []


def _obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
_META = {"type": "object", "properties": {"name": _STR, "namespace": _STR, "labels": _STRMAP,
                                          "annotations": _STRMAP}, "required": ["name"], "additionalProperties": False}
_SELECTOR = _obj({"matchLabels": _STRMAP, "matchExpressions": {"type": "array", "items": _obj(
    {"key": _STR, "operator": _STR, "values": {"type": "array", "items": _STR}}, ("key", "operator"))}})


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _obj({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _META, "spec": spec},
                ("apiVersion", "kind", "metadata", "spec"))


_NAME_VALUE = {"type": "array", "items": _obj({"name": _STR, "value": _STR}, ("name", "value"))}
_GRPC_RULE = _obj({
    "matches": {"type": "array", "items": _obj({
        "method": _obj({"type": {"enum": ["Exact", "RegularExpression"]}, "service": _STR, "method": _STR}),
        "headers": {"type": "array", "items": _obj({"type": _STR, "name": _STR, "value": _STR}, ("name", "value"))},
    })},
    "filters": {"type": "array", "items": _obj({
        "type": {"enum": ["RequestHeaderModifier", "ResponseHeaderModifier", "RequestMirror", "ExtensionRef"]},
        "requestHeaderModifier": _obj({"set": _NAME_VALUE, "add": _NAME_VALUE,
                                       "remove": {"type": "array", "items": _STR}}),
    }, ("type",))},
    "backendRefs": {"type": "array", "items": _obj({"group": _STR, "kind": _STR, "name": _STR, "namespace": _STR,
                                                    "port": _INT, "weight": _INT}, ("name",))},
})


# the fields of prometheus-operator's and Gateway API's CRDs (monitoring.coreos.com/v1,
# gateway.networking.k8s.io/v1) that these manifests use, as the CRDs define them
SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource("monitoring.coreos.com/v1", "PodMonitor", _obj({
        "selector": _SELECTOR, "jobLabel": _STR, "podTargetLabels": {"type": "array", "items": _STR},
        "namespaceSelector": _obj({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}}),
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _obj({
            "port": _STR, "portNumber": _INT, "path": _STR, "scheme": {"enum": ["http", "https"]},
            "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"}})}},
        ("selector", "podMetricsEndpoints"))),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _resource("monitoring.coreos.com/v1", "PrometheusRule", _obj({
        "groups": {"type": "array", "items": _obj({
            "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
            "rules": {"type": "array", "items": {**_obj({
                "alert": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}, "record": _STR,
                "expr": {"type": "string", "minLength": 1}, "for": _DURATION, "keep_firing_for": _DURATION,
                "labels": _STRMAP, "annotations": _STRMAP}, ("expr",)),
                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}]}}}, ("name", "rules"))}},
        ("groups",))),
    ("gateway.networking.k8s.io/v1", "Gateway"): _resource("gateway.networking.k8s.io/v1", "Gateway", _obj({
        "gatewayClassName": _STR,
        "listeners": {"type": "array", "minItems": 1, "items": _obj({
            "name": _STR, "hostname": _STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "protocol": _STR,
            "tls": _obj({"mode": {"enum": ["Terminate", "Passthrough"]}, "certificateRefs": {
                "type": "array", "items": _obj({"group": _STR, "kind": _STR, "name": _STR, "namespace": _STR},
                                               ("name",))}}),
            "allowedRoutes": _obj({"namespaces": _obj({"from": {"enum": ["All", "Same", "Selector"]},
                                                       "selector": _SELECTOR}),
                                   "kinds": {"type": "array", "items": _obj({"group": _STR, "kind": _STR},
                                                                             ("kind",))}})},
            ("name", "port", "protocol"))}}, ("gatewayClassName", "listeners"))),
    ("gateway.networking.k8s.io/v1", "GRPCRoute"): _resource("gateway.networking.k8s.io/v1", "GRPCRoute", _obj({
        "parentRefs": {"type": "array", "items": _obj({"group": _STR, "kind": _STR, "namespace": _STR, "name": _STR,
                                                       "sectionName": _STR, "port": _INT}, ("name",))},
        "hostnames": {"type": "array", "items": _STR},
        "rules": {"type": "array", "items": _GRPC_RULE}})),
}


# ---- per kind -------------------------------------------------------------------------------
def check_object(obj: dict, where: str, crd: Path | None = None) -> list[str]:
    if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
        return [f"{where}: not a Kubernetes object (apiVersion and kind)"]
    key = (obj["apiVersion"], obj["kind"])
    where = f"{where} ({obj['kind']} {obj.get('metadata', {}).get('name', '?')})"
    if key in CORE_KINDS:
        return check_k8s_type(obj, CORE_KINDS[key], where)
    if key == ("ray.io/v1", "RayService"):
        return check_rayservice(obj, where, crd)
    if key in SCHEMAS:
        problems = check_schema(obj, SCHEMAS[key], where)
        if obj["kind"] == "PrometheusRule" and not problems:
            series = known_series()
            for g in obj["spec"]["groups"]:
                for r in g["rules"]:
                    problems += check_promql(r["expr"], f"{where} rule {r.get('alert') or r.get('record')}", series)
        return problems
    return [f"{where}: no schema for {key}"]


def check_rayservice(obj: dict, where: str, crd: Path | None = None) -> list[str]:
    import yaml

    from adaptspec.serve.config import check_serve_config

    crd = Path(crd) if crd else SHARED_CRD
    problems = []
    if crd.is_file():
        problems += check_schema(obj, crd_schema(crd, obj["apiVersion"]), where)
    else:
        problems.append(f"{where}: the KubeRay CRD {crd} is absent (give --crd)")
    spec = obj.get("spec", {})
    cluster = spec.get("rayClusterConfig", {})
    groups = [("headGroupSpec", cluster.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs[{i}]", g) for i, g in enumerate(cluster.get("workerGroupSpecs", []))]
    for name, group in groups:
        problems += check_k8s_type(group.get("template", {}), "V1PodTemplateSpec", f"{where}.{name}.template")
    if "serveService" in spec:
        problems += check_k8s_type(dict(spec["serveService"], apiVersion="v1", kind="Service"), "V1Service",
                                   f"{where}.serveService")
    try:
        check_serve_config(yaml.safe_load(spec.get("serveConfigV2", "")))
    except Exception as exc:
        problems.append(f"{where}.serveConfigV2: {exc}")
    return problems


def check_dashboard(path: Path = DASHBOARD) -> list[str]:
    """The Grafana dashboard: its panels, grid and queries (``$variables`` substituted)."""
    where = str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{where}: {exc}"]
    problems = []
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in d:
            problems.append(f"{where}: no {key!r}")
    variables = {v["name"]: (v.get("current", {}).get("value") or v.get("query") or "x")
                 for v in d.get("templating", {}).get("list", [])}
    ids, cells, series = set(), set(), known_series()
    for i, panel in enumerate(d.get("panels", [])):
        pw = f"{where} panel {i} ({panel.get('title', '?')})"
        for key in ("id", "type", "title", "gridPos", "targets"):
            if key not in panel:
                problems.append(f"{pw}: no {key!r}")
        if panel.get("id") in ids:
            problems.append(f"{pw}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        g = panel.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in ("x", "y", "w", "h")) or g.get("x", 0) + g.get("w", 0) > 24:
            problems.append(f"{pw}: gridPos {g} is not inside the 24-column grid")
        else:
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            if mine & cells:
                problems.append(f"{pw}: overlaps another panel")
            cells |= mine
        for j, t in enumerate(panel.get("targets", [])):
            expr = t.get("expr", "")
            for name, value in variables.items():
                expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
            expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
            if not expr:
                problems.append(f"{pw} target {j}: no expr")
                continue
            problems += check_promql(expr, f"{pw} target {j}", series)
    return problems


def check_all(crd: str | Path | None = None) -> list[str]:
    """Every generated file under deploy/kuberay, and the dashboard."""
    import yaml

    problems = []
    for f in sorted((ROOT / "kuberay").rglob("*.yaml")):
        rel = str(f.relative_to(ROOT.parent))
        for i, obj in enumerate(yaml.safe_load_all(f.read_text())):
            if obj is not None:
                problems += check_object(obj, f"{rel}[{i}]", Path(crd) if crd else None)
    return problems + check_dashboard()
