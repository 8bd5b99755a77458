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
PROTO = "adaptspec/v1/adaptspec.proto"
OUT = ROOT / "adaptspec" / "proto"
FILES = ("adaptspec_pb2.py", "adaptspec_pb2.pyi", "adaptspec_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Return {file name: content} of freshly generated stubs."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        gen = Path(tmp) / "adaptspec" / "v1"
        out = {name: (gen / name).read_text() for name in FILES}
    out["adaptspec_pb2_grpc.py"] = out["adaptspec_pb2_grpc.py"].replace(
        "from adaptspec.v1 import adaptspec_pb2", "from adaptspec.proto import adaptspec_pb2")
    # message classes take their __module__ from this string; pickling (Ray) must import it
    out["adaptspec_pb2.py"] = out["adaptspec_pb2.py"].replace(
        "'adaptspec.v1.adaptspec_pb2'", "'adaptspec.proto.adaptspec_pb2'")
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
