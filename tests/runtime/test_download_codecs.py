"""Download codecs in the runtime: offered by the server, taken per site at join, the
sites train from what they decode, and the server's byte counters show the saving."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import Deployment, FakeSite, TinyTask
from test_secagg_runtime import _daemon, _server, owned  # noqa: F401 (owned: a fixture)

from fedtrain.compression.downlink import capability
from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.runtime import wire
from fedtrain.runtime.config import ServerConfig, SiteConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.site import daemon as daemon_module
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState, assemble

PLAIN = {"enabled": False}
#: TinyTask(features=100): weight (2, 100) and bias (2,): 202 values.
FLOAT32_BYTES = 202 * 4
FP16_BYTES = 202 * 2
#: int8 of the change: a byte per value, and a float32 min and scale per tensor.
INT8_CHANGE_BYTES = 202 + 2 * 2 * 4
INT8_DELTA = {"codec": "int8", "delta": True}
EVERYTHING = tuple(capability(c) for c in ("fp16", "bf16", "int8", "topk", "delta"))


def _download(fake: FakeSite, version: str, held: str = "") -> tuple[pb.Manifest, ModelState]:
    """The manifest and the tensors (as they travel) of one download by `fake`."""
    request = pb.ModelRequest(version=version, session_token=fake.token, held_version=held)
    pieces = list(fake.stub.DownloadModel(request))
    manifest = pieces[0].manifest
    specs = manifest.parts if manifest.codec else manifest.specs
    chunks = [wire.chunk_from_proto(p.chunk) for p in pieces[1:]]
    return manifest, assemble(chunks, tuple(wire.spec_from_proto(s) for s in specs))


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_deployment_with_fp16_downloads_trains_on_half_the_download_bytes(
    tmp_path: Path,
) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        task_options={"features": 100},
        rounds=3,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
        download="fp16",
    ) as dep:
        dep.start_server()
        for i, name in enumerate(("a", "b")):
            dep.start_site(
                name,
                task_options={"features": 100},
                data={"partition": i, "num_partitions": 2},
            )
        assert dep.wait_server(90) == 0, dep.log("server")
        dep.close()
    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    # Each round both sites download the new model: half of float32's bytes each.
    assert [r["bytes_out"] for r in metrics] == [2 * FP16_BYTES] * 3
    # it learned from the fp16 models (2 classes, chance 0.5; fresh training seeds each run)
    assert metrics[-1]["accuracy"] > 0.65
    assert "the server sends the model encoded with fp16" in dep.log("a")


def test_sites_following_delta_downloads_hold_the_servers_reference_bit_for_bit(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
) -> None:
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=2, rounds=4, secagg=PLAIN, download=INT8_DELTA)
    owned.append(server)
    daemons = [_daemon(server, task, name, i) for i, name in enumerate(("a", "b"))]
    owned.extend(daemons)
    assert server.wait(90), "the rounds did not finish"
    assert server.coordinator.error is None

    track = server.servicer.downloads.track
    assert track is not None and track.reference is not None
    for daemon, _ in daemons:
        version, state = daemon._cache
        assert version == track.version == daemon._reference
        assert state.equal(track.reference)  # what the site trained from, bit for bit
        assert daemon.downloads == 4
    # The server trains its exact model; the sites' reference trails it by one int8 error.
    metrics = server.run_dir.read_metrics()
    assert [m["bytes_out"] for m in metrics] == [2 * FLOAT32_BYTES] + [2 * INT8_CHANGE_BYTES] * 3
    assert metrics[-1]["accuracy"] > 0.8


def test_a_site_without_the_capability_gets_float32(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
) -> None:
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=2, secagg=PLAIN, download="fp16")
    owned.append(server)
    fingerprint = task_fingerprint(task)
    old = FakeSite(server.port, "old", fingerprint, capabilities=("train",))
    new = FakeSite(server.port, "new", fingerprint, capabilities=("train", capability("fp16")))
    owned.extend([old, new])
    version = old.expect("instruction").instruction.model_version
    new.expect("instruction")

    manifest, tensors = _download(old, version)
    assert manifest.codec == "" and not manifest.parts and manifest.total_bytes == FLOAT32_BYTES
    assert tensors.equal(server.coordinator.global_model.state)
    manifest, tensors = _download(new, version)
    assert manifest.codec == "fp16" and manifest.total_bytes == FP16_BYTES
    assert {t.dtype for t in tensors.values()} == {torch.float16}


def test_a_lying_site_gets_only_what_the_server_offers(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
) -> None:
    """Claiming every capability, or a reference it does not hold, gets a site the
    server's own offer: never another codec, never a change from a made-up base."""
    task = TinyTask(features=100)
    cast = _server(tmp_path / "cast", task, sites=1, secagg=PLAIN, download="bf16")
    owned.append(cast)
    liar = FakeSite(cast.port, "liar", task_fingerprint(task), capabilities=("train", *EVERYTHING))
    owned.append(liar)
    version = liar.expect("instruction").instruction.model_version
    manifest, tensors = _download(liar, version, held=version)
    assert manifest.codec == "bf16" and not manifest.base_version
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}

    delta = _server(tmp_path / "delta", task, sites=1, secagg=PLAIN, download=INT8_DELTA)
    owned.append(delta)
    liar = FakeSite(delta.port, "liar", task_fingerprint(task), capabilities=("train", *EVERYTHING))
    owned.append(liar)
    version = liar.expect("instruction").instruction.model_version
    for held in ("made-up", version, ""):
        manifest, tensors = _download(liar, version, held=held)
        assert manifest.codec == "" and not manifest.base_version and manifest.reference
        assert tensors.equal(delta.coordinator.global_model.state)  # the first reference is G


def test_secure_aggregation_runs_with_compressed_downloads(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
) -> None:
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=3, rounds=2, download=INT8_DELTA)
    owned.append(server)
    owned.extend(_daemon(server, task, name, i) for i, name in enumerate(("a", "b", "c")))
    assert server.wait(120), "the secure rounds did not finish"
    assert server.coordinator.error is None
    metrics = server.run_dir.read_metrics()
    assert [m["bytes_out"] for m in metrics] == [3 * FLOAT32_BYTES, 3 * INT8_CHANGE_BYTES]
    assert all(m["clients"] == 3 for m in metrics)


def test_download_keys_are_checked_where_they_are_read() -> None:
    config = from_dict(ServerConfig, {"task": "t:T", "download": "fp16", "secagg": True})
    assert config.download.codec == "fp16" and not config.download.delta
    with pytest.raises(ConfigError, match=r"download\.codec = 'topk' needs download\.delta"):
        from_dict(ServerConfig, {"task": "t:T", "download": "topk"})
    with pytest.raises(ConfigError, match=r"\['zip'\] unknown"):
        from_dict(SiteConfig, {"task": "t:T", "download_codecs": ["fp16", "zip"]})


def test_fedbuff_trains_with_delta_downloads(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Versions move while sites train: a site that missed one gets the whole
    reference, one that holds the last gets the change; the run learns either way.
    Alone, a site holds every version's predecessor: a change each time after the first."""
    received: dict[int, list[bool]] = {}  # site's trainer thread -> was each one a change?
    receive = daemon_module.receive_model

    def spy(manifest, chunks, codec, previous, held):  # type: ignore[no-untyped-def]
        result = receive(manifest, chunks, codec, previous, held)
        received.setdefault(threading.get_ident(), []).append(bool(manifest.base_version))
        return result

    monkeypatch.setattr(daemon_module, "receive_model", spy)
    task = TinyTask(features=100)
    fedbuff = {"name": "fedbuff", "min_fit_clients": 1, "options": {"buffer_size": 1}}
    for sites in (1, 2):
        received.clear()
        server = _server(
            tmp_path / str(sites),
            task,
            sites=sites,
            rounds=6,
            secagg=PLAIN,
            strategy=fedbuff,
            download=INT8_DELTA,
        )
        owned.append(server)
        owned.extend(_daemon(server, task, name, i) for i, name in enumerate("ab"[:sites]))
        assert server.wait(90), "the versions were not made"
        assert server.coordinator.error is None
        metrics = server.run_dir.read_metrics()
        assert len(metrics) == 6 and metrics[-1]["accuracy"] > 0.65  # a third of the data
        assert len(received) == sites and all(not kinds[0] for kinds in received.values())
        if sites == 1:
            (kinds,) = received.values()
            assert len(kinds) >= 6 and all(kinds[1:])
