"""Build and run the service: ``build_app(config) -> Application``, the ``serve run``
builder, and the embedded mode (a local Ray started in-process)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from adaptspec.serve.config import SERVICER_FUNCTIONS, ServiceConfig

# Ray Serve settings for the request path, read by every Ray process at start-up (the proxy,
# the replicas), so they go in the environment of the Ray cluster: ``start`` sets them before
# it starts a local Ray, and the KubeRay manifest puts them on every container. Measured on
# the 2-core CPU box (deploy/README.md, "gRPC + Serve overhead"): a Health/Check round trip
# 8.0-8.3 -> 3.2-5.1 ms p50, a Generate's time outside the engine 10.7-11.6 -> 6.8-8.7 ms p50.
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
        num_replicas=config.target.num_replicas,
        ray_actor_options={"num_cpus": config.target.num_cpus, "num_gpus": config.target.num_gpus},
    ).bind(args, controller, drafter)


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

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts workers at niceness 15; the engine replica is the service, not background work
        os.environ.setdefault("RAY_worker_niceness", "0")
        for name, value in SERVE_LATENCY_ENV.items():  # an operator's own setting wins
            os.environ.setdefault(name, value)
        ray.init(num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False,
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
