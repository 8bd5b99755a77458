"""Generate the Python gRPC stubs in ``adaptspec/proto`` from ``protos/`` (``make protos``).

protoc names the generated module after the proto path (``adaptspec.v1``); the import
line and the module name are pointed at ``adaptspec.proto``, where the stubs live. The stale-stub test runs the
same generation into a temporary folder and compares.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "adaptspec" / "proto"
# proto path -> generated module stem; the stubs of each land in adaptspec/proto
PROTOS = {"adaptspec/v1/adaptspec.proto": "adaptspec", "grpc/health/v1/health.proto": "health"}
FILES = tuple(f"{stem}{suffix}" for stem in PROTOS.values() for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate() -> dict[str, str]:
    """Return {file name: content} of freshly generated stubs."""
    from grpc_tools import protoc

    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", *(str(PROTO_ROOT / p) for p in PROTOS)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        for proto, stem in PROTOS.items():
            gen = Path(tmp) / Path(proto).parent
            pkg = ".".join(Path(proto).parent.parts)  # the module path protoc assumed, e.g. adaptspec.v1
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                out[f"{stem}{suffix}"] = (gen / f"{stem}{suffix}").read_text()
            out[f"{stem}_pb2_grpc.py"] = out[f"{stem}_pb2_grpc.py"].replace(
                f"from {pkg} import {stem}_pb2", f"from adaptspec.proto import {stem}_pb2")
            # message classes take their __module__ from this string; pickling (Ray) must import it
            out[f"{stem}_pb2.py"] = out[f"{stem}_pb2.py"].replace(
                f"'{pkg}.{stem}_pb2'", f"'adaptspec.proto.{stem}_pb2'")
    return out


def write() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    init = OUT / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs (``make protos``); never edited by hand."""\n')
    for name, text in generate().items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    write()
