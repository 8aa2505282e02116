"""A partly federated task in a deployment: the frozen base never travels, and a site
holding another base is refused at join."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from runtime_support import FakeSite, inprocess_server

from fedtrain.config import from_dict
from fedtrain.examples import FrozenBaseTask
from fedtrain.run_dir import RunDir
from fedtrain.runtime.config import ServerConfig, SiteConfig
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.site.daemon import SiteDaemon
from fedtrain.task import task_fingerprint

OPTIONS = {"num_train": 600, "num_test": 200, "hidden": 64}
HEAD_BYTES = (2 * 64 + 2) * 4  # float32 head; the 20 x 64 base would be 5,376 bytes more


def _daemon(port: int, task: FrozenBaseTask, name: str, part: int) -> SiteDaemon:
    raw = {
        "task": "fedtrain.examples:FrozenBaseTask",
        "task_options": OPTIONS,
        "name": name,
        "server": f"127.0.0.1:{port}",
        "data": {"kind": "iid", "partition": part, "num_partitions": 3, "seed": 1},
        "reconnect": {"min_s": 0.1, "max_s": 0.5},
    }
    daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True, task=task)
    threading.Thread(target=daemon.run, daemon=True).start()
    return daemon


@pytest.mark.parametrize("secagg", [False, True], ids=["plain", "secagg"])
def test_only_the_head_is_downloaded_uploaded_aggregated_and_checkpointed(
    tmp_path: Path, stop_after: list[Any], secagg: bool
) -> None:
    task = FrozenBaseTask(**OPTIONS)
    extra: dict[str, Any] = {
        "rounds": 2,
        "chunk_bytes": 4096,
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
    }
    if secagg:
        extra["secagg"] = {"enabled": True, "clip": 4.0, "max_clients": 8, "max_weight": 1000.0}
    server = inprocess_server(tmp_path, task, 3, **extra)
    stop_after.append(server)
    for i, name in enumerate("abc"):
        stop_after.append(_daemon(server.port, task, name, i))
    assert server.wait(90), "the run did not finish"
    assert server.coordinator.error is None
    assert list(server.coordinator.global_model.state) == ["2.weight", "2.bias"]
    _, checkpointed, _, _ = RunDir(tmp_path / "run").load_checkpoint()
    assert list(checkpointed) == ["2.weight", "2.bias"]
    uploads = [r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == "upload"]
    assert len(uploads) == 6
    # a masked upload is the head as uint32 plus its masked weight; a plain one the head
    assert all(r["bytes"] <= HEAD_BYTES + 8 for r in uploads), uploads
    assert all(r["masked"] == secagg for r in uploads)


def test_a_site_holding_another_frozen_base_is_refused_at_join(
    tmp_path: Path, stop_after: list[Any]
) -> None:
    task = FrozenBaseTask(**OPTIONS)
    server = inprocess_server(tmp_path, task, 1)
    stop_after.append(server)
    other = task_fingerprint(FrozenBaseTask(**OPTIONS, base_seed=1))
    with pytest.raises(AssertionError, match="reject") as info:
        FakeSite(server.port, "hospital-b", other)
    assert "frozen base model differs" in str(info.value)
    assert "same base weights" in str(info.value)


def test_a_partly_federated_run_resumes_from_its_checkpointed_head(
    tmp_path: Path, stop_after: list[Any]
) -> None:
    task = FrozenBaseTask(**OPTIONS)
    server = inprocess_server(tmp_path, task, 1, rounds=1, chunk_bytes=4096)
    stop_after.append(server)
    stop_after.append(_daemon(server.port, task, "a", 0))
    assert server.wait(60) and server.coordinator.error is None
    head = server.coordinator.global_model.state
    server.stop()
    raw = {
        "task": "fedtrain.examples:FrozenBaseTask",
        "task_options": OPTIONS,
        "address": "127.0.0.1:0",
        "run_dir": str(tmp_path / "run"),
        "rounds": 2,
        "strategy": {"min_fit_clients": 1, "min_available_clients": 1},
    }
    resumed = AggregationServer(from_dict(ServerConfig, raw), insecure=True, task=task, resume=True)
    stop_after.append(resumed)
    assert resumed.coordinator.global_model.state.equal(head)
    assert resumed.coordinator.global_model.round == 1
