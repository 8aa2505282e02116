"""Transfers over parallel streams (`fedtrain.runtime.site.streams`, the ranges of
`fedtrain.runtime.server.resumable`).

The server in-process, driven over real gRPC: an upload cut into byte ranges, each on
a connection of its own, folds bit for bit like one sent on one stream; a range whose
stream breaks resumes only itself; rogue ranges (overlapping, past the update, past
their own end, on another site's upload, of a masked update) are refused and
audited; a download asked for in ranges reassembles exactly. Then real site daemons
with `transfer_streams` end a deterministic run with the same model as one stream.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from runtime_support import (
    CHUNK,
    FakeSite,
    TinyTask,
    chunk_messages,
    finish_alpha_beta_round,
    inprocess_server,
    wait_for,
)
from slow_link import SlowLink
from test_upload_resume import _audit, _break_after, _delta, _sites

from fedtrain.config import from_dict
from fedtrain.runtime import wire
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.proto import fedtrain_pb2_grpc as pb_grpc
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.site.daemon import SiteDaemon
from fedtrain.runtime.site.streams import (
    PARALLEL_CHUNK_BYTES,
    PROBE_MIN_BYTES,
    RangeCutter,
    StreamCount,
    stream_plan,
)
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState, StateAssembler

ROOT = Path(__file__).resolve().parents[2]


class Connections:
    """Channels of their own (separate connections) to the server, as a site's parallel
    streams use."""

    def __init__(self, port: int, count: int) -> None:
        options = wire.channel_options(64 * 1024 * 1024)
        self.channels = [
            grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(count)
        ]
        self.stubs = [pb_grpc.FedtrainStub(c) for c in self.channels]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _ranged(first: pb.UpdateChunk, start: int, end: int, upload_id: str = "") -> pb.UpdateChunk:
    header = pb.UpdateChunk()
    header.CopyFrom(first)
    header.header.range_start, header.header.range_end = start, end
    header.header.resume_id = upload_id
    return header


def _open_range(
    stub: Any,
    header: pb.UpdateChunk,
    chunks: list[pb.UpdateChunk],
    held: threading.Event | None = None,
    before: threading.Event | None = None,
) -> tuple[Any, dict[str, str]]:
    """Start one range's stream: its header, then (after `before`) `chunks`; it waits
    for `held` before it ends. (call, the go-ahead's metadata)."""

    def stream() -> Iterator[pb.UpdateChunk]:
        yield header
        if before is not None:
            before.wait(10)
        yield from chunks
        if held is not None:
            held.wait(10)

    call = stub.UploadUpdate.future(stream(), timeout=30)
    return call, dict(call.initial_metadata())


def _ranges(delta: ModelState, count: int) -> list[tuple[int, int]]:
    return wire.chunk_ranges([len(c.data) for c in delta.chunks(CHUNK)], count)


def _between(delta: ModelState, start: int, end: int) -> list[pb.UpdateChunk]:
    return chunk_messages(wire.chunks_between(delta.chunks(CHUNK), start, end))


def _send_ranges(
    stubs: list[Any], first: pb.UpdateChunk, delta: ModelState, ranges: list[tuple[int, int]]
) -> list[pb.UploadReceipt]:
    """The ranges of an upload, each on its own connection, all streaming at once: the
    first opens the upload, the others join it by its id; the first range's chunks go
    last (they arrive out of the update's order)."""
    go = threading.Event()
    first_range = _between(delta, *ranges[0])
    head, told = _open_range(stubs[0], _ranged(first, *ranges[0]), first_range, before=go)
    upload_id = told[wire.UPLOAD_ID]
    calls = []
    for stub, (start, end) in zip(stubs[1:], ranges[1:], strict=True):
        header = _ranged(first, start, end, upload_id)
        calls.append(_open_range(stub, header, _between(delta, start, end))[0])
    receipts = [call.result(timeout=30) for call in calls]
    go.set()
    return [*receipts, head.result(timeout=30)]


def test_an_update_over_parallel_streams_folds_bit_identically_to_one_stream(
    tmp_path, stop_after
) -> None:
    server, version, a, b, c = _sites(
        tmp_path, stop_after, ("alpha", "beta", "gamma"), rounds=1, strategy={"min_fit_clients": 2}
    )
    da, db = _delta(server, 1), _delta(server, 2)
    first = a.header(1, num_examples=10, model_version=version)
    ranges = _ranges(da, 3)
    assert len(ranges) == 3
    connections = Connections(server.port, 3)
    stop_after.append(connections)
    receipts = _send_ranges(connections.stubs, first, da, ranges)
    whole = [r for r in receipts if not r.partial]
    assert len(whole) == 1 and whole[0].bytes_received == da.nbytes
    assert whole[0].num_examples_counted == 10
    assert server.coordinator.transfers.total_in == da.nbytes  # nothing twice
    finish_alpha_beta_round(server, b, c, version, da, db)
    assert [r["bytes"] for r in _audit(server, "upload") if r["site"] == "alpha"] == [da.nbytes]


def test_a_broken_stream_resumes_only_its_own_range(tmp_path, stop_after) -> None:
    server, version, a, b, c = _sites(
        tmp_path, stop_after, ("alpha", "beta", "gamma"), rounds=1, strategy={"min_fit_clients": 2}
    )
    da, db = _delta(server, 1), _delta(server, 2)
    first = a.header(1, num_examples=10, model_version=version)
    (s0, e0), (s1, e1) = _ranges(da, 2)
    connections = Connections(server.port, 2)
    stop_after.append(connections)
    stubs = connections.stubs
    go, hang = threading.Event(), threading.Event()
    call0, told = _open_range(stubs[0], _ranged(first, s0, e0), _between(da, s0, e0), go)
    upload_id = told[wire.UPLOAD_ID]
    middle = _between(da, s1, e1)
    assert len(middle) >= 2
    # The second range's stream breaks after its first chunk...
    broken, _ = _open_range(stubs[1], _ranged(first, s1, e1, upload_id), middle[:1], hang)
    go.set()
    held = server.servicer.held
    size = (e0 - s0) + len(middle[0].chunk.data)
    wait_for(lambda: (u := held.of_site("alpha")) and u.offset == size, 10, "alpha's chunks")
    broken.cancel()
    hang.set()
    wait_for(lambda: _audit(server, "upload_paused"), 10, "the server to keep the range")
    assert call0.result(timeout=30).partial  # the first range is in, whatever the second does
    # ...and resumes from where the server holds it; the other ranges are not sent again.
    resumed, told = _open_range(stubs[1], _ranged(first, s1, e1, upload_id), [], hang)
    offset = int(told[wire.UPLOAD_OFFSET])
    assert offset == s1 + len(middle[0].chunk.data)
    resumed.cancel()  # (it sent nothing: paused again)
    wait_for(lambda: len(_audit(server, "upload_paused")) == 2, 10, "the second pause")
    rest = chunk_messages(wire.chunks_between(da.chunks(CHUNK), offset, e1))
    receipt, _ = _open_range(stubs[1], _ranged(first, s1, e1, upload_id), rest)
    assert not receipt.result(timeout=30).partial
    assert server.coordinator.transfers.total_in == da.nbytes  # not one byte twice
    finish_alpha_beta_round(server, b, c, version, da, db)
    resumes = [r["offset"] for r in _audit(server, "upload_resumed")]
    assert resumes == [offset, offset]


def test_a_plain_call_cut_for_streams_ends_its_range_where_the_server_holds_it(
    tmp_path, stop_after
) -> None:
    """A site cuts its plain call (no range) for parallel streams: resumed, its range may
    end sooner, but not before what the server holds; ranges of their own take the rest
    and the update folds bit for bit like one unbroken upload."""
    server, version, a, b, c = _sites(
        tmp_path, stop_after, ("alpha", "beta", "gamma"), rounds=1, strategy={"min_fit_clients": 2}
    )
    da, db = _delta(server, 1), _delta(server, 2)
    first = a.header(1, num_examples=10, model_version=version)
    chunks = chunk_messages(da.chunks(CHUNK))
    assert len(chunks) >= 4
    upload_id = _break_after(server, a, first, chunks, 2)  # the cut call
    held = sum(len(m.chunk.data) for m in chunks[:2])
    with pytest.raises(grpc.RpcError) as info:  # its range cannot end before what it holds
        a.upload([_ranged(first, 0, held - len(chunks[1].chunk.data), upload_id)])
    assert "holds" in info.value.details()
    ended, told = _open_range(a.stub, _ranged(first, 0, held, upload_id), [])
    assert int(told[wire.UPLOAD_OFFSET]) == held
    assert ended.result(timeout=30).partial  # its range is in, and ends there
    connections = Connections(server.port, 2)
    stop_after.append(connections)
    ranges = wire.chunk_ranges([len(m.chunk.data) for m in chunks[2:]], 2)
    receipts = []
    for stub, (start, end) in zip(connections.stubs, ranges, strict=True):
        header = _ranged(first, held + start, held + end, upload_id)
        call, _ = _open_range(stub, header, _between(da, held + start, held + end))
        receipts.append(call.result(timeout=30))
    assert [r.partial for r in receipts].count(False) == 1
    assert server.coordinator.transfers.total_in == da.nbytes  # not one byte twice
    finish_alpha_beta_round(server, b, c, version, da, db)


def test_rogue_ranges_are_refused_and_audited(tmp_path, stop_after) -> None:
    server, version, a, b = _sites(tmp_path, stop_after)
    da = _delta(server, 1)
    first = a.header(1, num_examples=10, model_version=version)
    (s0, e0), (s1, e1), (s2, e2) = _ranges(da, 3)
    go = threading.Event()
    opened, told = _open_range(a.stub, _ranged(first, s0, e0), _between(da, s0, e0), before=go)
    upload_id = told[wire.UPLOAD_ID]

    def refused(site: FakeSite, header: pb.UpdateChunk, chunks: list[Any]) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            site.upload([header, *chunks])
        return info.value

    # A range that overlaps one the upload has...
    err = refused(a, _ranged(first, e0 - CHUNK, e1, upload_id), [])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "overlaps" in err.details()
    # ...or runs past the update, or names another site's upload, is refused.
    err = refused(a, _ranged(first, e2, e2 + CHUNK, upload_id), [])
    assert "out of range" in err.details()
    stolen = b.header(1, num_examples=10, model_version=version)
    err = refused(b, _ranged(stolen, s1, e1, upload_id), [])
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED
    # Refused streams leave the upload alone: its first range still goes in...
    go.set()
    assert opened.result(timeout=30).partial
    # ...but a stream that sends more than its range is refused and the upload discarded.
    beyond = _between(da, s1, e2)[: len(_between(da, s1, e1)) + 1]
    err = refused(a, _ranged(first, s1, e1, upload_id), beyond)
    assert (
        err.code() is grpc.StatusCode.INVALID_ARGUMENT
        and "past its stream's range" in err.details()
    )
    err = refused(a, _ranged(first, s2, e2, upload_id), [])
    assert "no upload" in err.details()
    rejected = [(r["site"], r["code"]) for r in _audit(server, "upload_rejected")]
    assert rejected == [
        ("alpha", "INVALID_ARGUMENT"),
        ("alpha", "INVALID_ARGUMENT"),
        ("beta", "PERMISSION_DENIED"),
        ("alpha", "INVALID_ARGUMENT"),
        ("alpha", "FAILED_PRECONDITION"),
    ]
    assert server.coordinator.current.aggregate.count == 0


def test_a_masked_update_is_refused_in_ranges(tmp_path, stop_after) -> None:
    """Masked vectors fold into the secure sum in order: one stream only."""
    from fedtrain.runtime.server.resumable import HeldUpload
    from fedtrain.runtime.server.rounds import UploadRefused
    from fedtrain.runtime.server.uploads import MaskedUpload

    sink = MaskedUpload(8, 16, lambda offset, values: False)
    held = HeldUpload("alpha", "t", b"", None, (), sink)
    with pytest.raises(UploadRefused, match="one stream"):
        held.attach(None, 0, 16)
    lane, _, offset, _ = held.attach(None, 0, 0)
    assert (lane.start, lane.end, offset) == (0, 32, 0)


def test_two_ranges_that_end_together_complete_the_upload_once_and_neither_is_told_to_resume(
    tmp_path,
) -> None:
    """The last two ranges' final chunks are in; the first stream to finish commits the
    update. The second used to be told "superseded": the server then told the site its
    stream was cut and to resume an upload that had completed (the site reported its
    round failed, the receipt of the counted update lost)."""
    import torch

    from fedtrain.runtime.server.resumable import HeldUpload, Superseded
    from fedtrain.runtime.server.uploads import UpdateSpool

    update = ModelState({"w": torch.arange(64, dtype=torch.float32)})
    chunks = list(update.chunks(64))
    with UpdateSpool(update.specs, tmp_path, 64) as spool:
        held = HeldUpload("alpha", "t", b"", None, (), spool)
        (a, ga, _, _), (b, gb, _, _) = held.attach(None, 0, 128), held.attach(None, 128, 256)
        for lane, generation, part in ((a, ga, chunks[:2]), (b, gb, chunks[2:])):
            for chunk in part:
                held.add(lane, generation, chunk, lambda: None)
        assert held.finish(b, gb) is True  # this stream commits
        assert held.finish(a, ga) is False  # its range is in: a partial receipt
        discarded = HeldUpload("alpha", "t", b"", None, (), spool)
        lane, generation, _, _ = discarded.attach(None, 0, 128)
        discarded.end("its grace passed")
        with pytest.raises(Superseded):  # a discarded one still says so
            discarded.finish(lane, generation)


def test_a_download_in_ranges_reassembles_the_model_exactly(tmp_path, stop_after) -> None:
    server, version, a, _ = _sites(tmp_path, stop_after)
    connections = Connections(server.port, 3)
    stop_after.append(connections)
    manifest, _ = a.download(version)
    total = manifest.total_bytes
    assembler = StateAssembler([wire.spec_from_proto(s) for s in manifest.specs])
    cutter, count = RangeCutter(0, total), StreamCount.fixed(2)
    ranges = list(iter(lambda: cutter.take(count), None))
    assert len(ranges) >= 5
    for number, (start, end) in enumerate(ranges):
        request = pb.ModelRequest(version=version, session_token=a.token, offset=start, end=end)
        pieces = list(connections.stubs[number % 3].DownloadModel(request))
        assert pieces[0].manifest == manifest
        for piece in pieces[1:]:
            assembler.add(wire.chunk_from_proto(piece.chunk))  # refuses any byte twice
    assert assembler.finish().equal(server.coordinator.global_model.state)
    assert _audit(server, "download_resumed") == []  # a range is not a resumed download


def test_the_site_chooses_the_stream_count_and_a_single_chunk_travels_alone() -> None:
    automatic = stream_plan(0, 40 << 20)
    assert automatic.adaptive and automatic.current == 1 and automatic.limit == 64
    assert automatic.alone and not automatic.parallel  # a plain call, until it is judged
    assert stream_plan(0, 40 << 20, start=(16, None)).current == 16  # the last one's say
    assert not stream_plan(0, PROBE_MIN_BYTES - 1).parallel  # small: never probed
    fixed = stream_plan(8, 40 << 20)  # site.toml's choice
    assert (fixed.current, fixed.adaptive) == (8, False)
    assert not stream_plan(8, PARALLEL_CHUNK_BYTES).parallel  # nothing to share out


def _flat_run(
    tmp_path: Path,
    stop_after: list[Any],
    streams: int | None,
    pki: Any = None,
    num_params: int = 200_000,
    link: Callable[[int], SlowLink] | None = None,
    dialled: list[object] | None = None,
    inspect: Callable[[Any], None] = lambda _: None,
    **server_options: Any,
) -> ModelState:
    """Two rounds of the deterministic benchmark task (800 KB, 64 KiB chunks) with a
    real site daemon using `streams` parallel streams (None: site.toml's default; with
    `pki`: over TLS; with `link`: through that slow link; `dialled` gets each parallel
    stream's connection the daemon dials); the final global model (one site: two
    sites' updates may fold in either order, which is not bit-stable). `inspect(server)`
    sees the started server before the site joins; `server_options` go into its config."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.flat_task import FlatTask

    options = {"num_params": num_params, "incompressible": True}
    task = FlatTask(**options)
    server = inprocess_server(
        tmp_path / str(streams),
        task,
        sites=1,
        rounds=2,
        chunk_bytes=64 * 1024,
        pki=pki,
        **server_options,
    )
    stop_after.append(server)
    inspect(server)
    port = server.port
    if link is not None:  # the site dials the server through it
        proxy = link(server.port).__enter__()
        stop_after.append(proxy)
        port = proxy.port
    for name in ("hospital-a",):
        raw: dict[str, Any] = {
            "task": "benchmarks.flat_task:FlatTask",
            "task_options": options,
            "name": name,
            "server": f"127.0.0.1:{port}",
            "reconnect": {"min_s": 0.1, "max_s": 0.5},
        }
        if streams is not None:
            raw["transfer_streams"] = streams
        if pki is not None:
            raw["tls"] = {
                "ca": str(pki.ca_cert),
                "cert": str(pki.site_cert),
                "key": str(pki.site_key),
            }
        daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=pki is None, task=task)
        if dialled is not None:
            dial = daemon._dial_stream

            def counted(link: Any, dial: Any = dial) -> Any:
                dialled.append(link)
                return dial(link)

            daemon._dial_stream = counted  # type: ignore[method-assign]
        threading.Thread(target=daemon.run, daemon=True).start()
        stop_after.append(daemon)
    assert server.wait(90), "the run did not finish"
    assert server.coordinator.error is None
    return server.coordinator.global_model.state


def test_site_daemons_over_parallel_streams_end_with_the_model_of_one_stream(
    tmp_path, stop_after, caplog
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    parallel = _flat_run(tmp_path, stop_after, 4)
    assert "uploading over 4 streams" in caplog.text
    assert "downloading over 4 streams" in caplog.text
    single = _flat_run(tmp_path, stop_after, 1)
    assert parallel.equal(single)


def _automatic_counts(log_text: str) -> list[list[int]]:
    """The counts each automatic transfer tried, from the daemon's log."""
    found = re.findall(r"over ([0-9 >-]+) streams \(automatic", log_text)
    return [[int(n) for n in counts.split(" -> ")] for counts in found]


def _transfers(log_text: str) -> dict[str, list[list[int]]]:
    """The counts each automatic transfer tried, per direction, in order."""
    found = re.findall(r"(downloaded|uploaded) over ([0-9 >-]+) streams \(automatic", log_text)
    out: dict[str, list[list[int]]] = {"downloaded": [], "uploaded": []}
    for what, counts in found:
        out[what].append([int(n) for n in counts.split(" -> ")])
    return out


def _paced(down: float, up: float) -> Callable[[int], SlowLink]:
    """A link where each connection moves `down` / `up` B/s on its own (one TCP flow's
    share of a lossy, long link: more flows move more)."""

    def link(port: int) -> SlowLink:
        paced = SlowLink(port, down, per_connection=True, buffer_bytes=64 * 1024)
        paced.up_rate = up
        return paced

    return link


BIG = 1_500_000  # 6 MB: past PROBE_MIN_BYTES; 12 s for one 0.5 MB/s flow


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_slow_upload_is_cut_from_one_call_to_ranges_and_the_next_starts_where_it_stayed(
    tmp_path, stop_after, caplog
) -> None:
    """Uploads through flows of 0.5 MB/s, downloads fast, `transfer_streams = 0`: the
    first upload starts as one plain call, is cut where it stands (the server keeps what
    it received and lets the call's range end there) and moves the rest over more
    streams; the second starts at the count the first stayed at. Downloads stay one
    call. The run ends with the model of one plain stream."""
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.site.daemon")
    # 24 MB: the site's socket buffers on loopback take ~4 MB at once, which would leave
    # a 6 MB upload too little to judge
    size = 4 * BIG
    cut = _flat_run(tmp_path / "cut", stop_after, 0, num_params=size, link=_paced(50e6, 0.5e6))
    moved = _transfers(caplog.text)
    assert moved["downloaded"] == [[1], [1]], moved
    first, second = moved["uploaded"]
    # (where the first ended mid-probe, the second starts at its best measured count)
    # (measured from the call's first, smaller chunks, it steps as far as its rate says)
    assert first[0] == 1 and len(first) > 1 and second[0] > 1 and second[0] in first, moved
    single = _flat_run(tmp_path / "one", stop_after, 1, num_params=size)
    assert cut.equal(single)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_slow_download_is_cut_for_ranges_and_the_first_upload_starts_from_its_count(
    tmp_path, stop_after, caplog
) -> None:
    """Flows of 0.5 MB/s both ways (a lossy link): the first download is cut from one
    call to ranges over more streams (measured from the server's small first pieces, as
    many as its rate says: 16); the first upload, with no count of its own yet,
    starts at the download's, and the second download at the first's (not half of it).
    A clean link one flow fills (3 MB/s shared by all connections): every transfer is
    one plain call. Either way the run ends with the model of one plain stream."""
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.site.daemon")
    lossy = _flat_run(tmp_path / "lossy", stop_after, 0, num_params=BIG, link=_paced(0.5e6, 0.5e6))
    moved = _transfers(caplog.text)
    (down1, down2), (up1, _) = moved["downloaded"], moved["uploaded"]
    assert down1[0] == 1 and down1[-1] > 1, moved
    assert up1[0] == down1[-1] and down2[0] == down1[-1], moved
    caplog.clear()

    def clean(port: int) -> SlowLink:
        return SlowLink(port, 3e6, buffer_bytes=64 * 1024)

    alone = _flat_run(tmp_path / "clean", stop_after, 0, num_params=BIG, link=clean)
    assert _automatic_counts(caplog.text) == [[1]] * 4
    single = _flat_run(tmp_path / "one", stop_after, 1, num_params=BIG)
    assert lossy.equal(single) and alone.equal(single)


@pytest.mark.integration
def test_a_fast_transfer_never_opens_a_second_connection(tmp_path, stop_after, caplog) -> None:
    """On loopback, with the automatic count, a 6 MB model's downloads and uploads are
    one plain call each, as with one fixed stream (before, the automatic count moved
    them in ranges, several times slower on a fast link): no range is asked for and no
    parallel stream is ever dialled."""
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    dialled: list[object] = []
    _flat_run(tmp_path, stop_after, 0, num_params=BIG, dialled=dialled)
    assert _automatic_counts(caplog.text) == [[1]] * 4
    assert "downloading over" not in caplog.text and "uploading over" not in caplog.text
    assert dialled == []


@pytest.mark.integration
def test_with_tls_site_daemons_over_parallel_streams_end_with_the_model_of_one_stream(
    pki, tmp_path, stop_after, caplog
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    parallel = _flat_run(tmp_path, stop_after, 3, pki)
    assert "uploading over 3 streams" in caplog.text
    assert "shares the control connection" not in caplog.text  # each its own connection
    assert parallel.equal(_flat_run(tmp_path / "plain", stop_after, 1))


def _tls_control(
    channel: grpc.Channel, who: Any, fingerprint: str, attach_to: str = ""
) -> tuple[pb.ServerMessage, Any, Any]:
    """Open Control like a site with TLS (answer the challenge with `who`'s proof); with
    `attach_to`, as a parallel stream's connection of that session. (answer, call,
    request queue)."""
    import queue

    requests: queue.SimpleQueue[pb.SiteMessage | None] = queue.SimpleQueue()
    call = pb_grpc.FedtrainStub(channel).Control(iter(requests.get, None), timeout=30)
    challenge = next(call)
    assert challenge.WhichOneof("kind") == "challenge"
    join = pb.Join(
        task_fingerprint=fingerprint, protocol_version=wire.PROTOCOL_VERSION, attach_to=attach_to
    )
    join.proof.CopyFrom(who.proof("join", challenge.challenge.nonce, "127.0.0.1"))
    requests.put(pb.SiteMessage(join=join))
    return next(call), call, requests


@pytest.mark.integration
def test_with_tls_a_connection_carries_a_sessions_streams_only_once_it_proved_its_certificate(
    pki, tmp_path, stop_after
) -> None:
    from fedtrain.runtime import tls
    from fedtrain.runtime.peer_auth import client_identity

    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=2, pki=pki, allowed_sites=["hospital-a", "hospital-b"]
    )
    stop_after.append(server)
    address, fp = f"127.0.0.1:{server.port}", task_fingerprint(task)
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    other = client_identity(*tls.issue_site(pki.ca_dir, tmp_path / "b", "hospital-b"), pki.ca_cert)
    version = server.coordinator.global_model.version
    stop_after.append(connections := Connections(server.port, 0))
    channels = [grpc.secure_channel(address, c.credentials) for c in (site, site, other)]
    connections.channels += channels
    joined, extra, thief = channels
    welcome, *control = _tls_control(joined, site, fp)
    token = welcome.welcome.session_token
    request = pb.ModelRequest(version=version, session_token=token, offset=0, end=CHUNK)

    def download(channel: grpc.Channel) -> list[pb.ModelPiece]:
        return list(pb_grpc.FedtrainStub(channel).DownloadModel(request, timeout=10))

    with pytest.raises(grpc.RpcError) as info:  # the token alone: refused
        download(extra)
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    answer, *attached = _tls_control(extra, site, fp, attach_to=token)
    assert answer.WhichOneof("kind") == "welcome" and answer.welcome.session_token == token
    assert download(extra)[0].manifest.model_version == version  # now it carries transfers
    # Another site's certificate cannot make its connection carry hospital-a's streams.
    refusal, *_ = _tls_control(thief, other, fp, attach_to=token)
    assert refusal.WhichOneof("kind") == "reject" and "not its own" in refusal.reject.reason
    with pytest.raises(grpc.RpcError):
        download(thief)
    attached[1].put(None)  # the parallel connection's stream ends: it carries no more
    session = server.registry.get("hospital-a")
    wait_for(lambda: not session.connections, 10, "the connection to be dropped")
    with pytest.raises(grpc.RpcError):
        download(extra)
    refused = read_audit(server.run_dir.path / "audit.jsonl", "join_refused")
    assert [r["cause"] for r in refused] == ["other_session"]
    control[1].put(None)


def test_a_range_stream_left_open_and_silent_frees_its_slot_once_its_round_closed(
    tmp_path, stop_after
) -> None:
    """A rogue site opens one range of its upload and never sends it, keeping the stream
    open (gRPC answers keepalive pings for it): once the round closed, the upload is
    discarded and its transfer slot freed. Before, only an upload with no stream was
    swept, so each such round left one of the server's `max_transfers` slots (and the
    journal) held for as long as the site stayed connected."""
    server, version, a, b = _sites(tmp_path, stop_after, strategy={"min_fit_clients": 1})
    da, db = _delta(server, 1), _delta(server, 2)
    (s0, e0), _ = _ranges(da, 2)
    hang = threading.Event()
    try:
        first = a.header(1, num_examples=10, model_version=version)

        def silent() -> Iterator[pb.UpdateChunk]:
            yield _ranged(first, s0, e0)
            hang.wait(60)

        call = a.stub.UploadUpdate.future(silent(), timeout=60)
        call.initial_metadata()  # the go-ahead: the stream holds its slot
        slots = server.servicer.transfer_slots
        assert len(slots) == 1
        a.report_error(1, "never sends its range")  # its round ends without it
        b.upload(
            [b.header(1, num_examples=30, model_version=version), *chunk_messages(db.chunks(CHUNK))]
        )
        wait_for(lambda: getattr(server.coordinator.current, "round", 0) == 2, 20, "round 2")
        wait_for(lambda: len(slots) == 0, 10, "the silent stream's slot to be freed")
        assert len(server.servicer.held) == 0
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
        assert info.value.code() is grpc.StatusCode.ABORTED
        assert "round closed" in info.value.details()
        assert [r["site"] for r in _audit(server, "upload_discarded")] == ["alpha"]
    finally:
        hang.set()


def test_an_upload_whose_only_range_was_refused_is_discarded_after_its_grace(
    tmp_path, stop_after
) -> None:
    """A first range past the update is refused before the go-ahead; the upload it
    opened (its journal, the site marked as uploading) had no stream and no time it
    broke off, so no grace ever ran out for it: it stayed until the round closed (under
    FedBuff, for the whole run)."""
    server, version, a, _ = _sites(tmp_path, stop_after, upload_grace_s=0.5)
    size = _delta(server, 1).nbytes
    first = a.header(1, num_examples=10, model_version=version)
    with pytest.raises(grpc.RpcError) as info:
        a.upload([_ranged(first, size, size + CHUNK)])
    assert "out of range" in info.value.details()
    discarded = wait_for(lambda: _audit(server, "upload_discarded"), 10, "the grace to pass")
    assert [r["site"] for r in discarded] == ["alpha"]
    assert "upload_grace_s" in discarded[0]["reason"]
    assert len(server.servicer.held) == 0 and "alpha" not in server.coordinator.current.uploading
