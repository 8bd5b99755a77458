"""Ingress: the gRPC servicer methods that Ray Serve's gRPC proxy calls.

It validates (INVALID_ARGUMENT naming the field), resolves the request class, and hands
the request to the replica's engine loop, streaming tokens back as they are accepted. When
the client's deadline passes or it cancels, Serve cancels this call; the cancellation
reaches the engine loop's stream, which aborts the request and frees its KV slot.

``Ingress`` is a mixin of the ``TargetEngine`` deployment rather than a deployment of its
own: the proxy routes each call straight to an engine replica (Serve's router picks the
replica), so a request crosses one Ray hop, not two. A separate Ingress deployment cost a
whole Ray Serve handle call per request (about 8 ms on a busy 2-core machine) for work
that takes microseconds. The class needs from its host: ``config`` (``ServiceConfig``),
``engine_stream(EngineRequest)`` (async iterator of ``EngineChunk``; rules in
``adaptspec.serve.loop``), ``controller`` (a handle) and ``serving()`` (bool, for health).
It imports neither torch nor the models.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.proto import health_pb2
from adaptspec.serve import convert
from adaptspec.serve.types import INVALID_ARGUMENT, UNAVAILABLE

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdaptSpec"].full_name  # adaptspec.v1.AdaptSpec
HEALTH_WATCH_INTERVAL_S = 1.0


class RequestRefused(Exception):
    """Raised after setting the gRPC status on the context (Serve keeps the user's code)."""


class Ingress:
    """The ``adaptspec.v1.AdaptSpec`` and ``grpc.health.v1.Health`` servicer methods."""

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        try:
            req = convert.to_engine_request(request, self.config, stream=False)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            return pb.GenerateResponse()
        # aclosing: when Serve cancels this call (deadline, client gone), the engine stream's
        # own cleanup (abort, free the slot) runs now, not whenever the generator is collected
        async with contextlib.aclosing(self.engine_stream(req)) as chunks:
            async for chunk in chunks:
                if chunk.error is not None:
                    _refuse(grpc_context, chunk.error.code, chunk.error.message)
                    return pb.GenerateResponse()
                if chunk.finished:
                    return convert.to_response(chunk, req.request_class)
        _refuse(grpc_context, "INTERNAL", "the engine stream ended without a final chunk")
        return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context):
        try:
            req = convert.to_engine_request(request, self.config, stream=True)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            raise RequestRefused(str(exc)) from None
        async with contextlib.aclosing(self.engine_stream(req)) as chunks:
            async for chunk in chunks:
                if chunk.error is not None:
                    _refuse(grpc_context, chunk.error.code, chunk.error.message)
                    raise RequestRefused(chunk.error.message)
                yield convert.to_chunk(chunk, req.request_class)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context) -> pb.GetStatsResponse:
        out = await self._ask_controller(grpc_context, "stats")
        return pb.GetStatsResponse() if out is None else convert.to_stats(out)

    async def GetPolicy(self, request: pb.GetPolicyRequest, grpc_context) -> pb.PolicyState:
        out = await self._ask_controller(grpc_context, "policy")
        return pb.PolicyState() if out is None else convert.to_policy_state(out)

    async def _ask_controller(self, grpc_context, method: str, *args):
        """The controller's answer, or None after setting UNAVAILABLE (it is restarting, say)."""
        try:
            return await getattr(self.controller, method).remote(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _refuse(grpc_context, UNAVAILABLE, f"the controller is unavailable ({type(exc).__name__}); retry")
            return None

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, grpc_context) -> pb.PolicyState:
        try:
            upd = convert.to_policy_update(request)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            return pb.PolicyState()
        out = await self._ask_controller(grpc_context, "update_policy", upd)
        if out is None:
            return pb.PolicyState()
        if isinstance(out, str):
            _refuse(grpc_context, INVALID_ARGUMENT, out)
            return pb.PolicyState()
        return convert.to_policy_state(out)

    # ---- grpc.health.v1.Health ------------------------------------------------------------
    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """SERVING while this replica's engine loop runs. Service "" (the server as a whole)
        and ``adaptspec.v1.AdaptSpec`` are known; any other name is NOT_FOUND (the protocol)."""
        status = self._health_status(request.service)
        if status is None:
            _refuse(grpc_context, "NOT_FOUND", f"service: unknown service {request.service!r} "
                                               f"(known: '', {SERVICE_NAME!r})")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context):
        """The current status, then every change (checked each second) until the client goes."""
        last = None
        while True:
            status = self._health_status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # Watch reports it, Check refuses
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(HEALTH_WATCH_INTERVAL_S)

    def _health_status(self, service: str):
        if service not in ("", SERVICE_NAME):
            return None
        return health_pb2.HealthCheckResponse.SERVING if self.serving() else health_pb2.HealthCheckResponse.NOT_SERVING


def _refuse(ctx, code: str, message: str) -> None:
    ctx.set_code(getattr(grpc.StatusCode, code))
    ctx.set_details(message)
