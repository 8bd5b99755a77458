"""Ingress: the gRPC servicer behind Ray Serve's gRPC proxy.

It validates (INVALID_ARGUMENT naming the field), resolves the request class, and hands
the request to a TargetEngine replica, streaming tokens back as they are accepted. When
the client's deadline passes or it cancels, Serve cancels this call; the cancellation
reaches the TargetEngine stream, which aborts the request and frees its KV slot.
"""
from __future__ import annotations

import grpc
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.serve import convert
from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.types import INVALID_ARGUMENT


class RequestRefused(Exception):
    """Raised after setting the gRPC status on the context (Serve keeps the user's code)."""


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
class Ingress:
    def __init__(self, config: dict, target, controller):
        self.config = ServiceConfig.model_validate(config)
        self.target = target.options(stream=True, method_name="generate")
        self.controller = controller

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResponse:
        try:
            req = convert.to_engine_request(request, self.config, stream=False)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            return pb.GenerateResponse()
        async for chunk in self.target.remote(req):
            if chunk.error is not None:
                _refuse(grpc_context, chunk.error.code, chunk.error.message)
                return pb.GenerateResponse()
            if chunk.finished:
                return convert.to_response(chunk, req.request_class)
        _refuse(grpc_context, "INTERNAL", "the engine stream ended without a final chunk")
        return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        try:
            req = convert.to_engine_request(request, self.config, stream=True)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            raise RequestRefused(str(exc)) from None
        async for chunk in self.target.remote(req):
            if chunk.error is not None:
                _refuse(grpc_context, chunk.error.code, chunk.error.message)
                raise RequestRefused(chunk.error.message)
            yield convert.to_chunk(chunk, req.request_class)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context: RayServegRPCContext) -> pb.GetStatsResponse:
        return convert.to_stats(await self.controller.stats.remote())

    async def GetPolicy(self, request: pb.GetPolicyRequest, grpc_context: RayServegRPCContext) -> pb.PolicyState:
        return convert.to_policy_state(await self.controller.policy.remote())

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest,
                           grpc_context: RayServegRPCContext) -> pb.PolicyState:
        try:
            upd = convert.to_policy_update(request)
        except ValueError as exc:
            _refuse(grpc_context, INVALID_ARGUMENT, str(exc))
            return pb.PolicyState()
        out = await self.controller.update_policy.remote(upd)
        if isinstance(out, str):
            _refuse(grpc_context, INVALID_ARGUMENT, out)
            return pb.PolicyState()
        return convert.to_policy_state(out)


def _refuse(ctx: RayServegRPCContext, code: str, message: str) -> None:
    ctx.set_code(getattr(grpc.StatusCode, code))
    ctx.set_details(message)
