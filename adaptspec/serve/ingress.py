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
import logging

import grpc

from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.proto import health_pb2
from adaptspec.serve import auth, convert
from adaptspec.serve.types import INVALID_ARGUMENT, UNAVAILABLE

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdaptSpec"].full_name  # adaptspec.v1.AdaptSpec
HEALTH_WATCH_INTERVAL_S = 1.0


class RequestRefused(Exception):
    """Raised after setting the gRPC status on the context (Serve keeps the user's code)."""


class Ingress:
    """The ``adaptspec.v1.AdaptSpec`` and ``grpc.health.v1.Health`` servicer methods."""

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        if (refusal := self._key_refusal(grpc_context, "Generate")) is not None:
            self._refused(request, grpc_context, *refusal)
            return pb.GenerateResponse()
        if (refusal := request_refusal(request, self.config)) is not None:
            self._refused(request, grpc_context, *refusal)
            return pb.GenerateResponse()
        try:
            req = convert.to_engine_request(request, self.config, stream=False)
        except ValueError as exc:
            self._refused(request, grpc_context, INVALID_ARGUMENT, str(exc))
            return pb.GenerateResponse()
        # aclosing: when Serve cancels this call (deadline, client gone), the engine stream's
        # own cleanup (abort, free the slot) runs now, not whenever the generator is collected
        async with contextlib.aclosing(self.engine_stream(req)) as chunks:
            async for chunk in chunks:
                if chunk.error is not None:
                    self._refused(request, grpc_context, chunk.error.code, chunk.error.message)
                    return pb.GenerateResponse()
                if chunk.finished:
                    self._finished(chunk, req.request_class)
                    return convert.to_response(chunk, req.request_class)
        _refuse(grpc_context, "INTERNAL", "the engine stream ended without a final chunk")
        return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context):
        if (refusal := self._key_refusal(grpc_context, "GenerateStream")) is not None:
            self._refused(request, grpc_context, *refusal)
            raise RequestRefused(refusal[1])
        if (refusal := request_refusal(request, self.config)) is not None:
            self._refused(request, grpc_context, *refusal)
            raise RequestRefused(refusal[1])
        try:
            req = convert.to_engine_request(request, self.config, stream=True)
        except ValueError as exc:
            self._refused(request, grpc_context, INVALID_ARGUMENT, str(exc))
            raise RequestRefused(str(exc)) from None
        async with contextlib.aclosing(self.engine_stream(req)) as chunks:
            async for chunk in chunks:
                if chunk.error is not None:
                    self._refused(request, grpc_context, chunk.error.code, chunk.error.message)
                    raise RequestRefused(chunk.error.message)
                if chunk.finished:
                    self._finished(chunk, req.request_class)
                yield convert.to_chunk(chunk, req.request_class)

    def _refused(self, request: pb.GenerateRequest, grpc_context, code: str, message: str) -> None:
        _refuse(grpc_context, code, message)
        if (m := getattr(self, "metrics", None)) is not None:
            # the class as configured, never the client's string (unbounded label values)
            name = request.request_class if request.request_class in self.config.class_names else "default"
            m.observe_refused(name, code)

    def _finished(self, chunk, request_class: str) -> None:
        if (m := getattr(self, "metrics", None)) is not None:
            m.observe_latency(request_class, chunk.ttft_s, chunk.e2e_s, chunk.completion_tokens)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context) -> pb.GetStatsResponse:
        if (refusal := self._key_refusal(grpc_context, "GetStats")) is not None:
            _refuse(grpc_context, *refusal)
            return pb.GetStatsResponse()
        out = await self._ask_controller(grpc_context, "stats")
        return pb.GetStatsResponse() if out is None else convert.to_stats(out)

    async def GetPolicy(self, request: pb.GetPolicyRequest, grpc_context) -> pb.PolicyState:
        if not self._admin(grpc_context, "GetPolicy"):
            return pb.PolicyState()
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

    def _key_refusal(self, grpc_context, what: str) -> tuple[str, str] | None:
        """(code, message) when the call lacks a valid API key (``auth.grpc_api_keys`` and keys
        configured): UNAUTHENTICATED without one, PERMISSION_DENIED with a wrong one, UNAVAILABLE
        when the server's key file cannot be read (closed, never open)."""
        if not self.config.auth.grpc_api_keys:
            return None
        keys = self.__dict__.get("_api_keys")
        if keys is None:
            keys = self._api_keys = auth.ApiKeys(self.config.http.api_keys_env)
        try:
            verdict = keys.verdict(auth.bearer_from_metadata(grpc_context.invocation_metadata()))
        except auth.KeysUnavailable as exc:
            log.error("API keys unusable: %s", exc)
            return UNAVAILABLE, f"{what}: the server's API keys are unavailable; see its configuration"
        if verdict is auth.Verdict.OK:
            return None
        if verdict is auth.Verdict.MISSING:
            return ("UNAUTHENTICATED", f"{what} needs an API key: send gRPC metadata 'authorization: Bearer <key>' "
                                       "(the CLI and Client read $ADAPTSPEC_API_KEY)")
        return "PERMISSION_DENIED", f"{what}: the API key is not valid"

    def _admin(self, grpc_context, what: str) -> bool:
        """Is the caller an admin? Otherwise the status is set: UNAUTHENTICATED without a bearer
        token, PERMISSION_DENIED with a wrong one (or when the server has none). The token is
        read per call (admin calls are rare) so a rotated token file takes effect at once."""
        try:
            expected = auth.load_token(self.config.auth.admin_token_env)
        except (OSError, ValueError) as exc:  # a token file others can read, say: closed, and say why
            _refuse(grpc_context, "PERMISSION_DENIED", f"{what} is closed: the server's admin token is unusable "
                                                       f"({type(exc).__name__}; see the replica's log)")
            log.error("admin token unusable: %s", exc)  # names the path, never the secret
            return False
        verdict = auth.check(auth.bearer_from_metadata(grpc_context.invocation_metadata()), expected)
        if verdict is auth.Verdict.OK:
            return True
        _refuse(grpc_context, verdict.grpc_code, auth.refusal_message(verdict, what))
        return False

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, grpc_context) -> pb.PolicyState:
        if not self._admin(grpc_context, "UpdatePolicy"):
            return pb.PolicyState()
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

    # ---- the OpenAI-compatible HTTP API ------------------------------------------------------
    def __serve_build_asgi_app__(self):
        """Serve calls this once the replica is up when ``app.build_app`` wrapped the deployment
        with ``serve.ingress()`` (``http.enabled``): the HTTP routes, served beside these methods."""
        from adaptspec.serve.openai_api import build_openai_app

        return build_openai_app(self)

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


def request_refusal(request: pb.GenerateRequest, config) -> tuple[str, str] | None:
    """(status code, message) when a GenerateRequest breaks the deployment's rules, checked
    before any work (the prompt is not tokenized yet): client-chosen speculation where the
    config forbids it, too many or too long stop strings, a prompt over the byte limit."""
    if request.HasField("speculation") and not config.allow_client_speculation:
        return ("PERMISSION_DENIED", "speculation: this deployment chooses the arm itself "
                                     "(allow_client_speculation is off); leave speculation unset")
    if len(request.stop) > config.max_stop_strings:
        return (INVALID_ARGUMENT, f"stop: {len(request.stop)} stop strings, at most {config.max_stop_strings}")
    for i, s in enumerate(request.stop):
        if len(s) > config.max_stop_chars:
            return (INVALID_ARGUMENT, f"stop[{i}]: {len(s)} characters, at most {config.max_stop_chars}")
    size = len(request.prompt.encode("utf-8"))
    if size > config.max_prompt_bytes:
        return (INVALID_ARGUMENT, f"prompt: {size} bytes, at most {config.max_prompt_bytes}")
    if len(request.prompt_token_ids) > config.engine.max_model_len:
        return (INVALID_ARGUMENT, f"prompt_token_ids: {len(request.prompt_token_ids)} tokens, more than the "
                                  f"context (engine.max_model_len {config.engine.max_model_len})")
    return None


def _refuse(ctx, code: str, message: str) -> None:
    ctx.set_code(getattr(grpc.StatusCode, code))
    ctx.set_details(message)
