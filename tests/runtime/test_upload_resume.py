"""Uploads resume by id and offset after a broken stream (`fedtrain.runtime.server.resumable`).

The server in-process, driven over real gRPC with the generated stub: a stream broken
mid-upload is kept, the site learns the offset the server holds from the go-ahead and
sends only the rest, and the aggregate is bit for bit that of an unbroken upload. A
rogue resume (another session's upload, overlapping bytes, a changed header, after the
grace, into another round) is refused and audited.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from runtime_support import (
    CHUNK,
    FakeSite,
    TinyTask,
    chunk_messages,
    end_round_with_sum,
    finish_alpha_beta_round,
    inprocess_server,
    wait_for,
)

from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState


def _audit(server: AggregationServer, event: str) -> list[dict[str, Any]]:
    return [r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == event]


def _sites(tmp_path, stop_after, names=("alpha", "beta"), **extra: Any) -> tuple[Any, ...]:
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=len(names), **extra)
    stop_after.append(server)
    fp = task_fingerprint(task)
    sites = [FakeSite(server.port, name, fp) for name in names]
    stop_after += sites
    version = {s.expect("instruction").instruction.model_version for s in sites}.pop()
    return server, version, *sites


def _delta(server: AggregationServer, seed: int) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    specs = server.coordinator.global_model.state
    return ModelState({k: torch.randn(v.shape, generator=gen) for k, v in specs.items()})


def _break_after(
    server: AggregationServer, site: FakeSite, header: pb.UpdateChunk, chunks: list[Any], sent: int
) -> str:
    """Send the header and `sent` chunks, then break the stream once the server journaled
    them; the upload's id (told with the go-ahead)."""
    gate = threading.Event()

    def stream() -> Iterator[pb.UpdateChunk]:
        yield header
        yield from chunks[:sent]
        gate.wait(10)

    call = site.stub.UploadUpdate.future(stream(), timeout=30)
    upload_id = dict(call.initial_metadata())[wire.UPLOAD_ID]
    _wait_held(server, sum(len(c.chunk.data) for c in chunks[:sent]))
    call.cancel()  # the stream breaks off
    gate.set()
    wait_for(lambda: _audit(server, "upload_paused"), 10, "the server to keep the upload")
    return upload_id


def _wait_held(server: AggregationServer, size: int) -> None:
    """Until alpha's upload holds `size` bytes (journaled, not only received)."""
    held = server.servicer.held
    wait_for(lambda: (u := held.of_site("alpha")) and u.offset >= size, 10, "alpha's chunks")


def _resume(
    site: FakeSite, first: pb.UpdateChunk, delta: ModelState, upload_id: str
) -> tuple[int, Any]:
    """Reopen the upload `upload_id` and send what the server lacks: (offset, call)."""
    header = pb.UpdateChunk()
    header.CopyFrom(first)
    header.header.resume_id = upload_id
    told: dict[str, int] = {}
    ready = threading.Event()

    def stream() -> Iterator[pb.UpdateChunk]:
        yield header
        ready.wait(10)
        yield from chunk_messages(wire.chunks_after(delta.chunks(CHUNK), told["offset"]))

    call = site.stub.UploadUpdate.future(stream(), timeout=30)
    told["offset"] = int(dict(call.initial_metadata())[wire.UPLOAD_OFFSET])
    ready.set()
    return told["offset"], call


@pytest.mark.parametrize("memory_mb", [1024, 0], ids=["journal-in-memory", "journal-on-disk"])
def test_a_stream_broken_mid_upload_resumes_from_its_offset_and_the_sum_is_bit_identical(
    tmp_path, stop_after, memory_mb
) -> None:
    server, version, a, b, c = _sites(
        tmp_path,
        stop_after,
        ("alpha", "beta", "gamma"),
        upload_memory_mb=memory_mb,
        rounds=1,
        strategy={"min_fit_clients": 2},
    )
    da, db = _delta(server, 1), _delta(server, 2)
    first = a.header(1, num_examples=10, model_version=version)
    chunks = chunk_messages(da.chunks(CHUNK))
    transfers = server.coordinator.transfers
    upload_id = _break_after(server, a, first, chunks, 3)

    offset, resumed = _resume(a, first, da, upload_id)
    assert offset == 3 * CHUNK  # everything that arrived, nothing more
    receipt = resumed.result(timeout=30)
    assert receipt.bytes_received == da.nbytes
    assert transfers.total_in == da.nbytes  # not one byte travelled twice
    finish_alpha_beta_round(server, b, c, version, da, db)
    record = (server.run_dir.path / "metrics.jsonl").read_text()
    assert f'"bytes_in_accepted": {da.nbytes + db.nbytes}' in record
    assert '"bytes_in_discarded": 0' in record
    paused = _audit(server, "upload_paused")[0]
    assert (paused["site"], paused["offset"]) == ("alpha", 3 * CHUNK)
    assert _audit(server, "upload_resumed")[0]["offset"] == 3 * CHUNK


def test_a_rogue_resume_is_refused_and_audited(tmp_path, stop_after) -> None:
    server, version, a, b = _sites(tmp_path, stop_after)
    da = _delta(server, 1)
    first = a.header(1, num_examples=10, model_version=version)
    chunks = chunk_messages(da.chunks(CHUNK))
    upload_id = _break_after(server, a, first, chunks, 2)

    def refused(site: FakeSite, messages: list[pb.UpdateChunk]) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            site.upload(messages)
        return info.value

    # Another site cannot continue alpha's upload, even knowing its id.
    stolen = b.header(1, num_examples=10, model_version=version, resume_id=upload_id)
    err = refused(b, [stolen, *chunks[2:]])
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "belongs to another session" in err.details()
    # The header of a resumed upload must be the one it started with.
    changed = a.header(1, num_examples=99, model_version=version, resume_id=upload_id)
    err = refused(a, [changed, *chunks[2:]])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "differs from its first" in err.details()
    # An unknown id is refused, saying what to do.
    err = refused(a, [a.header(1, model_version=version, resume_id="0" * 24), *chunks])
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no upload" in err.details() and "start the upload again" in err.details()
    # Bytes the server holds cannot be sent again (overlap): the upload is discarded.
    again = a.header(1, num_examples=10, model_version=version, resume_id=upload_id)
    err = refused(a, [again, *chunks[1:]])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "overlaps" in err.details()
    err = refused(a, [again, *chunks[2:]])
    assert "no upload" in err.details()
    rejected = [(r["site"], r["code"]) for r in _audit(server, "upload_rejected")]
    assert ("beta", "PERMISSION_DENIED") in rejected
    assert rejected[-4:] == [("alpha", "INVALID_ARGUMENT"), ("alpha", "FAILED_PRECONDITION")] * 2
    assert "alpha" not in server.coordinator.current.uploading  # free to start over
    aggregate = server.coordinator.current.aggregate
    assert aggregate.count == 0  # nothing of the rogue streams reached the sum


def test_a_broken_upload_cannot_be_resumed_after_its_grace(tmp_path, stop_after) -> None:
    server, version, a, b = _sites(tmp_path, stop_after, upload_grace_s=0.5, rounds=1)
    da = _delta(server, 1)
    first = a.header(1, num_examples=10, model_version=version)
    chunks = chunk_messages(da.chunks(CHUNK))
    upload_id = _break_after(server, a, first, chunks, 2)
    discarded = wait_for(lambda: _audit(server, "upload_discarded"), 10, "the grace to pass")
    assert discarded[0]["bytes"] == 2 * CHUNK and "upload_grace_s" in discarded[0]["reason"]
    assert "alpha" not in server.coordinator.current.uploading
    with pytest.raises(grpc.RpcError) as info:
        a.upload([a.header(1, num_examples=10, model_version=version, resume_id=upload_id)])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no upload" in info.value.details()
    # Starting again from zero works; what the server had thrown away counts as re-sent.
    receipt = a.upload([a.header(1, num_examples=10, model_version=version), *chunks])
    assert receipt.bytes_received == da.nbytes
    b.upload([b.header(1, num_examples=10, model_version=version), *chunks])
    assert server.wait(20) and server.coordinator.error is None
    record = json.loads((server.run_dir.path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["bytes_in"] == 2 * da.nbytes + 2 * CHUNK
    assert record["bytes_in_accepted"] == 2 * da.nbytes
    assert record["bytes_in_discarded"] == record["bytes_in_resent"] == 2 * CHUNK


def test_a_broken_upload_cannot_continue_into_another_round(tmp_path, stop_after) -> None:
    server, version, a, b, c = _sites(
        tmp_path, stop_after, ("alpha", "beta", "gamma"), strategy={"min_fit_clients": 2}
    )
    da = _delta(server, 1)
    first = a.header(1, num_examples=10, model_version=version)
    chunks = chunk_messages(da.chunks(CHUNK))
    upload_id = _break_after(server, a, first, chunks, 2)
    a.report_error(1, "gives up on round 1")  # the round needs only two of three
    for site, seed in ((b, 2), (c, 3)):
        delta = chunk_messages(_delta(server, seed).chunks(CHUNK))
        site.upload([site.header(1, num_examples=10, model_version=version), *delta])
    second = a.expect("instruction").instruction
    assert second.round == 2
    for header in (
        a.header(1, num_examples=10, model_version=version, resume_id=upload_id),
        a.header(2, num_examples=10, model_version=second.model_version, resume_id=upload_id),
    ):
        with pytest.raises(grpc.RpcError) as info:
            a.upload([header, *chunks[2:]])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "round" in info.value.details()
    wait_for(lambda: _audit(server, "upload_discarded"), 10, "the old upload to be discarded")
    assert len(server.servicer.held) == 0


def test_in_a_round_an_idle_upload_gives_its_slot_to_a_waiting_one_and_resumes_after(
    tmp_path, stop_after
) -> None:
    """The idle cut in a synchronous round (per-site deadlines do not judge a site
    without measured figures): alpha goes silent after two chunks on the only slot, beta's
    upload waits for it, the cut (3 x stall_s) hands it over; alpha resumes from its
    offset and the round's sum is bit for bit that of two unbroken uploads."""
    server, version, a, b, c = _sites(
        tmp_path,
        stop_after,
        ("alpha", "beta", "gamma"),
        rounds=1,
        max_transfers=1,
        transfers={"stall_s": 1.0},
        strategy={"min_fit_clients": 2},
    )
    da, db = _delta(server, 1), _delta(server, 2)
    first = a.header(1, num_examples=10, model_version=version)
    release = threading.Event()

    def silent() -> Iterator[pb.UpdateChunk]:
        yield first
        yield from chunk_messages(da.chunks(CHUNK))[:2]
        release.wait(30)

    call = a.stub.UploadUpdate.future(silent(), timeout=30)
    try:
        upload_id = dict(call.initial_metadata())[wire.UPLOAD_ID]
        b.upload(
            [b.header(1, num_examples=30, model_version=version), *chunk_messages(db.chunks(CHUNK))]
        )
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
    finally:
        release.set()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "the server cut the upload: no bytes moved from the site" in info.value.details()
    [cut] = _audit(server, "transfer_cut")
    assert (cut["site"], cut["direction"], cut["bytes"], cut["waiting"]) == ("alpha", "up", 32, 1)
    offset, resumed = _resume(a, first, da, upload_id)
    assert offset == 2 * CHUNK
    assert resumed.result(timeout=10).bytes_received == da.nbytes
    end_round_with_sum(server, c, [(db, 30.0), (da, 10.0)])  # in the order they completed
