"""Bad input through the gRPC servicer, Ray-free: INVALID_ARGUMENT naming the field.

Issue 30, bug 3: only the slow Ray integration test sent bad input to the servicer, so a
servicer that answered INTERNAL went unnoticed by the default run. Here the real
``Ingress`` methods run on a host whose ``engine_stream`` is a real ``EngineLoop`` over a
tiny engine, with a fake gRPC context (the status a servicer sets is all Serve's proxy
sends back). Each bad request is refused by the layer that can tell: the request's own
fields (``convert``), the engine (token ids outside the vocabulary, a length past the
context), or the engine loop (a drafter this replica lacks).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from adaptspec.serve.client import request


class _Ctx:
    """What the servicer uses of a grpc.aio context."""

    def __init__(self):
        self.code = self.details = None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def invocation_metadata(self):
        return ()


@pytest.fixture(scope="module")
def host(tiny_dir):
    from adaptspec import Engine
    from adaptspec.serve.config import ServiceConfig
    from adaptspec.serve.ingress import Ingress
    from adaptspec.serve.loop import EngineLoop

    # no draft model here, while the config's replicas have one: the loop refuses "draft"
    eng = Engine.from_pretrained(str(tiny_dir), max_num_seqs=2, max_model_len=128)
    loop = EngineLoop(eng, max_queued=4)

    class Host(Ingress):
        config = ServiceConfig.model_validate({"strict_classes": False})

        def engine_stream(self, req):
            return loop.generate(req)

        def serving(self):
            return loop.alive

    yield Host()
    loop.stop()


def _unary(host, req):
    ctx = _Ctx()
    resp = asyncio.run(host.Generate(req, ctx))
    return ctx, resp


def _stream(host, req):
    from adaptspec.serve.ingress import RequestRefused

    ctx = _Ctx()

    async def run():
        chunks = []
        try:
            async for c in host.GenerateStream(req, ctx):
                chunks.append(c)
        except RequestRefused:
            pass
        return chunks
    return ctx, asyncio.run(run())


BAD = [  # (request fields, the field the message must name, who refuses)
    (dict(prompt="t1 t2", top_k=-1), "top_k"),  # convert
    (dict(prompt="t1", temperature=float("nan")), "temperature"),
    (dict(prompt="t1", prompt_token_ids=[1]), "prompt"),
    (dict(prompt="t1", max_tokens=0), "max_tokens"),
    (dict(prompt="t1", stop=[""]), "stop"),
    (dict(prompt="t1", stop=["a"] * 17), "stop"),  # the deployment's limit (max_stop_strings 16)
    (dict(prompt="t1", speculation=("medusa", 2)), "speculation.drafter"),
    (dict(prompt="t1", speculation=("ngram", 40)), "speculation.k"),
    (dict(prompt_token_ids=[1, 99]), "prompt_token_ids"),  # the engine: vocabulary of 16
    (dict(prompt_token_ids=[1, 2, 3], max_tokens=500), "max_tokens"),  # the engine: past max_model_len 128
    (dict(prompt_token_ids=[1, 2, 3], speculation=("draft", 2)), "speculation.drafter"),  # the loop: no draft here
]


@pytest.mark.parametrize("fields,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(host, fields, field):
    for call in (_unary, _stream):
        ctx, out = call(host, request(**fields))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT, (call.__name__, ctx.code, ctx.details)
        assert field in ctx.details, (call.__name__, ctx.details)
        if call is _stream:
            assert out == []  # nothing streamed before the refusal


def test_good_input_is_answered(host):
    ctx, resp = _unary(host, request(prompt_token_ids=[1, 2, 3], max_tokens=5, ignore_eos=True))
    assert ctx.code is None and len(resp.token_ids) == 5 and resp.finish_reason == "length"
    ctx, chunks = _stream(host, request(prompt_token_ids=[1, 2, 3], max_tokens=5, ignore_eos=True,
                                        speculation=("ngram", 3)))
    assert ctx.code is None and sum(len(c.token_ids) for c in chunks) == 5
