"""A lost replica is UNAVAILABLE to gRPC clients, not INTERNAL.

When a TargetEngine replica dies (its process killed, its node gone) the calls it was
serving fail in Serve's gRPC proxy with Ray's ``RayActorError`` (``ActorDiedError``,
``ActorUnavailableError``), which Ray Serve 2.60's proxy answers with INTERNAL, a code
clients must not retry. Nothing was wrong with those requests: another replica can serve
them, which is what UNAVAILABLE tells a client (gRPC's retry policies retry it). The
engine's own failures already answer UNAVAILABLE (``adaptspec.serve.loop``); this covers
the replica itself.

Serve has no hook for the proxy's status mapping, so this module wraps it: the config lists
``add_to_server`` among ``grpc_servicer_functions``, which Serve imports in every proxy
process; importing this module installs the wrapper there. It registers no servicer. The
wrapper changes only INTERNAL answers to an actor's loss; the integration test
``tests/integration/test_scale_out.py`` kills a replica under load and fails if Serve's
proxy changes so that this no longer holds.
"""
from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger(__name__)
_INSTALLED = False
MESSAGE = "the replica serving this request was lost ({}); retry: another replica serves it"


def replica_lost(exc: BaseException) -> bool:
    """Is ``exc`` (or what it wraps) Ray's report of a lost actor?"""
    from ray.exceptions import RayActorError

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, RayActorError):
            return True
        exc = getattr(exc, "original_exception", None) or exc.__cause__
        seen += 1
    return False


def install() -> bool:
    """Wrap the proxy's status mapping (idempotent); False where Serve's internals differ."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import grpc
        from ray.serve._private import proxy
    except ImportError:
        log.warning("adaptspec: Ray Serve's proxy internals moved; lost replicas answer INTERNAL")
        return False
    original = getattr(proxy, "get_grpc_response_status", None)
    if original is None:
        log.warning("adaptspec: Ray Serve's proxy has no get_grpc_response_status; lost replicas answer INTERNAL")
        return False

    def get_grpc_response_status(exc, request_timeout_s, request_id):
        status = original(exc, request_timeout_s, request_id)
        if status.code == grpc.StatusCode.INTERNAL and replica_lost(exc):
            return dataclasses.replace(status, code=grpc.StatusCode.UNAVAILABLE,
                                       message=MESSAGE.format(type(exc).__name__))
        return status

    get_grpc_response_status.__wrapped__ = original
    proxy.get_grpc_response_status = get_grpc_response_status
    _INSTALLED = True
    return True


def add_to_server(servicer, server) -> None:
    """Listed in ``grpc_servicer_functions`` so that Serve imports this module in its proxies."""
    install()


install()
