"""Build and run the service: ``build_app(config) -> Application``, the ``serve run``
builder, and the embedded mode (a local Ray started in-process)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from adaptspec.serve.config import SERVICER_FUNCTIONS, ServiceConfig

# Ray Serve settings for the request path, read by every Ray process at start-up (the proxy,
# the replicas), so they go in the environment of the Ray cluster: ``start`` sets them before
# it starts a local Ray, and the KubeRay manifest puts them on every container. What they
# saved on the 2-core CPU box: docs/results/service-runs.md ("gRPC + Serve overhead").
# - the proxy calls the replica over Serve's inter-deployment gRPC instead of a Ray actor
#   task (the larger part of the gain; the client still talks to Serve's gRPC proxy);
# - the replica runs the servicer methods on its own event loop (ours only await queues;
#   the engine runs apart from them) and the proxy's router on its loop, instead of a
#   hand-off to a separate thread and loop per call;
# - Serve's per-request log lines go to the log files only, not also to stderr;
# - the garbage collector is frozen after start-up (the models' objects are never garbage).
SERVE_LATENCY_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
}


def build_app(config: ServiceConfig):
    """The Serve application: TargetEngine replicas (the ingress: they serve the gRPC methods
    themselves, ``Ingress`` being their mixin), with the Controller singleton (and a Drafter
    replica holding the draft model when ``placement: disaggregated``)."""
    from adaptspec.serve.controller import Controller
    from adaptspec.serve.target import TargetEngine

    if config.http.enabled:  # the OpenAI-compatible HTTP routes, served by the same replicas as gRPC
        from ray import serve

        # a call Serve's proxy refuses (every replica full, its queue full) is a 429 over HTTP, as
        # the engine's own refusals are (gRPC: RESOURCE_EXHAUSTED either way)
        TargetEngine = TargetEngine.options(  # noqa: N806
            func_or_class=serve.ingress()(TargetEngine.func_or_class),
            backpressure_config={"status_code": 429, "retry_after_s": 1})
    args = config.model_dump(mode="json")
    controller = Controller.bind(args)
    drafter = None
    if config.placement == "disaggregated":
        from adaptspec.serve.drafter import Drafter

        drafter = Drafter.options(
            num_replicas=1,  # one shared Drafter keeps every request's mirror in one place (sticky)
            ray_actor_options={"num_cpus": config.drafter.num_cpus, "num_gpus": config.drafter.num_gpus},
        ).bind(args)
    return TargetEngine.options(
        ray_actor_options={"num_cpus": config.target.num_cpus, "num_gpus": config.target.num_gpus},
        **target_options(config),
    ).bind(args, controller, drafter)


def target_options(config: ServiceConfig) -> dict:
    """Serve options of the TargetEngine deployment that follow the engine's capacity.

    ``max_ongoing_requests`` is exactly what one replica's engine holds (KV slots + its
    queue; it used to be 1,024 against an engine holding 80). Serve's router never sends a
    replica more, so a call goes to a replica with room (the proxy prefers the replicas on
    its own node, then any other: without this limit a proxy's local replica took every call
    and refused what its engine could not hold while others idled). When every replica is
    full, each proxy holds up to ``max_queued_requests`` calls until one frees, then answers
    RESOURCE_EXHAUSTED. Serve's router counts a call as queued until it is assigned, replicas
    with room or not, so a burst of more calls than that arriving at once can be refused while
    places are open: keep it above the bursts clients send (the default, engine.max_queued, is
    64). Stats, policy and health calls count as ongoing requests too: on a
    deployment whose every replica is full they wait their turn (the Kubernetes probes go to
    the proxies, not here). Autoscaling, when configured, aims at ``target_ongoing_requests``
    per replica (default: the KV slots, so a replica is added as requests start to wait)."""
    eng, tgt = config.engine, config.target
    opts: dict = {"max_ongoing_requests": eng.max_num_seqs + eng.max_queued,
                  "max_queued_requests": tgt.max_queued_requests if tgt.max_queued_requests is not None
                  else max(eng.max_queued, 1)}
    if tgt.autoscaling is None:
        opts["num_replicas"] = tgt.num_replicas
    else:
        a = tgt.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests or float(eng.max_num_seqs),
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
    return opts


def app_builder(args: dict):
    """``import_path`` of the written Serve config: ``args`` is a ``ServiceConfig`` mapping."""
    return build_app(ServiceConfig.model_validate(args or {}))


@dataclass(slots=True)
class Running:
    config: ServiceConfig
    address: str  # host:port of the gRPC proxy (loopback)


def start(config: ServiceConfig, *, num_cpus: int | None = None) -> Running:
    """Start a local Ray (unless one is connected), Serve with the gRPC proxy, and the app."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from adaptspec.serve.auth import ensure_token

    # the admin token: the operator's variable, else $ADAPTSPEC_HOME/admin-token (created once,
    # mode 0600), which the replicas on this machine and the CLI read
    try:
        ensure_token(config.auth.admin_token_env)
    except OSError as exc:  # a read-only home, say: the service runs, its admin calls stay closed
        import logging

        logging.getLogger(__name__).warning("no admin token (%s): GetPolicy/UpdatePolicy are refused; set $%s",
                                            exc, config.auth.admin_token_env)
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts workers at niceness 15; the engine replica is the service, not background work
        os.environ.setdefault("RAY_worker_niceness", "0")
        for name, value in SERVE_LATENCY_ENV.items():  # an operator's own setting wins
            os.environ.setdefault(name, value)
        # address="local": a Ray of its own, never one another process on this machine has started
        ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False,
                 object_store_memory=512 * 1024**2,  # requests and stats are small; don't reserve 30% of RAM
                 log_to_driver=False, configure_logging=True, logging_level="WARNING")
    serve.start(http_options={"host": config.host, "port": config.http_port},
                grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS,
                                         enable_reflection=True))
    serve.run(build_app(config), name=config.app_name, route_prefix=f"/{config.app_name}")
    return Running(config, f"127.0.0.1:{config.grpc_port}")


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
