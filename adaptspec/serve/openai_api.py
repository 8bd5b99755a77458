"""The OpenAI-compatible HTTP API, served by the same replicas as the gRPC methods.

``build_openai_app(host)`` returns the FastAPI app a TargetEngine replica serves behind Ray
Serve's HTTP proxy (``http_port``, under the application's route prefix ``/<app_name>``;
``app.build_app`` wraps the deployment with ``serve.ingress()``, and Serve calls
``Ingress.__serve_build_asgi_app__`` once the replica is up):

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streamed as server-sent
  events (``data: {chunk}`` lines, then ``data: [DONE]``) or not;
- ``GET /v1/models`` (and ``/v1/models/{id}``): the one model this application serves;
- ``GET /health``: 200 while the replica's engine runs, 503 otherwise (no key: probes).

A request becomes the ``EngineRequest`` the gRPC path builds and goes to the same engine
loop (``host.engine_stream``): the same admission, the controller's arm for its class, the
same abort when the caller goes away (the stream is closed, which aborts the request and
frees its KV slot). Chat messages go through the model's chat template here, on the
replica, and reach the engine as text it tokenizes as is (``raw``): one user message gives
exactly the prompt the gRPC path's server-side template gives.

Input is checked, never ignored: a field this server does not implement is a 400 naming
it, unless it carries its default (``n: 1``, ``logprobs: false``, ``tools: []`` ...).
Extensions (vLLM's names where vLLM has one): ``top_k``, ``ignore_eos``,
``return_token_ids`` (the choice carries ``token_ids``); the request class comes from the
``x-adaptspec-class`` header, else ``metadata.request_class``, else ``http.default_class``;
every response carries ``adaptspec`` (class, drafted, accepted, arms, timings).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad
input (``param`` names the field), 401 no API key, 403 a wrong key, 404 an unknown model,
429 the replica's queue is full (gRPC's RESOURCE_EXHAUSTED), 503 the engine is gone
(UNAVAILABLE). API keys (``http.api_keys_env``) are checked in constant time with
``adaptspec.serve.auth``.

Needs from its host: ``config`` (``ServiceConfig``), ``engine_stream(EngineRequest)``,
``serving()`` and ``loop.tokenizer`` (the replica's tokenizer, for the chat template).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptspec.engine.params import SamplingParams
from adaptspec.serve import auth
from adaptspec.serve.convert import resolve_class
from adaptspec.serve.types import INTERNAL, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, EngineChunk, EngineRequest

CLASS_HEADER = "x-adaptspec-class"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# gRPC status name (the engine loop's error chunks) -> HTTP status, OpenAI error type
_STATUS = {
    INVALID_ARGUMENT: (400, "invalid_request_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    UNAVAILABLE: (503, "service_unavailable_error"),
    INTERNAL: (500, "server_error"),
}

# OpenAI fields this server does not implement, with the values that ask for nothing (sent by
# clients that fill in defaults): those are accepted, any other value is a 400 naming the field
_DEFAULT_ONLY: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "store": (None, False), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "prediction": (None,), "audio": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}


_GRPC_CODE = {400: INVALID_ARGUMENT, 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
              429: RESOURCE_EXHAUSTED, 503: UNAVAILABLE}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.request_class = "default"  # for the refusal metric: the class once it is known
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                              404: "not_found_error", 429: "rate_limit_error",
                              503: "service_unavailable_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 401:
            headers["www-authenticate"] = "Bearer"
        elif self.status in (429, 503):
            headers["retry-after"] = "1"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ---- requests -------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk (empty choices) carries the usage")


class _Sampling(_Strict):
    model: str = Field(description="the served model's id (GET /v1/models)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: default_max_tokens)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy (default 1, as OpenAI)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension (vLLM): keep the k likeliest; 0 or -1: off")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="reproduces a sampled output under the same arm")
    stop: str | list[str] | None = None
    user: str | None = Field(None, description="the caller's end-user id; accepted, not used")
    metadata: dict[str, str] | None = Field(None, description="`request_class` picks the class; other keys are "
                                                                "accepted as labels")
    ignore_eos: bool = Field(False, description="extension (vLLM): keep generating past end-of-sequence")
    return_token_ids: bool = Field(False, description="extension (vLLM): choices carry `token_ids`")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


# ---- responses ------------------------------------------------------------------------------------
def _omit_none(v) -> bool:
    return v is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens the prefix cache served")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(None, exclude_if=_omit_none)


class AdaptSpecInfo(BaseModel):
    """The extension every response carries (on the last chunk when streaming)."""

    request_class: str
    drafted: int = Field(description="candidate tokens the drafters proposed")
    accepted: int = Field(description="drafted tokens the verifier kept")
    acceptance_rate: float
    mean_accepted_length: float = Field(description="tokens emitted per step (accepted + 1)")
    steps: int
    arms: dict[str, int] = Field(description="arm (drafter:k) -> engine steps the request ran on it")
    ttft_s: float
    e2e_s: float


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    adaptspec: AdaptSpecInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)
    adaptspec: AdaptSpecInfo | None = Field(None, exclude_if=_omit_none)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class Completion(BaseModel):
    """Both the response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)
    adaptspec: AdaptSpecInfo | None = Field(None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# ---- API keys -------------------------------------------------------------------------------------
class ApiKeys(auth.ApiKeys):
    """``auth.ApiKeys`` with HTTP answers: 401 without a key, 403 with a wrong one, 503 (closed)
    when the key source cannot be read."""

    def current(self) -> tuple[str, ...]:
        try:
            return super().current()
        except auth.KeysUnavailable as exc:
            raise ApiError(503, str(exc), code="api_keys_unavailable") from None

    def check(self, request: Request) -> None:
        verdict = self.verdict(auth.parse_bearer(request.headers.get("authorization")))
        if verdict is auth.Verdict.MISSING:
            raise ApiError(401, "an API key is needed: send the header 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        if verdict is not auth.Verdict.OK:
            raise ApiError(403, "the API key is not valid", code="invalid_api_key")


# ---- request -> EngineRequest ---------------------------------------------------------------------
def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in list(body):
        if key in _DEFAULT_ONLY:
            if body[key] not in _DEFAULT_ONLY[key]:
                allowed = ", ".join(json.dumps(v) for v in _DEFAULT_ONLY[key])
                raise ApiError(400, f"{key}: {json.dumps(body[key])[:200]} is not supported by this server (accepted: "
                                    f"{allowed})", key, "unsupported_parameter")
            del body[key]
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"{param}: unknown or unsupported field", param, "unsupported_parameter") from None
        raise ApiError(400, f"{param}: {err['msg']}", param) from None


def _common(r: _Sampling, config, headers, *, max_tokens: int | None) -> tuple[str, SamplingParams]:
    """The request class and the sampling parameters, checked against the deployment's limits."""
    http = config.http
    if r.model != served_model(config):
        raise ApiError(404, f"model: {r.model!r} is not served here (GET /v1/models lists {served_model(config)!r})",
                       "model", "model_not_found")
    named = headers.get(CLASS_HEADER)
    where = CLASS_HEADER
    if named is None and r.metadata and "request_class" in r.metadata:
        named, where = r.metadata["request_class"], "metadata.request_class"
    try:
        cls = resolve_class(named or http.default_class, config)
    except ValueError as exc:
        raise ApiError(400, f"{where}: {str(exc).split(': ', 1)[-1]}", where) from None
    n = max_tokens if max_tokens is not None else config.default_max_tokens
    if n > config.max_tokens_limit:
        raise ApiError(400, f"max_tokens: {n} is more than this deployment's limit ({config.max_tokens_limit})",
                       "max_tokens")
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stop) > config.max_stop_strings:
        raise ApiError(400, f"stop: {len(stop)} stop strings, at most {config.max_stop_strings}", "stop")
    for i, s in enumerate(stop):
        if not s:
            raise ApiError(400, f"stop[{i}]: empty stop string", "stop")
        if len(s) > config.max_stop_chars:
            raise ApiError(400, f"stop[{i}]: {len(s)} characters, at most {config.max_stop_chars}", "stop")
    temperature = 1.0 if r.temperature is None else r.temperature
    params = SamplingParams(max_new_tokens=n, temperature=float(temperature),
                            top_p=1.0 if r.top_p is None else float(r.top_p), top_k=max(0, r.top_k or 0),
                            seed=r.seed, stop=stop, ignore_eos=r.ignore_eos)
    return cls, params


def _check_prompt_size(n_bytes: int, config, param: str) -> None:
    if n_bytes > config.max_prompt_bytes:
        raise ApiError(400, f"{param}: {n_bytes} bytes, at most {config.max_prompt_bytes}", param)


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text: the messages through the model's chat template with the assistant's turn
    opened; without a template, one user message as it is (the gRPC path does the same)."""
    msgs = []
    for m in messages:
        d = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.name is not None:
            d["name"] = m.name
        msgs.append(d)
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template raised (e.g. roles must alternate): the messages are at fault
            raise ApiError(400, f"messages: the model's chat template refused them: {exc}", "messages") from None
    if len(msgs) == 1 and msgs[0]["role"] == "user":
        return msgs[0]["content"]
    raise ApiError(400, "messages: this model has no chat template; send a single user message", "messages")


def chat_request(r: ChatCompletionRequest, config, headers, tokenizer) -> EngineRequest:
    if r.max_tokens is not None and r.max_completion_tokens is not None and r.max_tokens != r.max_completion_tokens:
        raise ApiError(400, "max_completion_tokens: differs from max_tokens; send one of them",
                       "max_completion_tokens")
    cls, params = _common(r, config, headers, max_tokens=r.max_completion_tokens or r.max_tokens)
    _check_prompt_size(sum(len(m.text.encode("utf-8")) for m in r.messages), config, "messages")
    if not any(m.text.strip() for m in r.messages):
        raise ApiError(400, "messages: every message is empty", "messages")
    prompt = chat_prompt(tokenizer, r.messages)
    return EngineRequest(request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}", request_class=cls, params=params,
                         prompt=prompt, raw=True, stream=r.stream)


def completion_request(r: CompletionRequest, config, headers) -> EngineRequest:
    cls, params = _common(r, config, headers, max_tokens=r.max_tokens)
    prompt: Any = r.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts; send one prompt per request", "prompt")
        prompt = prompt[0]
    text, ids = (prompt, []) if isinstance(prompt, str) else ("", list(prompt))
    if not ids and not text.strip():
        raise ApiError(400, "prompt: empty prompt", "prompt")
    if any(t < 0 for t in ids):
        raise ApiError(400, "prompt: token ids must be >= 0", "prompt")
    if len(ids) > config.engine.max_model_len:
        raise ApiError(400, f"prompt: {len(ids)} tokens, more than the context ({config.engine.max_model_len})",
                       "prompt")
    _check_prompt_size(len(text.encode("utf-8")), config, "prompt")
    return EngineRequest(request_id=f"cmpl-{uuid.uuid4().hex[:24]}", request_class=cls, params=params,
                         prompt=text, prompt_token_ids=ids, raw=True, stream=r.stream)


# ---- EngineChunk -> response ----------------------------------------------------------------------
def served_model(config) -> str:
    return config.http.model_name or config.models.target


def _error_of(chunk: EngineChunk, request_class: str = "default") -> ApiError:
    status, type_ = _STATUS.get(chunk.error.code, (500, "server_error"))
    msg = chunk.error.message
    m = re.match(r"(\w+)(?:\[\d+\])?[:=]", msg) if status == 400 else None
    param = {"prompt_token_ids": "prompt"}.get(m.group(1), m.group(1)) if m else None
    code = {429: "queue_full", 503: "engine_unavailable"}.get(status)
    err = ApiError(status, msg, param, code, type_)
    err.request_class = request_class
    return err


def _finish_reason(chunk: EngineChunk) -> str:
    return "length" if chunk.finish_reason == "length" else "stop"


def _usage(c: EngineChunk) -> Usage:
    return Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                 total_tokens=c.prompt_tokens + c.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=c.cached_prompt_tokens) if c.finished else None)


def _info(c: EngineChunk, request_class: str) -> AdaptSpecInfo:
    return AdaptSpecInfo(request_class=request_class, drafted=c.drafted, accepted=c.accepted,
                         acceptance_rate=c.accepted / c.drafted if c.drafted else 0.0,
                         mean_accepted_length=c.mean_accepted_length, steps=c.steps, arms=dict(c.arms),
                         ttft_s=c.ttft_s, e2e_s=c.e2e_s)


class _Responder:
    """Builds one request's response body or chunks (chat or completion)."""

    def __init__(self, req: EngineRequest, chat: bool, model: str, r: _Sampling):
        self.req, self.chat, self.model = req, chat, model
        self.created = int(time.time())
        self.token_ids = r.return_token_ids
        self.include_usage = bool(r.stream_options and r.stream_options.include_usage)

    def whole(self, c: EngineChunk) -> BaseModel:
        ids = list(c.all_token_ids) if self.token_ids else None
        common = dict(id=self.req.request_id, created=self.created, model=self.model, usage=_usage(c),
                      adaptspec=_info(c, self.req.request_class))
        if self.chat:
            return ChatCompletion(object="chat.completion", **common, choices=[ChatChoice(
                index=0, message=ChatMessageOut(content=c.text), finish_reason=_finish_reason(c), logprobs=None,
                token_ids=ids)])
        return Completion(object="text_completion", **common, choices=[CompletionChoice(
            index=0, text=c.text, finish_reason=_finish_reason(c), logprobs=None, token_ids=ids)])

    def _chunk(self, text: str | None, finish: str | None, ids: list[int] | None, *, role: bool = False,
               info: AdaptSpecInfo | None = None, usage: Usage | None = None, empty: bool = False) -> bytes:
        common = dict(id=self.req.request_id, created=self.created, model=self.model, adaptspec=info, usage=usage)
        if self.chat:
            choices = [] if empty else [ChatChunkChoice(index=0, delta=Delta(role="assistant" if role else None,
                                                                               content=text),
                                                        finish_reason=finish, logprobs=None, token_ids=ids)]
            body = ChatCompletionChunk(object="chat.completion.chunk", choices=choices, **common)
        else:
            choices = [] if empty else [CompletionChoice(index=0, text=text or "", finish_reason=finish,
                                                         logprobs=None, token_ids=ids)]
            body = Completion(object="text_completion", choices=choices, **common)
        return b"data: " + body.model_dump_json().encode() + b"\n\n"

    def first(self) -> bytes | None:
        """Chat streams open with the assistant's role (as OpenAI's do)."""
        return self._chunk("", None, [] if self.token_ids else None, role=True) if self.chat else None

    def delta(self, c: EngineChunk) -> bytes | None:
        ids = list(c.token_ids) if self.token_ids else None
        if not c.finished:
            if not c.text and not ids:
                return None  # text held back (a partial character, a possible stop string's beginning)
            return self._chunk(c.text, None, ids)
        out = self._chunk(c.text, _finish_reason(c), ids, info=_info(c, self.req.request_class))
        if self.include_usage:
            out += self._chunk(None, None, None, usage=_usage(c), empty=True)
        return out


def _sse_error(err: ApiError) -> bytes:
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that closes the engine stream however it ends: when the client goes away
    before or while the body is sent, closing the stream aborts the request and frees its slot."""

    def __init__(self, body, chunks):
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._chunks.aclose()


def _record(host, err: ApiError | None = None, finished: EngineChunk | None = None, request_class: str = "") -> None:
    """The per-request metrics the gRPC methods record too (when the host has them)."""
    m = getattr(host, "metrics", None)
    if m is None:
        return
    if err is not None:
        m.observe_refused(err.request_class, _GRPC_CODE.get(err.status, INTERNAL))
    elif finished is not None:
        m.observe_latency(request_class, finished.ttft_s, finished.e2e_s, finished.completion_tokens)


async def _events(host, first: EngineChunk, chunks, out: _Responder):
    head = out.first()
    if head is not None:
        yield head
    chunk = first
    while True:
        if chunk.error is not None:  # the engine went away mid-stream: the status is already sent
            err = _error_of(chunk, out.req.request_class)
            _record(host, err)
            yield _sse_error(err)
            break
        data = out.delta(chunk)
        if data is not None:
            yield data
        if chunk.finished:
            _record(host, finished=chunk, request_class=out.req.request_class)
            break
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            yield _sse_error(ApiError(500, "the engine stream ended without a final chunk", code="internal_error"))
            break
    yield b"data: [DONE]\n\n"


async def _run(host, req: EngineRequest, out: _Responder) -> Response:
    chunks = host.engine_stream(req)
    try:
        # the first item is a refusal (answered with its status) or the first tokens (unary: the end)
        first = await chunks.__anext__()
    except BaseException:
        await chunks.aclose()
        raise
    if first.error is not None:
        await chunks.aclose()
        raise _error_of(first, req.request_class)
    if not req.stream:
        await chunks.aclose()
        _record(host, finished=first, request_class=req.request_class)
        return Response(out.whole(first).model_dump_json(), media_type="application/json")
    return _EventStream(_events(host, first, chunks, out), chunks)


# ---- the app --------------------------------------------------------------------------------------
def build_openai_app(host) -> FastAPI:
    """The HTTP routes of one replica; ``host``: the replica (see the module's docstring)."""
    config = host.config
    keys = ApiKeys(config.http.api_keys_env)
    model = served_model(config)
    created = int(time.time())
    app = FastAPI(title="AdaptSpec (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        _record(host, exc)
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()

    @app.get("/health")
    async def health():
        if not host.serving():  # answered, not raised: a probe is not a refused request (metrics)
            return ApiError(503, "the replica's engine is not running", code="engine_unavailable").response()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        keys.check(request)
        card = ModelCard(id=model, object="model", created=created, owned_by="adaptspec")
        return Response(ModelList(object="list", data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request):
        keys.check(request)
        if model_id != model:
            raise ApiError(404, f"model: {model_id!r} is not served here", "model", "model_not_found")
        card = ModelCard(id=model, object="model", created=created, owned_by="adaptspec")
        return Response(card.model_dump_json(), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        keys.check(request)
        r = _parse(ChatCompletionRequest, await request.body())
        req = chat_request(r, config, request.headers, host.loop.tokenizer)
        return await _run(host, req, _Responder(req, True, model, r))

    @app.post("/v1/completions")
    async def completions(request: Request):
        keys.check(request)
        r = _parse(CompletionRequest, await request.body())
        req = completion_request(r, config, request.headers)
        return await _run(host, req, _Responder(req, False, model, r))

    return app

