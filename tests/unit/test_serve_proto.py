"""The generated stubs in adaptspec/proto match protos/ (run `make protos` when this fails)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("grpc_tools")


# what the generator stamps with its own version (the runtime floor the stubs check): a newer
# grpcio-tools / protoc than the one the committed stubs came from is not a change of the protos
_STAMPS = (re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"), re.compile(r"# Protobuf Python Version: \S+"),
           re.compile(r"(_runtime_version\.Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n"))


def _unstamped(text: str) -> str:
    for pat in _STAMPS:
        text = pat.sub(lambda m: (m.group(1) if pat.groups else "") + "<generator version>", text)
    return text


def test_stubs_are_fresh():
    from adaptspec.serve.protogen import OUT, generate

    for name, text in generate().items():
        assert _unstamped((OUT / name).read_text()) == _unstamped(text), \
            f"adaptspec/proto/{name} is stale: run `make protos`"


def test_the_staleness_check_ignores_only_the_generators_version_stamps():
    from adaptspec.serve.protogen import OUT

    text = (OUT / "adaptspec_pb2_grpc.py").read_text()
    newer = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'", text)
    assert newer != text and _unstamped(newer) == _unstamped(text)
    pb2 = (OUT / "adaptspec_pb2.py").read_text()
    bumped = re.sub(r"(Domain\.PUBLIC,\n\s*)\d+", r"\g<1>99", pb2)
    assert bumped != pb2 and _unstamped(bumped) == _unstamped(pb2)
    # negative control: a changed method name is still stale
    assert _unstamped(text.replace("GenerateStream", "GenerateStreams")) != _unstamped(text)


def test_method_names_are_unique_for_the_proxy():
    # Serve's gRPC proxy routes on the method name alone
    # across every service the proxy registers (the API and grpc.health.v1.Health)
    from adaptspec.proto import adaptspec_pb2, health_pb2

    names = [m.name for mod in (adaptspec_pb2, health_pb2)
             for s in mod.DESCRIPTOR.services_by_name.values() for m in s.methods]
    assert len(names) == len(set(names))
    assert {"Generate", "GenerateStream", "GetStats", "GetPolicy", "UpdatePolicy", "Check", "Watch"} <= set(names)
