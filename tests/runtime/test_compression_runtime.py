"""Update codecs in the runtime: the server names the codec on join, sites upload its
parts, the server decodes before folding and counts the encoded bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from runtime_support import FakeSite, TinyTask, chunk_messages
from test_secagg_runtime import _daemon, _server, owned  # noqa: F401 (owned: a fixture)

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.runtime import wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.server.audit import read_audit
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

PLAIN = {"enabled": False}
#: TinyTask(features=100): weight (2, 100) and bias (2,), 808 bytes as float32. Top-k
#: 10% sends 20 + 1 entries, each an int32 index and a float32 value: 168 bytes.
TOPK = {"codec": "topk", "fraction": 0.1}
ENCODED_BYTES = (20 + 1) * 8


def test_sites_upload_top_k_parts_and_the_server_folds_them_decoded(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
) -> None:
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=2, rounds=2, secagg=PLAIN, compression=TOPK)
    owned.append(server)
    initial = server.coordinator.global_model.state.clone()
    for i, name in enumerate(("a", "b")):
        owned.append(_daemon(server, task, name, i))
    assert server.wait(90), "the compressed rounds did not finish"
    assert server.coordinator.error is None

    uploads = [r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == "upload"]
    assert len(uploads) == 4 and {r["bytes"] for r in uploads} == {ENCODED_BYTES}
    metrics = server.run_dir.read_metrics()
    assert [m["bytes_in"] for m in metrics] == [2 * ENCODED_BYTES] * 2
    # Two rounds of two sparse updates: at most 2 x 2 x 20 weights moved, of 200.
    moved = server.coordinator.global_model.state["weight"] != initial["weight"]
    assert 0 < int(moved.sum()) <= 80
    assert metrics[-1]["accuracy"] is not None


def test_an_update_in_another_encoding_is_refused(tmp_path: Path, owned: list[Any]) -> None:  # noqa: F811
    task = TinyTask()
    server = _server(tmp_path, task, sites=1, secagg=PLAIN, compression=TOPK)
    owned.append(server)
    fake = FakeSite(server.port, "old", task_fingerprint(task), capabilities=("train",))
    owned.append(fake)
    instruction = fake.expect("instruction").instruction
    manifest, _ = fake.download(instruction.model_version)  # downloads are not encoded
    assert [s.name for s in manifest.specs] == ["weight", "bias"]
    plain = [wire.spec_from_proto(s) for s in manifest.specs]
    zeros = ModelState({s.name: torch.zeros(s.shape) for s in plain})
    header = fake.header(1, model_version=instruction.model_version)  # no codec named
    with pytest.raises(grpc.RpcError) as info:
        fake.upload([header, *chunk_messages(zeros.chunks())])
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "encoded with codec 'none', but this server decodes" in info.value.details()


def test_codecs_are_refused_with_secure_aggregation() -> None:
    with pytest.raises(ConfigError, match="'int8' cannot be combined with secure aggregation"):
        from_dict(ServerConfig, {"task": "t:T", "secagg": True, "compression": "int8"})
    config = from_dict(ServerConfig, {"task": "t:T", "compression": {"codec": "topk"}})
    assert config.compression.build().name == "topk"
