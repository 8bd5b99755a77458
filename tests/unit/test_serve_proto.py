"""The generated stubs in adaptspec/proto match protos/ (run `make protos` when this fails)."""
from __future__ import annotations

import pytest

pytest.importorskip("grpc_tools")


def test_stubs_are_fresh():
    from adaptspec.serve.protogen import OUT, generate

    for name, text in generate().items():
        assert (OUT / name).read_text() == text, f"adaptspec/proto/{name} is stale: run `make protos`"


def test_method_names_are_unique_for_the_proxy():
    # Serve's gRPC proxy routes on the method name alone
    # across every service the proxy registers (the API and grpc.health.v1.Health)
    from adaptspec.proto import adaptspec_pb2, health_pb2

    names = [m.name for mod in (adaptspec_pb2, health_pb2)
             for s in mod.DESCRIPTOR.services_by_name.values() for m in s.methods]
    assert len(names) == len(set(names))
    assert {"Generate", "GenerateStream", "GetStats", "GetPolicy", "UpdatePolicy", "Check", "Watch"} <= set(names)
