"""FedBuff in the server, in-process, with hand-driven sites over real gRPC.

The test decides exactly when each site uploads, so staleness, weights, refusals,
deferred hand-outs and deadlines are checked to the number.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from runtime_support import CHUNK, FakeSite, TinyTask, chunk_messages, wait_for
from runtime_support import inprocess_server as _server
from test_servicer import _audit, _download, _refused
from test_upload_resume import _resume

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.round_record import check_record
from fedtrain.runtime import wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.proto import fedtrain_pb2_grpc as pb_grpc
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.servicer import UNREAD_CUTS
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState, StateAssembler

pytestmark = pytest.mark.timeout(60)


def fedbuff(sites: int, **options: Any) -> dict[str, Any]:
    return {
        "name": "fedbuff",
        "min_fit_clients": 1,
        "min_available_clients": sites,
        "options": {"buffer_size": 2, **options},
    }


def upload(site: FakeSite, job: pb.Instruction, value: float, n: int) -> pb.UploadReceipt:
    """A delta of `value` everywhere, for the job's model."""
    delta = ModelState({k: torch.full_like(v, value) for k, v in _download(site, "").items()})
    return site.upload(
        [
            site.header(job.round, num_examples=n, model_version=job.model_version),
            *chunk_messages(delta.chunks(CHUNK)),
        ]
    )


def job(site: FakeSite) -> pb.Instruction:
    return site.expect("instruction").instruction


def test_staleness_weights_refusals_and_retained_versions(tmp_path, stop_after) -> None:
    task = TinyTask()
    server = _server(tmp_path, task, rounds=4, strategy=fedbuff(3, max_staleness=1))
    stop_after.append(server)
    fp = task_fingerprint(task)
    a, b, c = (FakeSite(server.port, name, fp) for name in ("a", "b", "c"))
    stop_after += [a, b, c]
    versions = [server.coordinator.global_model]
    jobs = {site.name: job(site) for site in (a, b, c)}  # handed out once all three joined
    assert sorted(j.round for j in jobs.values()) == [1, 2, 3]
    for j in jobs.values():
        assert j.model_version == versions[0].version
        assert wire.config_from_proto(j.config)["version"] == 0

    # a's update alone does not fill the buffer: a gets its next job at once, from version 0
    upload(a, jobs["a"], 0.1, 10)
    a_next = job(a)
    assert a_next.model_version == versions[0].version and a_next.round == 4
    err = _refused(a, [a.header(jobs["a"].round)])
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "current job is 4" in err.details()
    # b's fills it: version 1 = version 0 + (10 * 0.1 + 30 * 0.3) / 40; b waits for it
    upload(b, jobs["b"], 0.3, 30)
    b_next = job(b)
    versions.append(server.coordinator.global_model)
    assert versions[1].round == 1 and b_next.model_version == versions[1].version
    expected = {k: v + 0.25 for k, v in versions[0].state.items()}
    for name, tensor in versions[1].state.items():
        torch.testing.assert_close(tensor, expected[name])

    # c fetches the model of its job, version 0, although the model moved on
    assert _download(c, jobs["c"].model_version).equal(versions[0].state)
    # c's and a's updates (from version 0) are 1 version stale: each weighs 1/sqrt(2)
    upload(c, jobs["c"], 1.0, 20)
    c_next = job(c)
    upload(a, a_next, 0.5, 20)
    a_next = job(a)
    versions.append(server.coordinator.global_model)
    step = (20 * 1.0 + 20 * 0.5) / math.sqrt(2) / 40
    for name, tensor in versions[2].state.items():
        torch.testing.assert_close(tensor, versions[1].state[name] + step)
    with pytest.raises(grpc.RpcError) as info:  # version 0 is gone now: nobody needs it
        c.download(versions[0].version)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION

    # a (from version 2) and c (from version 1) make version 3...
    upload(a, a_next, 0.0, 5)
    a_next = job(a)
    upload(c, c_next, 0.0, 5)
    c_next = job(c)
    assert server.coordinator.global_model.round == 3
    # ...so b's job from version 1 is 2 versions stale: refused, and b gets a new one
    err = _refused(b, [b.header(b_next.round, model_version=b_next.model_version)])
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "2 versions stale" in err.details() and "max_staleness = 1" in err.details()
    assert job(b).model_version == server.coordinator.global_model.version

    upload(a, a_next, 0.0, 5)
    job(a)  # the buffer is not full yet: a trains on
    upload(c, c_next, 0.0, 5)  # version 4, the last: the run is complete
    assert server.wait(20) and server.coordinator.error is None
    assert a.expect("shutdown").shutdown.reason == "run complete"

    records = server.run_dir.path / "metrics.jsonl"
    metrics = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["round"] for r in metrics] == [1, 2, 3, 4]
    assert [r["contributors"] for r in metrics] == [["a", "b"], ["c", "a"], ["a", "c"], ["a", "c"]]
    assert [r["staleness_max"] for r in metrics] == [0, 1, 1, 1]
    assert metrics[1]["staleness_weight_mean"] == pytest.approx(1 / math.sqrt(2))
    assert [r["stale_dropped"] for r in metrics] == [0, 0, 0, 1]
    for r in metrics:  # the one definition every driver writes
        check_record(r)
        assert r["clients"] == 2 and r["aggregated"]
        assert r["selected"] == 2 + r["stale_dropped"] + len(r["dropped"]) + len(r["failed"])
    audit = _audit(server)
    buffered = [r for r in audit if r["event"] == "update_buffered"]
    assert [(r["site"], r["staleness"]) for r in buffered[:4]] == [
        ("a", 0),
        ("b", 0),
        ("c", 1),
        ("a", 1),
    ]
    assert buffered[2]["weight"] == pytest.approx(1 / math.sqrt(2))
    (stale,) = [r for r in audit if r["event"] == "update_stale"]
    assert (stale["site"], stale["staleness"], stale["max_staleness"]) == ("b", 2, 1)
    rejected = [r for r in audit if r["event"] == "upload_rejected" and r["site"] == "b"]
    assert "versions stale" in rejected[-1]["reason"]


def test_overdue_and_departed_sites_are_dropouts_and_the_rest_carry_on(
    tmp_path, stop_after
) -> None:
    task = TinyTask()
    server = _server(
        tmp_path,
        task,
        rounds=2,
        round_timeout_s=1.0,
        strategy=fedbuff(2, buffer_size=1),
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    x, y = FakeSite(server.port, "x", fp), FakeSite(server.port, "y", fp)
    stop_after += [x, y]
    x_job, y_job = job(x), job(y)
    upload(y, y_job, 0.1, 10)  # version 1; y gets its next job...
    job(y)
    y.close()  # ...and leaves while it holds it: a dropout
    wait_for(lambda: len(server.registry) == 1, 10, "y to leave")
    x_next = job(x)  # x's first job passed its 1 s deadline: x gets a new one
    assert x_next.round > x_job.round
    assert x_next.model_version == server.coordinator.global_model.version
    err = _refused(x, [x.header(x_job.round, model_version=x_job.model_version)])
    assert "current job is" in err.details()
    upload(x, x_next, 0.1, 10)
    assert server.wait(20) and server.coordinator.error is None
    last = json.loads((server.run_dir.path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["round"] == 2 and last["dropped"] == ["x", "y"]
    check_record(last)
    expired = [r for r in _audit(server) if r["event"] == "job_expired"]
    assert [(r["site"], r["job"]) for r in expired] == [("x", x_job.round)]


def test_fedbuff_with_secure_aggregation_is_refused_at_configuration() -> None:
    with pytest.raises(ConfigError, match=r"'fedbuff' cannot run with secure aggregation"):
        from_dict(
            ServerConfig,
            {"task": "runtime_support:TinyTask", "secagg": True, "strategy": fedbuff(2)},
        )


def test_resume_continues_from_the_last_version(tmp_path, stop_after) -> None:
    task = TinyTask()
    first = _server(tmp_path, task, rounds=3, strategy=fedbuff(1, buffer_size=1))
    stop_after.append(first)
    fp = task_fingerprint(task)
    site = FakeSite(first.port, "a", fp)
    stop_after.append(site)
    for _ in range(2):
        upload(site, job(site), 0.1, 10)
    wait_for(lambda: first.coordinator.global_model.round == 2, 10, "version 2")
    version_2 = first.coordinator.global_model
    site.close()
    first.stop()

    second = AggregationServer(first.config, insecure=True, task=task, resume=True)
    second.start()
    stop_after.append(second)
    site = FakeSite(second.port, "a", fp)
    stop_after.append(site)
    resumed = job(site)
    assert resumed.model_version == version_2.version
    assert wire.config_from_proto(resumed.config)["version"] == 2
    upload(site, resumed, 0.1, 10)
    assert second.wait(20) and second.coordinator.error is None
    records = (second.run_dir.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in records] == [1, 2, 3]


def test_an_update_arriving_after_the_last_buffer_filled_is_refused_not_lost(
    tmp_path, stop_after, monkeypatch
) -> None:
    task = TinyTask()
    server = _server(tmp_path, task, rounds=1, strategy=fedbuff(3))
    stop_after.append(server)
    fp = task_fingerprint(task)
    a, b, c = (FakeSite(server.port, name, fp) for name in ("a", "b", "c"))
    stop_after += [a, b, c]
    jobs = {site.name: job(site) for site in (a, b, c)}
    base = server.coordinator.global_model.state
    # Hold the run's last version in the making until c's upload has been answered.
    answered = threading.Event()
    finalize = server.coordinator.finalize

    def slow_finalize(version: int, aggregate: Any) -> ModelState:
        assert answered.wait(20), "c's upload was never answered"
        return finalize(version, aggregate)

    monkeypatch.setattr(server.coordinator, "finalize", slow_finalize)
    upload(a, jobs["a"], 0.1, 10)
    upload(b, jobs["b"], 0.3, 30)  # the buffer of version 1, the last one, is full
    try:
        with pytest.raises(grpc.RpcError) as info:  # before the last version exists
            upload(c, jobs["c"], 1.0, 20)
    finally:
        answered.set()
    err = info.value
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "the run is over" in err.details()
    assert server.wait(20) and server.coordinator.error is None
    buffered = [r for r in _audit(server) if r["event"] == "update_buffered"]
    assert [(r["site"], r["version"]) for r in buffered] == [("a", 1), ("b", 1)]
    final = server.coordinator.global_model
    assert final.round == 1
    for name, tensor in final.state.items():
        torch.testing.assert_close(tensor, base[name] + 0.25)  # (10 * 0.1 + 30 * 0.3) / 40


def _cuts(server: AggregationServer) -> list[tuple[str, str]]:
    """(site, direction) of every transfer the server cut idle (audited `transfer_cut`)."""
    return [(r["site"], r["direction"]) for r in _audit(server) if r["event"] == "transfer_cut"]


def _idle_cut_server(
    tmp_path, stop_after, names: tuple[str, ...], task: TinyTask | None = None, **extra: Any
) -> tuple[AggregationServer, list[FakeSite], dict[str, pb.Instruction]]:
    """A FedBuff run (one version of one update unless said) whose transfers are cut
    idle after 3 s (stall_s = 1) while another waits, and the sites `names` joined with
    their jobs."""
    task = task or TinyTask()
    options = {"rounds": 1, "strategy": fedbuff(len(names), buffer_size=1), **extra}
    server = _server(tmp_path, task, transfers={"stall_s": 1.0}, **options)
    stop_after.append(server)
    sites = [FakeSite(server.port, name, task_fingerprint(task)) for name in names]
    stop_after += sites
    return server, sites, {site.name: job(site) for site in sites}


def test_a_silent_upload_under_fedbuff_does_not_hold_a_transfer_slot_for_the_run(
    tmp_path, stop_after
) -> None:
    """FedBuff has no round deadline: only the idle cut (3 x stall_s) frees the slot of a
    site that got its go-ahead and went silent, its connection still up."""
    task = TinyTask()
    server = _server(
        tmp_path,
        task,
        rounds=4,
        strategy=fedbuff(2, buffer_size=1),
        max_transfers=1,
        transfers={"stall_s": 1.0},
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    rogue, honest = (FakeSite(server.port, name, fp) for name in ("rogue", "honest"))
    stop_after += [rogue, honest]
    jobs = {site.name: job(site) for site in (rogue, honest)}
    release = threading.Event()
    rogue_job = jobs["rogue"]

    def silent() -> Iterator[pb.UpdateChunk]:
        yield rogue.header(rogue_job.round, num_examples=1, model_version=rogue_job.model_version)
        release.wait(60)

    ready = jobs["honest"]
    delta = ModelState({k: torch.full_like(v, 0.1) for k, v in _download(honest, "").items()})
    update = [
        honest.header(ready.round, num_examples=10, model_version=ready.model_version),
        *chunk_messages(delta.chunks(CHUNK)),
    ]
    call = rogue.stub.UploadUpdate.future(silent(), timeout=60)
    try:
        assert dict(call.initial_metadata()).get(wire.UPLOAD_GO_AHEAD) == "1"  # the only slot
        receipt = honest.stub.UploadUpdate(iter(update), timeout=10)
        assert receipt.bytes_received == delta.nbytes
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
    finally:
        release.set()
        call.cancel()
    err = info.value
    assert err.code() is grpc.StatusCode.UNAVAILABLE  # a broken link: the site resumes
    assert "the server cut the upload: no bytes moved from the site for 3s" in err.details()
    assert "keeps the 0 bytes it received for 180s" in err.details()
    assert _cuts(server) == [("rogue", "up")]  # once


def _stalled_upload(
    site: FakeSite,
    first: pb.UpdateChunk,
    chunks: list[pb.UpdateChunk],
    sent: int,
    other: FakeSite,
) -> tuple[str, grpc.RpcError]:
    """Send the header and `sent` chunks, then nothing, while `other` waits for the only
    slot to download the model: (the upload's id, how the server ended the stream)."""
    release = threading.Event()

    def stream() -> Iterator[pb.UpdateChunk]:
        yield first
        yield from chunks[:sent]
        release.wait(30)

    call = site.stub.UploadUpdate.future(stream(), timeout=30)
    downloaded: list[ModelState] = []
    waiting = threading.Thread(target=lambda: downloaded.append(_download(other, "")))
    try:
        upload_id = dict(call.initial_metadata())[wire.UPLOAD_ID]
        waiting.start()
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=20)
    finally:
        release.set()
        if waiting.ident is not None:
            waiting.join(20)
    assert downloaded, "the waiting download never got the slot"
    return upload_id, info.value


@pytest.mark.parametrize("resumed", ["within-grace", "after-grace"])
def test_an_upload_cut_idle_resumes_from_its_offset_within_the_grace_or_is_refused_after(
    tmp_path, stop_after, resumed
) -> None:
    grace = 30.0 if resumed == "within-grace" else 0.5
    server, (site, other), jobs = _idle_cut_server(
        tmp_path, stop_after, ("a", "b"), max_transfers=1, upload_grace_s=grace
    )
    work = jobs["a"]
    base = server.coordinator.global_model.state
    gen = torch.Generator().manual_seed(7)
    delta = ModelState({k: torch.randn(v.shape, generator=gen) for k, v in base.items()})
    first = site.header(work.round, num_examples=10, model_version=work.model_version)
    chunks = chunk_messages(delta.chunks(CHUNK))
    upload_id, err = _stalled_upload(site, first, chunks, 2, other)
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert f"keeps the {2 * CHUNK} bytes it received for {grace:g}s" in err.details()
    assert "resume the upload" in err.details()
    [cut] = [r for r in _audit(server) if r["event"] == "transfer_cut"]
    assert (cut["site"], cut["direction"], cut["bytes"], cut["waiting"]) == ("a", "up", 32, 1)
    assert cut["idle_s"] >= 3.0
    if resumed == "after-grace":
        wait_for(
            lambda: any(r["event"] == "upload_discarded" for r in _audit(server)),
            10,
            "the grace to pass",
        )
        refused = _refused(site, [_resume_header(first, upload_id)])
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "the site must start the upload again" in refused.details()
        # its job stays open (a failed upload ends no job): the site starts again from zero
        receipt = site.upload([first, *chunk_messages(delta.chunks(CHUNK))])
    else:
        offset, call = _resume(site, first, delta, upload_id)
        assert offset == 2 * CHUNK  # what arrived before the silence, nothing more
        receipt = call.result(timeout=10)
    assert receipt.bytes_received == delta.nbytes
    assert server.wait(20) and server.coordinator.error is None
    final = server.coordinator.global_model.state
    for name, tensor in final.items():  # one update, not stale: the model moves by it
        torch.testing.assert_close(tensor, base[name] + delta[name])
    held_twice = server.coordinator.transfers.total_in - delta.nbytes
    assert held_twice == (0 if resumed == "within-grace" else 2 * CHUNK)


def _resume_header(first: pb.UpdateChunk, upload_id: str) -> pb.UpdateChunk:
    header = pb.UpdateChunk()
    header.CopyFrom(first)
    header.header.resume_id = upload_id
    return header


def test_a_slow_upload_that_keeps_moving_and_one_waiting_for_its_slot_are_not_cut(
    tmp_path, stop_after
) -> None:
    """A chunk every 1.5 s (under the 3 s idle bound) for twice the bound holds the only
    slot: it is not cut, and the upload waiting for the slot meanwhile is not either
    (waiting for a slot is not holding one)."""
    server, (slow, waiting), jobs = _idle_cut_server(
        tmp_path,
        stop_after,
        ("slow", "waiting"),
        strategy=fedbuff(2, buffer_size=2),
        max_transfers=1,
        heartbeat={"interval_s": 0.2, "timeout_s": 30.0, "grace_s": 0.0},
    )
    base = server.coordinator.global_model.state
    delta = ModelState({k: torch.full_like(v, 0.5) for k, v in base.items()})
    chunks = chunk_messages(delta.chunks(CHUNK))
    assert len(chunks) >= 4
    started = threading.Event()

    def slowly() -> Iterator[pb.UpdateChunk]:
        work = jobs["slow"]
        yield slow.header(work.round, num_examples=10, model_version=work.model_version)
        started.set()
        for chunk in chunks:
            time.sleep(1.5)
            yield chunk

    call = slow.stub.UploadUpdate.future(slowly(), timeout=30)
    assert started.wait(10)
    wait_for(lambda: len(server.servicer.transfer_slots) == 1, 10, "the slow upload's slot")
    work = jobs["waiting"]
    first = waiting.header(work.round, num_examples=30, model_version=work.model_version)
    receipt = waiting.upload([first, *chunks])  # waits for the slot, then goes
    assert receipt.bytes_received == delta.nbytes
    assert call.result(timeout=30).bytes_received == delta.nbytes
    assert server.wait(20) and server.coordinator.error is None
    assert _cuts(server) == []
    for name, tensor in server.coordinator.global_model.state.items():
        torch.testing.assert_close(tensor, base[name] + 0.5)


def test_an_idle_upload_nobody_waits_for_keeps_its_slot(tmp_path, stop_after) -> None:
    """Bytes are counted by the chunk: a chunk on its way over a link slower than
    chunk_bytes / (3 x stall_s) looks idle. With a slot free for anyone, a cut would only
    throw that chunk away (for ever, on such a link), so the transfer is not cut."""
    server, (site,), jobs = _idle_cut_server(tmp_path, stop_after, ("a",))
    work = jobs["a"]
    delta = ModelState({k: torch.full_like(v, 0.5) for k, v in _download(site, "").items()})

    def late() -> Iterator[pb.UpdateChunk]:
        yield site.header(work.round, num_examples=10, model_version=work.model_version)
        time.sleep(5)  # a first chunk that takes 5 s to arrive; the bound is 3 s
        yield from chunk_messages(delta.chunks(CHUNK))

    receipt = site.stub.UploadUpdate(late(), timeout=30)
    assert receipt.bytes_received == delta.nbytes
    assert server.wait(20) and server.coordinator.error is None
    assert _cuts(server) == []


def _unread_stub(server: AggregationServer, stop_after: list[Any]) -> pb_grpc.FedtrainStub:
    """A stub on a connection whose receive windows stay at gRPC's 64 KiB (no BDP probe):
    a download it does not read blocks the server's writes after a few chunks (with the
    probe the windows grow to megabytes on a fast link, and a loaded machine lets them)."""
    options = [*wire.channel_options(64 << 20), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options)
    stop_after.append(channel)
    return pb_grpc.FedtrainStub(channel)


def _large_model(tmp_path, stop_after) -> tuple[AggregationServer, FakeSite, FakeSite]:
    """Two sites sharing one slot, whose model (16 MB) is more than gRPC's windows hold:
    a download the site does not read blocks the server's writes."""
    server, (a, b), _ = _idle_cut_server(
        tmp_path,
        stop_after,
        ("a", "b"),
        TinyTask(features=2_000_000),
        chunk_bytes=256 * 1024,
        max_transfers=1,
    )
    return server, a, b


def test_a_silent_download_under_fedbuff_frees_its_slot_and_resumes_from_its_offset(
    tmp_path, stop_after
) -> None:
    server, rogue, honest = _large_model(tmp_path, stop_after)
    version = server.coordinator.global_model.version
    stuck = _unread_stub(server, stop_after).DownloadModel(
        pb.ModelRequest(version=version, session_token=rogue.token), timeout=60
    )
    try:
        head = next(stuck)  # the manifest: the slot is granted, then nothing is read
        assert head.WhichOneof("kind") == "manifest"
        whole = _download(honest, version)  # the only slot, freed by the cut
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for piece in stuck:  # what the windows held, then the status
                received.append(piece.chunk)
    finally:
        stuck.cancel()
    err = info.value
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "the server cut this download" in err.details()
    assert "no bytes moved to the site for 3s" in err.details()
    assert "Continue it from the bytes received" in err.details()
    assert _cuts(server) == [("a", "down")]
    # the site continues from what it holds, and gets the same model
    offset = sum(len(c.data) for c in received)
    rest = list(
        rogue.stub.DownloadModel(
            pb.ModelRequest(version=version, session_token=rogue.token, offset=offset),
            timeout=20,
        )
    )
    assert rest[0].manifest == head.manifest
    assembler = StateAssembler([wire.spec_from_proto(s) for s in head.manifest.specs])
    for c in [*received, *(p.chunk for p in rest[1:])]:
        assembler.add(wire.chunk_from_proto(c))
    assert assembler.finish().equal(whole)
    audit = _audit(server)
    assert [r["offset"] for r in audit if r["event"] == "download_resumed"] == [offset]


def test_a_download_the_site_reads_slowly_is_not_cut(tmp_path, stop_after) -> None:
    """The server's writes block for longer than the idle bound in all, but each pause is
    shorter: a slow reader is not a silent one, though another site waits for its slot."""
    server, slow, other = _large_model(tmp_path, stop_after)
    version = server.coordinator.global_model.version
    pieces = _unread_stub(server, stop_after).DownloadModel(
        pb.ModelRequest(version=version, session_token=slow.token), timeout=60
    )
    head = next(pieces)  # the slot is the slow site's now
    downloaded: list[ModelState] = []
    waiting = threading.Thread(target=lambda: downloaded.append(_download(other, version)))
    waiting.start()
    received = 0
    try:
        for number, piece in enumerate(pieces):
            if number % 16 == 0:
                time.sleep(1.5)  # the windows fill, the server waits
            received += len(piece.chunk.data)
    finally:
        waiting.join(30)
    assert received == head.manifest.total_bytes
    assert downloaded  # once the slow site was done
    assert _cuts(server) == []


@pytest.mark.slow  # long scenario (20-33 s): run with -m slow
def test_a_site_that_never_reads_its_cut_downloads_cannot_pile_them_up(
    tmp_path, stop_after
) -> None:
    """gRPC keeps a cut download's stream, and its chunk, until the site reads on: a
    site may leave only UNREAD_CUTS of them unread before its downloads are refused."""
    server, rogue, honest = _large_model(tmp_path, stop_after)
    version = server.coordinator.global_model.version
    request = pb.ModelRequest(version=version, session_token=rogue.token)
    unread = _unread_stub(server, stop_after)
    stuck = []
    try:
        for cuts in range(1, UNREAD_CUTS + 1):
            stuck.append(unread.DownloadModel(request, timeout=60))
            next(stuck[-1])  # the manifest: the slot is granted, then nothing is read
            _download(honest, version)  # waits for the only slot: the rogue's is cut
            assert len(_cuts(server)) == cuts
        with pytest.raises(grpc.RpcError) as info:
            next(rogue.stub.DownloadModel(request, timeout=10))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "still unread" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stuck.pop():  # read one to its end: the cut's status
                pass
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        wait_for(
            lambda: len(server.registry.get("a").unread_cuts) < UNREAD_CUTS, 10, "the read end"
        )
        pieces = list(rogue.stub.DownloadModel(request, timeout=20))  # served again
        assert sum(len(p.chunk.data) for p in pieces[1:]) == pieces[0].manifest.total_bytes
    finally:
        for call in stuck:
            call.cancel()
