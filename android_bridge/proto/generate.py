"""Regenerate the gRPC stubs of the bridge's protos: ``python -m android_bridge.proto.generate``.

The generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` of ``fedgc_bridge.proto`` (phones)
and ``fedgc_bridge_control.proto`` (the ClientApp's side) are committed; run this after editing
a ``.proto`` (it needs grpcio-tools, pinned in pyproject). The protos are compiled from the
repository root so that the stubs import each other as ``android_bridge.proto.*``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("android_bridge/proto/fedgc_bridge.proto",
          "android_bridge/proto/fedgc_bridge_control.proto")


def generate() -> None:
    """Run protoc (grpc_tools) on each proto; raise RuntimeError when it fails."""
    from grpc_tools import protoc

    for proto in PROTOS:
        args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
                f"--grpc_python_out={ROOT}", str(ROOT / proto)]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {proto}")
        # Generated code follows protoc's style, not ours: keep the linter off it.
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = ROOT / proto.replace(".proto", suffix)
            text = path.read_text()
            if not text.startswith("# ruff: noqa"):
                path.write_text("# ruff: noqa\n" + text)


if __name__ == "__main__":
    generate()
    sys.exit(0)
