"""Regenerate fedtrain_pb2.py / fedtrain_pb2_grpc.py from fedtrain.proto.

The proto is compiled with the package root as include path, so the generated gRPC
module imports `fedtrain.runtime.proto.fedtrain_pb2` by its full name and needs no
sys.path tricks. `python -m fedtrain.runtime.proto.generate [OUT_ROOT]` writes into
the source tree (or under OUT_ROOT, which the freshness test compares).
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("fedtrain.proto")
#: The proto's path relative to the package root: it is also its name in descriptors.
PROTO_NAME = "fedtrain/runtime/proto/fedtrain.proto"
PACKAGE_ROOT = PROTO.parents[3]
GENERATED = ("fedtrain_pb2.py", "fedtrain_pb2_grpc.py")


def generate(out_root: Path = PACKAGE_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the generated files' paths."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit(
            "grpcio-tools is not installed; `pip install grpcio-tools` (the dev extra)"
        ) from None
    import importlib.resources

    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PACKAGE_ROOT / PROTO_NAME),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (command: {' '.join(args[1:])})")
    out_dir = out_root / Path(PROTO_NAME).parent
    return [out_dir / name for name in GENERATED]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_ROOT
    for path in generate(target):
        print(path)
