"""The service configuration: one pydantic model, loadable from YAML.

``ServiceConfig`` is everything an operator writes; ``build_app(config)`` (``app.py``)
turns it into a Ray Serve application and ``serve_config(config)`` into the Ray Serve
config file that ``serve run`` / ``serve deploy`` / a KubeRay RayService accept. Unknown
keys are refused (``extra="forbid"``) so a typo fails loudly instead of being ignored.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_K = 16
POLICIES = ("thompson", "ucb", "ema", "heuristic", "static")
APP_IMPORT_PATH = "adaptspec.serve.app:app_builder"
# the proxy registers these; Serve routes every method of them to the app's ingress deployment
# (TargetEngine), which implements AdaptSpec and the standard grpc.health.v1.Health
SERVICER_FUNCTIONS = ["adaptspec.proto.adaptspec_pb2_grpc.add_AdaptSpecServicer_to_server",
                      "adaptspec.proto.health_pb2_grpc.add_HealthServicer_to_server",
                      # registers nothing: makes the proxy answer UNAVAILABLE for a lost replica
                      "adaptspec.serve.proxy_status.add_to_server"]


def _is_draft_head(spec: str | None) -> bool:
    """A draft-head folder or alias (``draft.json``), checked without loading or pulling anything."""
    from pathlib import Path

    if not spec:
        return False
    from adaptspec.models.registry import BUILTIN

    if spec in BUILTIN:
        return BUILTIN[spec].packaged
    return (Path(spec).expanduser() / "draft.json").is_file()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelsConfig(_Strict):
    target: str = Field("smollm2-135m", description="target model: alias, folder, .gguf or hub id")
    draft: str | None = Field("smollm2-135m-draft",
                              description="draft sharing the target's tokenizer: a draft model or a draft head "
                                          "(the default is the shipped distilled head); null: n-gram only")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights dtype; auto: bfloat16 on CUDA, float32 on the CPU. float32 is the reference "
                               "the token-for-token tests use. On the CPU, "
                               "bfloat16 runs on the C kernel with fp32 compute around bf16 products, 1.4-1.6x "
                               "the tokens/s at 1-16 clients on the 2-core box (deploy/README.md, runs 16-17 "
                               "and 34); without a C compiler it falls back to torch's bf16, slower than "
                               "float32 there (a warning says so)")
    device: str = Field("cpu", description="torch device of the target replica, e.g. cpu or cuda")

    def resolved_dtype(self) -> str:
        """The dtype name ``auto`` stands for on this device."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


class EngineOptions(_Strict):
    max_num_seqs: int = Field(16, ge=1, le=1024, description="KV slots: requests decoded together per replica")
    max_model_len: int = Field(1024, ge=64, description="prompt + output tokens per request (KV memory grows "
                                                       "with max_num_seqs x max_model_len)")
    max_queued: int = Field(64, ge=0, description="requests waiting for a KV slot per replica before "
                                                  "RESOURCE_EXHAUSTED")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens one engine step runs through the target: decode and verification rows "
                                "first, prompt chunks fill the rest (bounds how long a new prompt can hold running "
                                "requests); null: max(256, 4 x max_num_seqs)")
    block_size: int = Field(16, ge=8, multiple_of=8, description="positions per paged-KV block")
    enable_prefix_caching: bool = Field(True, description="reuse the KV of full prompt blocks shared with earlier "
                                                          "requests (a common system prompt is computed once)")
    kv_cache_memory: float | None = Field(
        None, gt=0, description="KV pool size per replica: bytes (> 1) or a fraction of free GPU memory (<= 1); "
                                "null: room for max_num_seqs requests of max_model_len")
    cuda_graphs: bool | None = Field(
        None, description="replay decode and verification steps (no prompt chunk) as CUDA graphs of the target's "
                          "forward, and the draft model's or draft head's drafting passes as graphs of theirs, one "
                          "per token-count bucket: a pass's kernel launches cost one replay; null: on "
                          "for CUDA with the Triton attention backend, off on the CPU; true where they cannot be "
                          "captured is an error at start-up")
    cuda_graph_max_tokens: int = Field(
        512, ge=1, description="largest step (tokens through the target) replayed as a CUDA graph; larger steps run "
                               "eagerly (capped at max_num_batched_tokens; every bucket up to it holds graph memory)")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; null: num_cpus of the replica. "
                                      "On a small CPU host that also runs Ray, the proxy and the clients, 1 makes "
                                      "step times repeat: two threads run the cores in lock step, and any other "
                                      "process taking a core stalls the whole step")
    stall_timeout_s: float = Field(300.0, gt=0, description="an engine step (or a drafter call inside it) that has "
                                   "not returned after this long while requests wait: the engine counts as gone "
                                   "(callers get UNAVAILABLE, health fails, Serve replaces the replica)")
    isolation: Literal["auto", "process", "thread"] = Field(
        "auto", description="where a replica runs its engine: `process` (an engine process of its own next to the "
                            "replica, so Serve's request handling never holds the engine thread's GIL), `thread` (a "
                            "thread of the replica's process) or `auto` (process, but thread for the disaggregated "
                            "placement, whose draft proposer calls Drafter replicas through the replica's handles)")


class TargetAutoscaling(_Strict):
    """Serve autoscaling of the TargetEngine deployment on ongoing requests (replaces num_replicas)."""

    min_replicas: int = Field(1, ge=0, description="fewest TargetEngine replicas")
    max_replicas: int = Field(4, ge=1, description="most TargetEngine replicas (the Ray cluster must be able to "
                                                   "grow to hold them: KubeRay's autoscaler adds worker pods)")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="ongoing requests per replica Serve aims for; null: engine.max_num_seqs (a replica "
                                "scales out when its KV slots are full and requests start to queue)")
    upscale_delay_s: float = Field(30.0, ge=0, description="seconds above target before adding a replica")
    downscale_delay_s: float = Field(600.0, ge=0, description="seconds below target before removing one (a "
                                                              "replica's model load is expensive)")

    @model_validator(mode="after")
    def _order(self) -> "TargetAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        return self


class TargetDeployment(_Strict):
    num_replicas: int = Field(1, ge=1, description="TargetEngine replicas (ignored when autoscaling is set)")
    autoscaling: TargetAutoscaling | None = Field(None, description="Serve autoscaling of the replicas on ongoing "
                                                                     "requests; null: a fixed num_replicas")
    max_queued_requests: int | None = Field(
        None, ge=1, description="calls each Serve proxy holds while every replica is at capacity (max_num_seqs + "
                                "max_queued ongoing each) before answering RESOURCE_EXHAUSTED; null: engine.max_queued")
    num_cpus: float = Field(2.0, ge=0, description="CPUs reserved per TargetEngine replica (also its torch "
                                                   "threads unless engine.torch_threads is set)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per TargetEngine replica")


class DrafterDeployment(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="CPUs per Drafter replica (disaggregated placement)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per Drafter replica (disaggregated placement)")


class ArmConfig(_Strict):
    drafter: Literal["none", "ngram", "draft"] = Field(description="which drafter proposes")
    k: int = Field(ge=0, le=MAX_K, description="candidates per step; 0 means no drafting")

    @model_validator(mode="after")
    def _none_has_k0(self) -> "ArmConfig":
        if (self.drafter == "none") != (self.k == 0):
            raise ValueError(f"k: drafter {self.drafter!r} with k={self.k}; 'none' goes with k=0 and only with it")
        return self


class ClassConfig(_Strict):
    name: str = Field(description="request class label clients send")
    tpot_s: float | None = Field(None, gt=0, description="time-per-output-token target (s); null: throughput class")
    ttft_s: float | None = Field(None, gt=0, description="time-to-first-token target (s)")
    pin: ArmConfig | None = Field(None, description="always use this arm for the class (operators can unpin)")


class ControllerOptions(_Strict):
    policy: str = Field("thompson", description="thompson | ucb | ema | heuristic | static:<drafter>:<k>[/<class>=<drafter>:<k>...]")
    max_k: int = Field(8, ge=1, le=MAX_K, description="largest k the policy may choose")
    report_interval_s: float = Field(
        1.0, gt=0, le=10,
        description="how often replicas send step stats and get a policy snapshot (each report holds the "
                    "replica's GIL for ~2-3 ms of Serve handle work, which stalls its engine thread: 0.25 s "
                    "slowed a lone request by 3-5 percent on the 2-core CPU box)")
    seed: int = Field(0, description="policy random seed")
    fade_half_life_s: float | None = Field(
        30.0, gt=0, description="thompson: seconds of engine steps in which every drafter's acceptance evidence "
                                "loses half its weight, so a drafter that lost is tried again when it may have "
                                "improved; null: only the drafter that ran is discounted (never retried)")
    fade_min_steps: int = Field(
        500, ge=1, description="thompson: ... but never faster than half per this many engine steps (where a step "
                               "takes a second, 30 s would keep a few dozen steps of evidence and scatter the plans "
                               "over arms that differ by noise)")
    niceness: int = Field(
        10, ge=0, le=19, description="CPU niceness of the controller's process (0: unchanged): its bursts of work "
                                     "(reports, plans, checkpoints) then wait for the engine's idle moments instead "
                                     "of taking a core from one of the engine's threads, which stalls every thread "
                                     "of a CPU step")
    checkpoint: str | None = Field(
        "ray", description="where the controller keeps what its policies learned, so a restarted controller "
                           "resumes it: `ray` (Ray's GCS key-value store: survives a controller restart, and a "
                           "head restart with GCS fault tolerance), a file path (e.g. on a volume), or null (memory "
                           "only)")
    checkpoint_interval_s: float = Field(10.0, gt=0, description="seconds between checkpoints (also written after "
                                                                 "every policy update)")
    confidence_thresholds: list[float] = Field(
        default_factory=list,
        description="per-token draft stopping: draft-confidence thresholds the model-based policy may set per class "
                    "(multiples of 0.1 in (0, 1), e.g. [0.3, 0.5, 0.7]); it prices them from the confidences the "
                    "drafters report and live acceptance, and takes one only where it pays; empty: never stops a "
                    "draft early")
    cost_profile: str | None = Field(
        "auto", description="step-cost prior for the model-based policy: a built-in profile name "
                            "(e.g. cpu-smollm2-135m-fp32), a path to an `adaptspec calibrate` JSON, `auto` "
                            "(when SmolLM2-135M runs on the CPU: its step costs as measured on the project's "
                            "test box, adaptspec/data/profiles) or null (learn online only)")

    @field_validator("confidence_thresholds")
    @classmethod
    def _thresholds(cls, v: list[float]) -> list[float]:
        from adaptspec.control.planner import check_thresholds

        return list(check_thresholds(tuple(v), "confidence_thresholds"))

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v.split(":", 1)[0] not in POLICIES:
            raise ValueError(f"policy: {v!r} is not one of {POLICIES} (static as static:<drafter>:<k>)")
        return v


class AdmissionOptions(_Strict):
    """SLO-aware admission (``adaptspec.control.admission``): a request of a class with a TTFT
    target (``classes[].ttft_s``) is refused at once with RESOURCE_EXHAUSTED when the requests
    waiting ahead of it, at the rate the replica has been starting them, would hold it past
    ``slack`` x that target; classes without ``ttft_s`` are always admitted."""

    enabled: bool = Field(False, description="refuse requests that cannot meet their class's TTFT target "
                                             "(RESOURCE_EXHAUSTED at once; a client can retry elsewhere)")
    slack: float = Field(0.8, gt=0, description="admit while the predicted TTFT is within slack x the class's "
                                                "ttft_s (the prediction is a mean: below 1 leaves room for the spread)")


class PacingOptions(_Strict):
    """TPOT-paced prefill (``adaptspec.control.pacing``): while requests of a class with a TPOT
    target (``classes[].tpot_s``) decode, each step's prompt chunks get only what fits in
    ``margin`` x that target x the tokens such a request emits per step, measured on the
    replica's own steps; never so little that a waiting prompt would pass ``slack`` x its
    class's ``ttft_s``. Outputs are unchanged (only when prompt work runs moves)."""

    enabled: bool = Field(False, description="cap each step's prompt chunks for the classes with a TPOT target "
                                             "(a burst of long prompts waits within its TTFT target instead of "
                                             "stretching every decoding request's steps)")
    margin: float = Field(0.9, gt=0, description="a step's time budget: margin x the tightest decoding class's "
                                                 "tpot_s x the tokens its requests emit per step")
    slack: float = Field(0.8, gt=0, description="prompt work is never held past slack x its class's ttft_s")


class FaultInjection(_Strict):
    """For tests and chaos drills: make a drafter raise."""

    drafter: Literal["ngram", "draft"] = Field("ngram", description="the drafter that fails")
    after_calls: int = Field(0, ge=0, description="calls that succeed before failures start")
    every: int = Field(1, ge=1, description="then fail every n-th call (1: always)")


class AuthConfig(_Strict):
    admin_token_env: str = Field(
        "ADAPTSPEC_ADMIN_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the admin token that UpdatePolicy and GetPolicy need (metadata "
                    "`authorization: Bearer <token>`); unset: the token in $ADAPTSPEC_HOME/admin-token, which "
                    "`adaptspec serve` creates (mode 0600); neither: admin calls are refused")
    grpc_api_keys: bool = Field(
        True, description="gRPC Generate, GenerateStream and GetStats need one of the HTTP API's keys "
                          "(`http.api_keys_env`; metadata `authorization: Bearer <key>`) once keys are configured; "
                          "false: only the HTTP API asks for a key (keep gRPC inside a closed network)")


class HttpApiOptions(_Strict):
    """The OpenAI-compatible HTTP API (``adaptspec.serve.openai_api``) on Serve's HTTP proxy."""

    enabled: bool = Field(True, description="serve /v1/chat/completions, /v1/completions, /v1/models and /health "
                                            "on the HTTP proxy (http_port, under /<app_name>) beside gRPC")
    api_keys_env: str = Field(
        "ADAPTSPEC_API_KEYS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable with the accepted API keys, comma-separated, or the path (starting "
                    "with /) of a file holding them, one per line (a Kubernetes Secret volume; re-read when it "
                    "changes); unset or empty: no key is needed")
    default_class: str = Field("default", description="request class when neither the x-adaptspec-class header "
                                                      "nor metadata.request_class names one")
    model_name: str | None = Field(None, description="the model id clients send and /v1/models lists; null: "
                                                     "models.target as written")


class ServiceConfig(_Strict):
    """The whole service: models, engine, deployments, controller, classes, network."""

    app_name: str = Field("adaptspec", description="Serve application name; gRPC clients send it as the "
                                                   "`application` metadata key")
    host: str = Field("0.0.0.0", description="proxy bind address (HTTP; gRPC binds all interfaces)")
    grpc_port: int = Field(9000, ge=1, le=65535, description="Serve gRPC proxy port")
    http_port: int = Field(8000, ge=1, le=65535, description="Serve HTTP proxy port (the OpenAI-compatible API, "
                                                                 "Serve's health)")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="draft model in the target's replica, or in separate Drafter replicas")
    models: ModelsConfig = Field(default_factory=ModelsConfig, description="target and draft models")
    engine: EngineOptions = Field(default_factory=EngineOptions, description="per-replica engine limits")
    target: TargetDeployment = Field(default_factory=TargetDeployment, description="TargetEngine replicas")
    drafter: DrafterDeployment = Field(default_factory=DrafterDeployment, description="Drafter replicas")
    controller: ControllerOptions = Field(default_factory=ControllerOptions, description="speculation controller")
    classes: list[ClassConfig] = Field(
        default_factory=lambda: [ClassConfig(name="chat"), ClassConfig(name="code_edit"),
                                 ClassConfig(name="extraction"), ClassConfig(name="default")],
        description="known request classes")
    strict_classes: bool = Field(False, description="refuse unknown classes (INVALID_ARGUMENT) instead of "
                                                    "mapping them to `default`")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when the request leaves it unset")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    faults: FaultInjection | None = Field(None, description="inject drafter faults (tests, chaos drills)")
    admission: AdmissionOptions = Field(default_factory=AdmissionOptions,
                                        description="SLO-aware admission by each class's TTFT target")
    pacing: PacingOptions = Field(default_factory=PacingOptions,
                                  description="TPOT-paced prefill by each class's TPOT target")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="who may call the admin methods")
    http: HttpApiOptions = Field(default_factory=HttpApiOptions, description="the OpenAI-compatible HTTP API")
    allow_client_speculation: bool = Field(
        True, description="may a request choose its own arm (`speculation`)? A large k costs every request in the "
                          "batch, so shared deployments turn this off (PERMISSION_DENIED)")
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request (INVALID_ARGUMENT beyond)")
    max_stop_chars: int = Field(256, ge=1, description="characters per stop string (INVALID_ARGUMENT beyond)")
    max_prompt_bytes: int = Field(1 << 20, ge=1, description="UTF-8 bytes of a prompt's text, checked before it is "
                                                             "tokenized (INVALID_ARGUMENT beyond)")

    @model_validator(mode="after")
    def _check(self) -> "ServiceConfig":
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"classes: duplicate names in {names}")
        if "default" not in names:
            self.classes.append(ClassConfig(name="default"))
        if self.http.default_class not in self.class_names:
            raise ValueError(f"http.default_class: {self.http.default_class!r} is not a class ({', '.join(self.class_names)})")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens: {self.default_max_tokens} exceeds max_tokens_limit "
                             f"{self.max_tokens_limit}")
        if self.placement == "disaggregated" and not self.models.draft:
            raise ValueError("placement: disaggregated needs models.draft")
        if self.placement == "disaggregated" and _is_draft_head(self.models.draft):
            raise ValueError(f"placement: models.draft {self.models.draft!r} is a draft head, which drafts from the "
                             "target's hidden states and runs colocated only (disaggregated heads are not built "
                             "yet); use placement: colocated or an independent draft model")
        if self.placement == "disaggregated" and self.engine.isolation == "process":
            raise ValueError("engine.isolation: process is not available with placement: disaggregated (the draft "
                             "proposer calls Drafter replicas through the replica's Ray handles); use thread or auto")
        return self

    @property
    def engine_isolation(self) -> str:
        """``engine.isolation`` with ``auto`` resolved."""
        if self.engine.isolation != "auto":
            return self.engine.isolation
        return "thread" if self.placement == "disaggregated" else "process"

    @property
    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def drafters(self) -> tuple[str, ...]:
        """Drafters the replicas will have."""
        return ("ngram", "draft") if self.models.draft else ("ngram",)


def load_config(path: str | Path | None) -> ServiceConfig:
    """Read a YAML service config (None: the embedded default)."""
    if path is None:
        return ServiceConfig()
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping")
    return ServiceConfig.model_validate(data)


def serve_config(config: ServiceConfig) -> dict:
    """The Ray Serve config (``ServeDeploySchema`` shape) that deploys this service."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": config.host, "port": config.http_port},
        "grpc_options": {"port": config.grpc_port, "grpc_servicer_functions": SERVICER_FUNCTIONS,
                         "enable_reflection": True},
        "applications": [{
            "name": config.app_name,
            "route_prefix": f"/{config.app_name}",
            "import_path": APP_IMPORT_PATH,
            "args": config.model_dump(mode="json"),
        }],
    }


def write_serve_config(config: ServiceConfig, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.write_text("# Ray Serve config for AdaptSpec: `serve run` or `serve deploy` this file.\n"
                    + yaml.safe_dump(serve_config(config), sort_keys=False))
    return path


def check_serve_config(data: dict) -> None:
    """Validate a Serve config with ``ServeDeploySchema``, then refuse keys the schema would
    ignore (it accepts typos silently), and validate our application's ``args`` strictly."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(data)
    _unknown_keys(ServeDeploySchema, data, "")
    for i, app in enumerate(data.get("applications", [])):
        if app.get("import_path") == APP_IMPORT_PATH:
            try:
                ServiceConfig.model_validate(app.get("args") or {})
            except ValueError as exc:
                raise ValueError(f"applications[{i}].args: {exc}") from None


def _unknown_keys(model, data, where: str) -> None:
    import typing

    if not isinstance(data, dict):
        return
    fields = model.model_fields
    names = {n for n in fields} | {f.alias for f in fields.values() if f.alias}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"{where}{key}: unknown key in the Serve config (known: {', '.join(sorted(names))})")
        if key == "args" and model.__name__ == "ServeApplicationSchema":
            continue  # free-form in Serve; ours is checked against ServiceConfig
        ann = fields[key].annotation if key in fields else None
        for sub in _models_in(ann, typing):
            if isinstance(value, list):
                for j, item in enumerate(value):
                    _unknown_keys(sub, item, f"{where}{key}[{j}].")
            else:
                _unknown_keys(sub, value, f"{where}{key}.")
            break


def _models_in(ann, typing) -> list:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    out = []
    for arg in typing.get_args(ann):
        out += _models_in(arg, typing)
    return out
