"""The server in-process, driven over a real gRPC channel with the generated stub.

Malformed uploads are refused with the right status and never touch the global
model; bfloat16/int64 models travel bit-exactly; a cached model is not downloaded
twice; silent sites are disconnected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from runtime_support import (
    CHUNK,
    Bf16Task,
    FakeSite,
    TinyTask,
    chunk_messages,
    inprocess_server,
    wait_for,
)

from fedtrain.config import from_dict
from fedtrain.runtime import wire
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server import servicer
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.site.daemon import SiteDaemon
from fedtrain.runtime.status import fetch_status
from fedtrain.strategy import WeightedSum
from fedtrain.strategy.aggregate import apply_mean_delta
from fedtrain.task import task_fingerprint
from fedtrain.tensor_file import load_tensor_file
from fedtrain.tensors import ModelState, StateAssembler


def _audit(server: AggregationServer) -> list[dict[str, Any]]:
    return read_audit(server.run_dir.path / "audit.jsonl")


def _download(site: FakeSite, version: str) -> ModelState:
    manifest, chunks = site.download(version)
    assembler = StateAssembler([wire.spec_from_proto(s) for s in manifest.specs])
    for c in chunks:
        assembler.add(wire.chunk_from_proto(c))
    return assembler.finish()


def _refused(site: FakeSite, messages: list[pb.UpdateChunk]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        site.upload(messages)
    return info.value


def _alpha_and_beta(tmp_path, stop_after) -> tuple[AggregationServer, FakeSite, FakeSite]:
    """An in-process server for two sites, and sites alpha and beta joined to it."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=2)
    stop_after.append(server)
    fp = task_fingerprint(task)
    a, b = FakeSite(server.port, "alpha", fp), FakeSite(server.port, "beta", fp)
    stop_after += [a, b]
    return server, a, b


def test_bad_uploads_are_refused_and_the_run_continues(tmp_path, stop_after) -> None:
    server, a, b = _alpha_and_beta(tmp_path, stop_after)
    instruction = a.expect("instruction").instruction
    b.expect("instruction")
    assert instruction.round == 1
    assert wire.config_from_proto(instruction.config)["round"] == 1
    global_before = _download(a, instruction.model_version)
    assert global_before.equal(server.coordinator.global_model.state)
    with pytest.raises(grpc.RpcError) as info:
        a.download("0" * 64)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        list(a.stub.DownloadModel(pb.ModelRequest(version="", session_token="nope")))
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED

    delta = ModelState({k: torch.full_like(v, 0.25) for k, v in global_before.items()})
    good = [
        a.header(1, model_version=instruction.model_version),
        *chunk_messages(delta.chunks(CHUNK)),
    ]

    err = _refused(a, [a.header(1, token="f" * 32), *good[1:]])
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "unknown session token" in err.details()

    err = _refused(a, [a.header(2), *good[1:]])
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "stale round" in err.details() and "'alpha'" in err.details()

    wrong = ModelState({**delta, "weight": torch.zeros(3, 8)})
    err = _refused(a, [good[0], *chunk_messages(wrong.chunks(CHUNK))])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'weight'" in err.details() and "round 1" in err.details()

    nan = delta.clone()
    nan["bias"][1] = float("nan")
    err = _refused(a, [good[0], *chunk_messages(nan.chunks(CHUNK))])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN/Inf" in err.details()

    err = _refused(a, good[:-1])  # the last chunk never comes
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "stream ended early" in err.details()

    err = _refused(a, good[1:])  # no header
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    err = _refused(a, [good[0], *chunk_messages(delta.chunks(4 * CHUNK))])  # oversized chunks
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    err = _refused(a, [a.header(1, num_examples=0), *good[1:]])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    # A stream cancelled halfway is kept for a resume (resumable.py), never folded; a
    # new upload from the site discards it.
    gate = threading.Event()

    def stalled() -> Iterator[pb.UpdateChunk]:
        yield from good[:3]
        gate.wait(10)

    journal = server.servicer.journal_memory
    future = a.stub.UploadUpdate.future(stalled())
    wait_for(lambda: journal.used > 0, 10, "the upload's first chunks to be journaled")
    future.cancel()
    gate.set()
    wait_for(lambda: not server.servicer.held.of_site("alpha").attached, 10, "the break")
    aggregate = server.coordinator.current.aggregate
    assert aggregate.count == 0
    assert all(not torch.any(acc) for acc in aggregate.sums.values())

    # Nothing of the above reached the global model; the round is still open.
    assert server.coordinator.global_model.round == 0
    assert server.coordinator.global_model.state.equal(global_before)

    receipt = a.upload(good)
    assert receipt.round == 1 and receipt.bytes_received == delta.nbytes
    assert journal.used == 0  # the kept upload was discarded, the new one folded
    err = _refused(a, good)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "duplicate upload" in err.details()

    b.upload([b.header(1, num_examples=30), *chunk_messages(delta.chunks(CHUNK))])
    next_instruction = a.expect("instruction").instruction
    assert next_instruction.round == 2
    expected = apply_mean_delta(global_before, {k: v.float() for k, v in delta.items()})
    assert server.coordinator.global_model.state.equal(expected)
    server.coordinator.checkpoints.wait()  # written in the background
    checkpoint = load_tensor_file(server.run_dir.checkpoint_path)
    assert checkpoint["extra"]["model_version"] == next_instruction.model_version
    assert ModelState(checkpoint["model"]).equal(expected)

    refused = [r for r in _audit(server) if r["event"] in ("upload_rejected", "request_refused")]
    assert {r["code"] for r in refused} == {
        "PERMISSION_DENIED",
        "FAILED_PRECONDITION",
        "INVALID_ARGUMENT",
    }
    err = _refused(a, good)  # round 1 is over now
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert not server.spool_dir.exists() or not any(server.spool_dir.iterdir())


def test_a_broken_off_upload_leaves_the_sum_bit_identical_to_a_round_without_it(
    tmp_path, stop_after
) -> None:
    server, a, b = _alpha_and_beta(tmp_path, stop_after)
    version = a.expect("instruction").instruction.model_version
    b.expect("instruction")
    gen = torch.Generator().manual_seed(7)
    da, db = (
        ModelState({k: torch.randn(v.shape, generator=gen) for k, v in _download(a, "").items()})
        for _ in range(2)
    )
    header_a = a.header(1, num_examples=10, model_version=version)
    sent = list(chunk_messages(da.chunks(CHUNK)))[:3]
    gate = threading.Event()

    def breaks_off() -> Iterator[pb.UpdateChunk]:
        yield header_a
        yield from sent
        gate.wait(10)

    transfers = server.coordinator.transfers
    future = a.stub.UploadUpdate.future(breaks_off())
    wait_for(lambda: transfers.total_in >= 3 * CHUNK, 10, "alpha's first chunks to arrive")
    b.upload(
        [b.header(1, num_examples=30, model_version=version), *chunk_messages(db.chunks(CHUNK))]
    )
    future.cancel()  # alpha's stream breaks off after beta's update was counted
    gate.set()
    held = server.servicer.held
    wait_for(lambda: not held.of_site("alpha").attached, 10, "alpha's break to be noticed")
    without_a = WeightedSum(db.specs)
    without_a.add(db, 30.0)
    aggregate = server.coordinator.current.aggregate
    assert aggregate.count == 1 and aggregate.total_weight == 30.0
    for name, acc in aggregate.sums.items():
        assert torch.equal(acc, without_a.sums[name]), name


def test_an_upload_still_arriving_when_the_round_closes_is_cut_off_at_its_next_chunk(
    tmp_path, stop_after
) -> None:
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=1, round_timeout_s=1.0)
    stop_after.append(server)
    site = FakeSite(server.port, "alpha", task_fingerprint(task))
    stop_after.append(site)
    version = site.expect("instruction").instruction.model_version
    delta = ModelState({k: torch.zeros_like(v) for k, v in _download(site, "").items()})
    chunks = chunk_messages(delta.chunks(CHUNK))
    closed, never = threading.Event(), threading.Event()

    def late() -> Iterator[pb.UpdateChunk]:
        yield site.header(1, model_version=version)
        yield chunks[0]
        closed.wait(10)
        yield chunks[1]  # the server must not wait for the rest of this update
        never.wait(20)

    future = site.stub.UploadUpdate.future(late())
    wait_for(lambda: any(r["event"] == "round_failed" for r in _audit(server)), 10, "deadline")
    closed.set()
    try:
        error = future.exception(timeout=10)
    finally:
        never.set()
    # Refused at its next chunk, or discarded by the server's sweep if that came first
    # (a stream that sends nothing more is cut too: test_parallel_streams.py).
    assert error is not None, "the server waited for the rest of a closed round's update"
    assert (error.code(), error.details().split(": ", 1)[1]) in {
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "the round closed while the update was being received; update dropped",
        ),
        (
            grpc.StatusCode.ABORTED,
            "the upload was discarded (its round closed); do not resume it",
        ),
    }


def test_a_site_cannot_erase_the_others_work_by_breaking_off_a_huge_upload(
    tmp_path, stop_after
) -> None:
    """Folded on arrival and subtracted back out, a broken-off update of huge finite
    values absorbed the honest sum (x + 1e30 - 1e30 == 0 in float32), and the audit log
    showed only a failed upload: the round's work was gone."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=3, rounds=1, strategy={"min_fit_clients": 2})
    stop_after.append(server)
    fp = task_fingerprint(task)
    a, b, rogue = (FakeSite(server.port, name, fp) for name in ("a", "b", "rogue"))
    stop_after += [a, b, rogue]
    version = {site.expect("instruction").instruction.model_version for site in (a, b, rogue)}.pop()
    base = server.coordinator.global_model.state.clone()
    gen = torch.Generator().manual_seed(3)
    deltas = [ModelState({k: torch.randn(v.shape, generator=gen) for k, v in base.items()})]
    deltas.append(ModelState({k: torch.randn(v.shape, generator=gen) for k, v in base.items()}))
    for site, delta in zip((a, b), deltas, strict=True):
        site.upload(
            [
                site.header(1, num_examples=10, model_version=version),
                *chunk_messages(delta.chunks(CHUNK)),
            ]
        )
    huge = chunk_messages(
        ModelState({k: torch.full_like(v, 1e30) for k, v in base.items()}).chunks(CHUNK)
    )
    err = _refused(rogue, [rogue.header(1, num_examples=10, model_version=version), *huge[:-1]])
    assert "stream ended early" in err.details()
    rogue.report_error(1, err.details())
    assert server.wait(20) and server.coordinator.error is None
    for name, tensor in server.coordinator.global_model.state.items():
        honest = (deltas[0][name].double() + deltas[1][name].double()) / 2
        torch.testing.assert_close(tensor, (base[name].double() + honest).float())


def test_an_upload_waits_at_the_site_until_the_server_has_a_transfer_slot(
    tmp_path, stop_after
) -> None:
    """With every transfer slot taken, a second upload gets no go-ahead: its bytes stay
    at the site (with a few thousand sites uploading at once, gRPC held them all in
    the server's memory). When the slot frees, it is told to go and is aggregated."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=2, rounds=1, max_transfers=1, round_timeout_s=60.0
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    a, b = (FakeSite(server.port, name, fp) for name in ("a", "b"))
    stop_after += [a, b]
    version = {site.expect("instruction").instruction.model_version for site in (a, b)}.pop()
    delta = ModelState({k: torch.zeros_like(v) for k, v in _download(a, "").items()})
    chunks = chunk_messages(delta.chunks(CHUNK))
    release = {site.name: threading.Event() for site in (a, b)}

    def update(site: FakeSite) -> Iterator[pb.UpdateChunk]:
        yield site.header(1, model_version=version)
        release[site.name].wait(30)
        yield from chunks

    first = a.stub.UploadUpdate.future(update(a), timeout=60)
    assert dict(first.initial_metadata()).get(wire.UPLOAD_GO_AHEAD) == "1"  # the only slot
    second = b.stub.UploadUpdate.future(update(b), timeout=60)
    waited = threading.Thread(target=second.initial_metadata)
    waited.start()
    waited.join(1.5)
    assert waited.is_alive(), "the second upload was told to go while the slot was taken"
    release["a"].set()
    assert first.result(timeout=30).bytes_received == delta.nbytes
    waited.join(10)
    assert not waited.is_alive() and dict(second.initial_metadata())[wire.UPLOAD_GO_AHEAD] == "1"
    release["b"].set()
    assert second.result(timeout=30).bytes_received == delta.nbytes
    assert server.wait(30) and server.coordinator.error is None


def test_bfloat16_model_round_trips_bit_exactly(tmp_path, stop_after) -> None:
    task = Bf16Task()
    server = inprocess_server(tmp_path, task, rounds=1)
    stop_after.append(server)
    # Values a lossy path would change: -0.0, subnormal, extremes of bf16.
    with torch.no_grad():
        weight = server.coordinator.global_model.state["linear.weight"]
        weight.view(-1)[:4] = torch.tensor([-0.0, 1e-39, 3.3e38, -1.17e-38], dtype=torch.bfloat16)
    initial = server.coordinator.global_model.state.clone()
    site = FakeSite(server.port, "alpha", task_fingerprint(task))
    stop_after.append(site)
    instruction = site.expect("instruction").instruction
    downloaded = _download(site, instruction.model_version)
    assert downloaded.equal(initial)
    assert downloaded["linear.weight"].dtype == torch.bfloat16
    assert downloaded["steps"].dtype == torch.int64

    gen = torch.Generator().manual_seed(3)
    delta = ModelState(
        {
            "linear.weight": (torch.randn(3, 6, generator=gen) / 8).to(torch.bfloat16),
            "linear.bias": (torch.randn(3, generator=gen) / 8).to(torch.bfloat16),
            "steps": torch.tensor([1, 0, -2, 5, 7], dtype=torch.int64),
        }
    )
    site.upload([site.header(1, num_examples=13), *chunk_messages(delta.chunks(CHUNK))])
    assert server.wait(20)
    reference = WeightedSum(initial.specs)
    reference.add(delta, 13.0)
    expected = apply_mean_delta(initial, reference.mean())
    assert server.coordinator.global_model.state.equal(expected)
    assert expected["steps"].tolist() == [1, 1, 0, 8, 11]


def test_cached_model_is_not_downloaded_again(tmp_path, stop_after) -> None:
    """A failed round is retried with the same model: the site trains it from its cache."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=2, rounds=2)
    stop_after.append(server)
    config = from_dict(SiteConfig, {"task": "runtime_support:TinyTask", "name": "real"})
    config.server = f"127.0.0.1:{server.port}"
    daemon = SiteDaemon(config, insecure=True, task=task, data=task.datasets()[0])
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    stop_after.append(daemon)
    fake = FakeSite(server.port, "fake", task_fingerprint(task))
    stop_after.append(fake)

    first = fake.expect("instruction").instruction
    fake.report_error(1, "out of memory")  # attempt 1 fails: 1 of 2 updates
    retry = fake.expect("instruction").instruction
    assert (retry.round, retry.model_version) == (1, first.model_version)
    delta = ModelState(
        {k: torch.zeros_like(v) for k, v in _download(fake, first.model_version).items()}
    )
    fake.upload([fake.header(1), *chunk_messages(delta.chunks(CHUNK))])
    second = fake.expect("instruction").instruction
    assert second.round == 2
    fake.upload(
        [
            fake.header(2, model_version=second.model_version),
            *chunk_messages(delta.chunks(CHUNK)),
        ]
    )
    assert server.wait(30)
    assert server.coordinator.error is None
    assert server.coordinator.global_model.round == 2
    assert daemon.rounds_trained == 3  # round 1 twice, round 2 once
    assert daemon.downloads == 2  # the retry of round 1 used the cached model
    events = [r["event"] for r in _audit(server)]
    assert "round_failed" in events and "site_error" in events
    daemon.stop()
    thread.join(10)
    assert not thread.is_alive()


def test_silent_site_is_disconnected_and_fingerprints_are_checked(tmp_path, stop_after) -> None:
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=2, heartbeat={"interval_s": 0.2, "timeout_s": 1.0, "grace_s": 1.0}
    )
    stop_after.append(server)
    quiet = FakeSite(server.port, "quiet", task_fingerprint(task))
    stop_after.append(quiet)
    assert len(server.registry) == 1
    wait_for(lambda: len(server.registry) == 0, 10, "the silent site to be disconnected")
    assert quiet.inbox.get(timeout=5) is None  # its control stream was ended
    leaves = [r for r in _audit(server) if r["event"] == "leave"]
    # Silent past its timeout, it was kept for the outage grace, then dropped.
    assert leaves[-1]["reason"] == "unreachable for longer than heartbeat.grace_s (1s)"
    assert [r["site"] for r in _audit(server) if r["event"] == "site_away"] == ["quiet"]

    with pytest.raises(AssertionError, match="reject") as info:
        FakeSite(server.port, "other", "0123456789abcdef")
    assert "task fingerprint mismatch" in str(info.value)
    assert task_fingerprint(task) in str(info.value)

    status = fetch_status(f"127.0.0.1:{server.port}", None, timeout_s=5)
    assert status.run_id == server.coordinator.run_id
    assert status.total_rounds == 3 and not status.finished


def test_an_upload_that_keeps_moving_keeps_its_site_alive_while_its_heartbeats_are_late(
    tmp_path, stop_after
) -> None:
    """Issue 14: on a congested uplink the control stream's heartbeats queue behind the
    site's own upload bytes; the bytes arriving are what says the site is alive. No
    heartbeat for twice its timeout (and no outage grace: silence drops at once), but a
    chunk every 0.7 s: the site stays, and its update counts."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, rounds=1, heartbeat={"interval_s": 0.2, "timeout_s": 1.5, "grace_s": 0.0}
    )
    stop_after.append(server)
    site = FakeSite(server.port, "congested", task_fingerprint(task))
    stop_after.append(site)
    version = site.expect("instruction").instruction.model_version
    delta = ModelState({k: torch.full_like(v, 0.5) for k, v in _download(site, version).items()})
    chunks = chunk_messages(delta.chunks(CHUNK))
    assert len(chunks) * 0.7 >= 2 * 1.5

    def moving() -> Iterator[pb.UpdateChunk]:
        yield site.header(1, num_examples=10, model_version=version)
        for chunk in chunks:
            time.sleep(0.7)
            yield chunk

    receipt = site.stub.UploadUpdate(moving(), timeout=30)
    assert receipt.bytes_received == delta.nbytes
    assert server.wait(20) and server.coordinator.error is None
    leaves = [r for r in _audit(server) if r["event"] == "leave"]
    assert [r["reason"] for r in leaves] == ["run complete"]


def test_one_site_cannot_take_every_transfer_slot_with_downloads_it_never_reads(
    tmp_path, stop_after
) -> None:
    """A rogue site opens `max_transfers` downloads of a large model, each naming another
    reference version, and reads none of them: an honest site must still download."""
    task = TinyTask(features=2_000_000)  # a 16 MB model: more than gRPC's windows hold
    server = inprocess_server(
        tmp_path, task, sites=2, rounds=1, max_transfers=2, chunk_bytes=256 * 1024
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    rogue, honest = (FakeSite(server.port, name, fp) for name in ("rogue", "honest"))
    stop_after += [rogue, honest]
    version = {s.expect("instruction").instruction.model_version for s in (rogue, honest)}.pop()
    stuck = []
    for held in ("x", "y"):
        request = pb.ModelRequest(version=version, session_token=rogue.token, held_version=held)
        stuck.append(rogue.stub.DownloadModel(request, timeout=60))
        next(stuck[-1])  # the manifest: the slot is granted, then nothing more is read
    slots = server.servicer.transfer_slots
    wait_for(lambda: len(slots) == 1, 10, "the rogue's downloads to hold their one slot")
    try:
        request = pb.ModelRequest(version=version, session_token=honest.token)
        pieces = list(honest.stub.DownloadModel(request, timeout=10))
        assert pieces[0].WhichOneof("kind") == "manifest"
    finally:
        for call in stuck:
            call.cancel()


@pytest.mark.parametrize(("lines_sites", "level"), [(2, "INFO"), (1, "DEBUG")])
def test_each_update_is_logged_at_info_only_while_few_sites_are_connected(
    tmp_path, stop_after, caplog, monkeypatch, lines_sites, level
) -> None:
    """A round of 1,000 must not write 1,000 lines; audit.jsonl records each upload."""
    monkeypatch.setattr(servicer, "UPLOAD_LINES_SITES", lines_sites)
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.server.servicer")
    server, alpha, _ = _alpha_and_beta(tmp_path, stop_after)
    version = alpha.expect("instruction").instruction.model_version
    delta = server.coordinator.global_model.state.clone()
    alpha.upload([alpha.header(1, model_version=version), *chunk_messages(delta.chunks(CHUNK))])
    lines = [r for r in caplog.records if "update of" in r.getMessage()]
    assert [(r.levelname, "'alpha', round 1" in r.getMessage()) for r in lines] == [(level, True)]
    assert [r["site"] for r in _audit(server) if r["event"] == "upload"] == ["alpha"]
