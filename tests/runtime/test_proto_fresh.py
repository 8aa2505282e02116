"""The committed generated modules must match fedtrain.proto (regenerate when this fails)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from fedtrain.runtime.proto import generate

# Lines that only name the generator's version: a newer grpcio-tools is not staleness.
VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*|\s+\d+,|GRPC_GENERATED_VERSION = .*)$", re.MULTILINE
)


def _normalized(path: Path) -> str:
    return VERSION_LINES.sub("<version>", path.read_text())


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    committed = Path(generate.__file__).parent
    for path in fresh:
        assert _normalized(path) == _normalized(committed / path.name), (
            f"{committed / path.name} is stale: run `python -m fedtrain.runtime.proto.generate` "
            "and commit the result"
        )


def test_generated_grpc_module_imports_pb2_by_package_path() -> None:
    text = (Path(generate.__file__).parent / "fedtrain_pb2_grpc.py").read_text()
    assert "from fedtrain.runtime.proto import fedtrain_pb2" in text
