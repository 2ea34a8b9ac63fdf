"""Regenerate the gRPC stubs of fedgc_bridge.proto: ``python -m android_bridge.proto.generate``.

The generated ``fedgc_bridge_pb2.py``, ``fedgc_bridge_pb2.pyi`` and ``fedgc_bridge_pb2_grpc.py``
are committed; run this after editing the ``.proto`` (it needs grpcio-tools, pinned in
pyproject). The proto is compiled from the repository root so that the stubs import each other
as ``android_bridge.proto.*``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "android_bridge/proto/fedgc_bridge.proto"


def generate() -> None:
    """Run protoc (grpc_tools) on the proto; raise RuntimeError when it fails."""
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", str(ROOT / PROTO)]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} on {PROTO}")
    # Generated code follows protoc's style, not ours: keep the linter off it.
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        path = ROOT / PROTO.replace(".proto", suffix)
        text = path.read_text()
        if not text.startswith("# ruff: noqa"):
            path.write_text("# ruff: noqa\n" + text)


if __name__ == "__main__":
    generate()
    sys.exit(0)
