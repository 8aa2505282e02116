"""Small models inside the instruction (`server/model_push.py`, Instruction.model).

A site that joined with the `inline_model` capability gets a small current model in its
TRAIN message and makes no download call; the bytes are what a download would send
(checked by the same code on the site), so the run ends with the same model. A site
without the capability, a model over the limit, a site served changes, or a push that
waits too long for a slot: the instruction goes without the model and the site downloads
it. A lying server's pieces are refused with the model version named.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from runtime_support import FakeSite, TinyTask, inprocess_server, wait_for
from test_parallel_streams import _flat_run

from fedtrain.compression.settings import DownloadSettings
from fedtrain.errors import ProtocolError, TensorStreamError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server import model_push
from fedtrain.runtime.server.downloads import SharedDownloads
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.runtime.server.links import LinkEstimates
from fedtrain.runtime.server.model_push import ModelPush
from fedtrain.runtime.server.sessions import Session
from fedtrain.runtime.site.model_download import receive_inline
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

INLINE = (wire.INLINE_MODEL_CAPABILITY,)


@pytest.mark.parametrize(
    ("limit", "capabilities", "download", "inline"),
    [
        (1 << 20, INLINE, {}, True),
        (1 << 20, (), {}, False),  # an older site: it downloads
        (0, INLINE, {}, False),  # off
        (64, INLINE, {}, False),  # the model is larger than the limit
        (1 << 20, (*INLINE, "download/fp16"), {"codec": "fp16"}, True),
        (
            1 << 20,
            (*INLINE, "download/fp16", "download/delta"),
            {"codec": "fp16", "delta": True},
            False,
        ),
    ],
    ids=["inline", "no-capability", "off", "too-large", "fp16", "delta"],
)
def test_a_small_model_rides_in_the_instruction_of_a_site_that_takes_it(
    tmp_path, stop_after, limit, capabilities, download, inline
) -> None:
    task = TinyTask()
    server = inprocess_server(
        tmp_path,
        task,
        sites=1,
        chunk_bytes=64 * 1024,
        transfers={"inline_model_bytes": limit},
        download=download,
    )
    stop_after.append(server)
    site = FakeSite(server.port, "s0", task_fingerprint(task), capabilities)
    try:
        instruction = site.expect("instruction").instruction
        assert instruction.kind == pb.TRAIN
        assert bool(instruction.model) is inline
        wait_for(lambda: server.servicer.push.pushed == int(inline), 5, "the push counted")
        if not inline:
            return
        # What a download would have sent: the same manifest and tensors.
        manifest, chunks = site.download(instruction.model_version)
        assert instruction.model[0].manifest == manifest
        assert [p.chunk for p in instruction.model[1:]] == chunks
        codec = server.servicer.downloads.codec if download else None
        state, _ = receive_inline(instruction.model_version, instruction.model, codec, None)
        expected = server.coordinator.global_model.state
        assert state.specs == expected.specs
        for name in expected:
            torch.testing.assert_close(state[name].float(), expected[name], atol=1e-2, rtol=1e-2)
    finally:
        site.outbox.put(None)
        site.channel.close()


@pytest.mark.integration
def test_a_daemon_trains_from_the_model_in_its_instruction_and_ends_with_the_same_model(
    tmp_path, stop_after, caplog
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    inline = _flat_run(tmp_path / "inline", stop_after, 1, num_params=10_000)
    assert caplog.text.count("came inside its instruction") == 2  # both rounds
    assert "downloaded" not in caplog.text
    caplog.clear()
    downloaded = _flat_run(
        tmp_path / "downloaded",
        stop_after,
        1,
        num_params=10_000,
        transfers={"inline_model_bytes": 0},
    )
    assert "came inside its instruction" not in caplog.text
    assert inline.equal(downloaded)


def _push(slots: int, limit: int = 1 << 20) -> tuple[ModelPush, GlobalModel, LinkEstimates]:
    model = GlobalModel(1, "v1", ModelState({"w": torch.arange(100, dtype=torch.float32)}))
    links = LinkEstimates()

    async def run(fn: Any, *args: Any) -> Any:
        return fn(*args)

    push = ModelPush(
        SharedDownloads(1 << 20, DownloadSettings()),
        limit,
        slots,
        (1 << 20) + wire.HEADER_ALLOWANCE,
        links,
        lambda nbytes: None,
        current=lambda: model,
        run=run,
    )
    return push, model, links


def _train(model: GlobalModel) -> pb.ServerMessage:
    return pb.ServerMessage(
        instruction=pb.Instruction(round=1, kind=pb.TRAIN, model_version=model.version)
    )


def test_an_instruction_that_waits_too_long_for_a_push_slot_goes_without_the_model(
    monkeypatch,
) -> None:
    """One slot, held by a push whose link takes nothing: the next site's instruction
    waits WAIT_S, then goes without the model (that site downloads it); once the slot
    is free again the model rides along."""
    monkeypatch.setattr(model_push, "WAIT_S", 0.05)
    push, model, links = _push(slots=1)
    a, b = (Session(site=name, peer=name, capabilities=frozenset(INLINE)) for name in "ab")

    async def scenario() -> list[tuple[str, Any]]:
        written: list[tuple[str, Any]] = []
        stalled = asyncio.Event()

        async def stuck(item: Any) -> None:
            written.append(("a", item))
            await stalled.wait()

        async def to_b(item: Any) -> None:
            written.append(("b", item))

        first = asyncio.create_task(push.send(a, _train(model), stuck))
        await asyncio.sleep(0)
        await push.send(b, _train(model), to_b)
        stalled.set()
        await first
        await push.send(b, _train(model), to_b)
        return written

    written = asyncio.run(scenario())
    assert [site for site, _ in written] == ["a", "b", "b"]
    assert isinstance(written[0][1], bytes)  # with the model
    assert isinstance(written[1][1], pb.ServerMessage)  # waited out: without it
    assert not written[1][1].instruction.model
    with_model = pb.ServerMessage.FromString(written[2][1])
    assert with_model.instruction.model_version == model.version
    assert with_model.instruction.model[0].manifest.total_bytes == model.state.nbytes
    assert (push.pushed, push.waited_out) == (2, 1)
    # The push is the site's download as far as its link's figures go.
    link = links.link("b")
    assert link is not None and link.down_bytes == model.state.nbytes


def test_other_messages_and_older_versions_go_as_they_are() -> None:
    push, _, _ = _push(slots=1)
    site = Session(site="a", peer="a", capabilities=frozenset(INLINE))
    older = pb.ServerMessage(instruction=pb.Instruction(round=1, kind=pb.TRAIN, model_version="v0"))
    pace = pb.ServerMessage(pace=pb.Pace(heartbeat_interval_s=30))
    written: list[Any] = []

    async def write(item: Any) -> None:
        written.append(item)

    async def scenario() -> None:
        for message in (older, pace):
            await push.send(site, message, write)

    asyncio.run(scenario())
    assert written == [older, pace] and push.pushed == 0


def _pieces(model: GlobalModel) -> list[pb.ModelPiece]:
    manifest = wire.manifest(model.version, model.state.specs)
    manifest.total_bytes = model.state.nbytes
    chunks = [pb.ModelPiece(chunk=wire.chunk_to_proto(c)) for c in model.state.chunks(128)]
    return [pb.ModelPiece(manifest=manifest), *chunks]


def test_a_model_in_an_instruction_that_is_not_what_it_names_is_refused() -> None:
    """What a lying (or broken) server could put in an instruction: every case is a
    ProtocolError naming what was wrong; the honest one decodes to the model."""
    _, model, _ = _push(slots=1)
    good = _pieces(model)
    state, _ = receive_inline("v1", good, None, None)
    assert state.equal(model.state)

    change = _pieces(model)
    change[0].manifest.base_version = "v0"
    cases = {
        "names model v2 but carries v1": ("v2", good),
        "must start with its manifest": ("v1", good[1:]),
        "has a second manifest": ("v1", [*good, good[0]]),
        "must be whole, not a change": ("v1", change),
    }
    for message, (version, pieces) in cases.items():
        with pytest.raises(ProtocolError, match=message):
            receive_inline(version, pieces, None, None)
    with pytest.raises(TensorStreamError, match="stream ended early"):
        receive_inline("v1", good[:-1], None, None)  # a chunk short


def test_a_model_that_cannot_be_made_goes_out_as_a_plain_instruction(caplog) -> None:
    """An encoding that fails must not break the site's control stream: the instruction
    goes without the model (the site's download then meets the failure, and says so)."""
    push, model, _ = _push(slots=1)
    site = Session(site="a", peer="a", capabilities=frozenset(INLINE))

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("disk full")

    push.downloads.prepare = broken  # type: ignore[method-assign]
    written: list[Any] = []

    async def write(item: Any) -> None:
        written.append(item)

    asyncio.run(push.send(site, _train(model), write))
    assert written == [_train(model)] and push.pushed == 0
    assert "could not be put inside an instruction" in caplog.text
