"""A small gRPC client for the service (the CLI, loadtest, demo and tests use it)."""
from __future__ import annotations

import os

import grpc

from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.proto import adaptspec_pb2_grpc as pb_grpc
from adaptspec.proto import health_pb2, health_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:9000"
API_KEY_ENV = "ADAPTSPEC_API_KEY"  # the client's key (the server's keys: http.api_keys_env)


class Client:
    """Adds the ``application`` metadata the Serve proxy routes on."""

    def __init__(self, address: str = DEFAULT_ADDRESS, app_name: str = "adaptspec", *, token: str | None = None,
                 token_file: str | None = None, api_key: str | None = None):
        """``token``: the admin token for GetPolicy / UpdatePolicy; default: ``token_file`` if
        given, else $ADAPTSPEC_ADMIN_TOKEN, else ``$ADAPTSPEC_HOME/admin-token`` (read at the
        first admin call, and sent with admin calls only). ``api_key``: sent with Generate,
        GenerateStream and GetStats (a server with API keys configured asks for one); default
        $ADAPTSPEC_API_KEY, none when unset."""
        self.address, self.app_name = address, app_name
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.AdaptSpecStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("application", app_name),)
        self._token, self._token_file = token, token_file
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "").strip()
        self.data_metadata = self.metadata + ((("authorization", f"Bearer {key}"),) if key else ())

    @property
    def admin_metadata(self) -> tuple:
        from adaptspec.serve import auth

        if self._token is None:
            self._token = auth.client_token(path=self._token_file) or ""
        return self.metadata + ((auth.authorization_metadata(self._token),) if self._token else ())

    def generate(self, prompt: str = "", *, timeout: float | None = None, **fields) -> pb.GenerateResponse:
        return self.stub.Generate(request(prompt, **fields), metadata=self.data_metadata, timeout=timeout)

    def stream(self, prompt: str = "", *, timeout: float | None = None, **fields):
        """An iterator of GenerateChunk; ``.cancel()`` on it cancels the call."""
        return self.stub.GenerateStream(request(prompt, **fields), metadata=self.data_metadata, timeout=timeout)

    def stats(self, timeout: float | None = 10) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), metadata=self.data_metadata, timeout=timeout)

    def policy(self, timeout: float | None = 10) -> pb.PolicyState:
        return self.stub.GetPolicy(pb.GetPolicyRequest(), metadata=self.admin_metadata, timeout=timeout)

    def update_policy(self, policy: str = "", pins: dict[str, tuple[str, int]] | None = None,
                      unpin: list[str] | None = None, timeout: float | None = 10,
                      reset: bool = False) -> pb.PolicyState:
        req = pb.UpdatePolicyRequest(policy=policy, unpin=unpin or [], reset=reset,
                                     pin=[pb.Pin(request_class=c, arm=pb.Arm(drafter=d, k=k))
                                          for c, (d, k) in (pins or {}).items()])
        return self.stub.UpdatePolicy(req, metadata=self.admin_metadata, timeout=timeout)

    def health(self, service: str = "", timeout: float | None = 10):
        """``grpc.health.v1.Health/Check``: the status of the server ("") or of one service."""
        return self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=self.metadata,
                                      timeout=timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def request(prompt: str = "", *, prompt_token_ids=None, request_class: str = "", max_tokens: int | None = None,
            temperature: float | None = None, top_p: float | None = None, top_k: int = 0, seed: int | None = None,
            stop=None, raw: bool = False, speculation: tuple[str, int] | None = None,
            ignore_eos: bool = False) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=prompt, prompt_token_ids=list(prompt_token_ids or []), raw=raw,
                             request_class=request_class, top_k=top_k, stop=list(stop or []), ignore_eos=ignore_eos)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if seed is not None:
        req.seed = seed
    if speculation is not None:
        req.speculation.CopyFrom(pb.Arm(drafter=speculation[0], k=speculation[1]))
    return req
