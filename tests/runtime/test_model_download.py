"""A site turns a download into its model only when everything the manifest says fits
what it was told and what it holds; a rebuilt model that differs from the server's
reference is downloaded again, whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from runtime_support import TinyTask
from test_secagg_runtime import _daemon, _server, owned  # noqa: F401 (owned: a fixture)

from fedtrain.compression import build_codec
from fedtrain.compression.downlink import ReferenceTrack, cast
from fedtrain.errors import ProtocolError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.site import daemon as daemon_module
from fedtrain.runtime.site.daemon import SiteDaemon
from fedtrain.runtime.site.model_download import DigestMismatch, receive_model
from fedtrain.tensors import ModelState


def state(seed: int) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState({"w": torch.randn(300, generator=g), "n": torch.tensor(seed)})


def manifest(version: str, specs: ModelState, sent: Any = None, **kw: Any) -> pb.Manifest:
    m = wire.manifest(version, specs.specs)
    if sent is not None:
        m.codec = sent.codec
        m.parts.extend(wire.spec_to_proto(s) for s in sent.parts.specs)
        m.base_version, m.reference, m.digest = sent.base, sent.reference, sent.digest
    for key, value in kw.items():
        setattr(m, key, value)
    return m


def track_at_v1(codec_name: str = "int8") -> ReferenceTrack:
    track = ReferenceTrack(build_codec(codec_name))
    track.advance("v0", state(0))
    track.advance("v1", ModelState({"w": state(0)["w"] + 0.01, "n": torch.tensor(1)}))
    return track


def test_a_change_rebuilds_the_reference_and_a_cast_decodes() -> None:
    track = track_at_v1()
    change = track.change
    assert change is not None
    held = state(0).clone()
    got, reference = receive_model(
        manifest("v1", held, change), change.parts.chunks(64), build_codec("int8"), held, "v0"
    )
    assert reference and got.equal(track.reference)
    sent = cast(build_codec("fp16"), "v1", state(1))
    got, reference = receive_model(
        manifest("v1", state(1), sent), sent.parts.chunks(64), build_codec("fp16"), None, ""
    )
    assert not reference and torch.equal(got["w"], state(1)["w"].half().float())


def test_what_the_site_was_not_told_or_does_not_hold_is_refused() -> None:
    track = track_at_v1()
    change = track.change
    assert change is not None
    m = manifest("v1", state(0), change)
    with pytest.raises(ProtocolError, match="told this site 'fp16'"):
        receive_model(m, change.parts.chunks(), build_codec("fp16"), state(0), "v0")
    with pytest.raises(ProtocolError, match="told this site 'none'"):
        receive_model(m, change.parts.chunks(), None, state(0), "v0")
    with pytest.raises(ProtocolError, match="asked as holder of no version"):
        receive_model(m, change.parts.chunks(), build_codec("int8"), state(0), "")
    with pytest.raises(ProtocolError, match="parts listed for a model sent as itself"):
        plain = manifest("v1", state(0), change, codec="", base_version="")
        receive_model(plain, [], None, None, "")


def test_a_change_applied_to_another_model_is_caught_by_the_digest() -> None:
    track = track_at_v1()
    change = track.change
    assert change is not None
    other = state(0).clone()
    other["w"][0] += 1.0  # not the reference of v0
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        receive_model(
            manifest("v1", other, change), change.parts.chunks(), build_codec("int8"), other, "v0"
        )


def test_a_site_whose_rebuilt_model_differs_downloads_it_whole(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The site's copy of the reference is damaged before a change lands on it: the
    digest catches it, the site fetches the whole reference and trains on."""
    download = SiteDaemon._download
    damaged: list[str] = []

    def damaging(self, link, version, previous, held, *rest):  # type: ignore[no-untyped-def]
        if held and not damaged:
            previous["weight"][0, 0] += 1.0
            damaged.append(version)
        return download(self, link, version, previous, held, *rest)

    monkeypatch.setattr(SiteDaemon, "_download", damaging)
    task = TinyTask(features=100)
    delta = {"codec": "int8", "delta": True}
    server = _server(tmp_path, task, sites=1, rounds=3, secagg={"enabled": False}, download=delta)
    owned.append(server)
    daemon, thread = _daemon(server, task, "a", 0)
    owned.append((daemon, thread))
    assert server.wait(90), "the rounds did not finish"
    assert damaged and daemon.downloads == 3
    track = server.servicer.downloads.track
    assert daemon._cache[1].equal(track.reference)
    metrics = server.run_dir.read_metrics()
    # round 2: the change, then the whole reference again; round 3: a change
    assert [m["bytes_out"] for m in metrics][1] == 202 + 16 + 808


class _Broken(grpc.RpcError):
    """What a download stream cut mid-way raises at the site."""


def test_a_change_download_that_breaks_off_leaves_the_reference_to_start_from(
    tmp_path: Path,
    owned: list[Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first change is cut after one chunk: the round fails at the site and is
    retried, and the site asks for the change again from the reference it kept."""
    chunks = daemon_module._download_chunks
    kinds: list[str] = []

    def cut_once(pieces):  # type: ignore[no-untyped-def]
        for i, chunk in enumerate(chunks(pieces)):
            if i == 1 and "cut" not in kinds and kinds.count("whole") == 1:
                kinds.append("cut")
                raise _Broken("stream cut")
            yield chunk

    receive = daemon_module.receive_model

    def spy(manifest, pieces, codec, previous, held):  # type: ignore[no-untyped-def]
        result = receive(manifest, pieces, codec, previous, held)
        kinds.append("change" if manifest.base_version else "whole")
        return result

    monkeypatch.setattr(daemon_module, "_download_chunks", cut_once)
    monkeypatch.setattr(daemon_module, "receive_model", spy)
    task = TinyTask(features=100)
    delta = {"codec": "int8", "delta": True}
    server = _server(tmp_path, task, sites=1, rounds=2, secagg={"enabled": False}, download=delta)
    owned.append(server)
    daemon, thread = _daemon(server, task, "a", 0)
    owned.append((daemon, thread))
    assert server.wait(90), "the rounds did not finish"
    assert kinds == ["whole", "cut", "change"]
    assert daemon._cache[1].equal(server.servicer.downloads.track.reference)
