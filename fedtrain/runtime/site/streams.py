"""Parallel streams: one transfer spread over several connections to the server.

One TCP flow under loss-based congestion control (cubic, reno) collapses on a lossy,
long link: its window is cut at every loss, and it grows back one segment per round
trip, so its rate is about MSS / RTT x 1.22 / sqrt(loss) whatever the link's capacity
(Mathis et al.): 3.5 Mbit/s at 40 ms and 1% loss, on a 100 Mbit/s link. K flows get
about K times that until they fill the link. gRPC multiplexes every call of a channel
over one connection, so each stream has a channel (a connection) of its own.

A transfer's bytes are cut into ranges, several per stream, that the streams take one
after another from a shared queue: a flow that a burst of losses slowed down takes
fewer ranges, instead of the whole transfer waiting for its fixed share. Uploads
use the server's resumable addressing (`resumable.py` there): the first range opens
the upload and learns its id, every other range joins it (UploadHeader.resume_id
and range_start/range_end), and a stream that breaks resumes only its own range.
Downloads ask for byte ranges of the same download (ModelRequest.offset/end); the
chunks of all streams go into one `StateAssembler`, which refuses any byte twice.

How many streams (`transfer_streams` in site.toml): the site's choice; 0 (automatic)
is one stream for now. Measured on the emulated 100 Mbit/s, 40 ms links
(benchmarks/RESULTS.md "WAN: parallel streams"): at 1% loss under cubic 32 / 64
streams reach 58% / 68% of the line rate where one reaches 3%, but on a clean link they
cost (79% with 32 against 89% with one), one BBR stream beats them at 1% loss (84%),
and with many streams the server's download-rate estimate
(`links.py`) reads high by what the streams' buffers hold. No fixed count serves both
links, so the automatic choice stays at one until it adapts to the measured rate
(probe more streams while they raise it). A stream costs the server a connection (a
file descriptor, ~50 KB) while it transfers; the streams of one transfer share one of
the server's `max_transfers` slots.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fedtrain.errors import ProtocolError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.tensors import Chunk, torch_dtype

_T = TypeVar("_T")

#: Ranges per stream: streams that run fast take more of them.
RANGES_PER_STREAM = 4
#: Upload chunks are at most this large with parallel streams (the server accepts any
#: chunk up to its chunk_bytes), so that there are enough ranges to share out; the
#: server cuts a ranged download's chunks as finely.
PARALLEL_CHUNK_BYTES = wire.RANGE_CHUNK_BYTES


class UpdateChunks:
    """An update's chunks, made anew for each stream (or range) of its upload: cheap
    `pieces` (views of the model, or of the encoded update), turned into the update's
    chunks by `convert` (the delta of each) only for the chunks a stream sends."""

    def __init__(
        self,
        pieces: Callable[[], Iterator[Chunk]],
        convert: Callable[[Chunk], Chunk] | None = None,
    ) -> None:
        self._pieces = pieces
        self._convert = convert

    def __call__(self) -> Iterator[Chunk]:
        return self.between(0, None)

    def sizes(self) -> list[int]:
        return [len(piece.data) for piece in self._pieces()]

    def between(self, start: int, end: int | None) -> Iterator[Chunk]:
        """The chunks of bytes [start, end) (None: to the end), chunk boundaries."""
        pieces = (
            wire.chunks_after(self._pieces(), start)
            if end is None
            else wire.chunks_between(self._pieces(), start, end)
        )
        return pieces if self._convert is None else map(self._convert, pieces)


def stream_count(configured: int, nbytes: int) -> int:
    """Streams for a transfer of `nbytes`: `configured`, or (0) the automatic choice
    (one: see the module doc); a transfer of one chunk or less has nothing to share."""
    if configured <= 0 or nbytes <= PARALLEL_CHUNK_BYTES:
        return 1
    return configured


@dataclass
class SharedUpload:
    """The id the server gave the upload (at the first range's go-ahead): the other
    ranges wait for it, then join the upload under it."""

    id: str = ""
    known: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)

    def told(self, upload_id: str) -> None:
        self.id = upload_id
        self.known.set()

    def wait(self) -> bool:
        """Until the id is known (True) or the upload failed (False)."""
        while not self.known.wait(0.2):
            if self.failed.is_set():
                return False
        return True


def run_ranges(
    ranges: Sequence[tuple[int, int]],
    streams: int,
    send: Callable[[int, tuple[int, int]], _T],
    upload: SharedUpload | None = None,
    stop: threading.Event | None = None,
) -> list[_T]:
    """`send(stream, range)` for every range, on `streams` threads that take the ranges
    in turn; the first range goes first, and with `upload` the others start once its
    id is known. Returns the results in range order; the first failure is raised once
    every stream has stopped (none takes a new range after it, nor after `stop`)."""
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(1, len(ranges)):
        pending.put(index)
    results: dict[int, _T] = {}
    failed = upload.failed if upload is not None else (stop or threading.Event())

    def stream(number: int) -> None:
        try:
            if number == 0:
                results[0] = send(0, ranges[0])
            elif upload is not None and not upload.wait():
                return
            while not failed.is_set():
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    return
                results[index] = send(number, ranges[index])
        except BaseException:
            failed.set()
            raise

    count = max(1, min(streams, len(ranges)))
    with ThreadPoolExecutor(count, thread_name_prefix="fedtrain-stream") as pool:
        futures: list[Future[None]] = [pool.submit(stream, n) for n in range(count)]
    for future in futures:
        future.result()
    return [results[i] for i in range(len(ranges))]


def completed(receipts: Sequence[pb.UploadReceipt]) -> pb.UploadReceipt:
    """The receipt of the stream that completed an upload (the others are partial)."""
    whole = [r for r in receipts if not r.partial]
    if len(whole) != 1:
        raise ProtocolError(
            f"{len(whole)} of the upload's {len(receipts)} streams were told the update is "
            "complete (exactly one should be)"
        )
    return whole[0]


def byte_ranges(start: int, end: int, count: int) -> list[tuple[int, int]]:
    """[start, end) cut into `count` ranges of about equal size (a download's: the
    server sends each range's chunks that start in it, so no boundary is needed)."""
    size = end - start
    count = max(1, min(count, size))
    cuts = [start + size * i // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


def chunk_positions(manifest: pb.Manifest) -> dict[str, int]:
    """Where each tensor of a download starts in its bytes (the server sends the
    tensors in the manifest's order: its parts when encoded, else its specs)."""
    specs = manifest.parts if manifest.parts else manifest.specs
    starts, position = {}, 0
    for spec in specs:
        starts[spec.name] = position
        count = 1
        for dim in spec.shape:
            count *= dim
        position += count * torch_dtype(spec.dtype).itemsize
    return starts


_DONE = object()


def merged(
    ranges: Sequence[tuple[int, int]],
    streams: int,
    fetch: Callable[[int, tuple[int, int]], Iterator[Chunk]],
) -> Iterator[Chunk]:
    """The chunks of every range, fetched by `streams` threads (`fetch(stream, range)`
    yields one range's chunks), in the order they arrive; a stream's failure is
    raised here."""
    arrived: queue.SimpleQueue[object] = queue.SimpleQueue()
    stop = threading.Event()  # the reader gave up: no stream starts another range

    def send(number: int, byte_range: tuple[int, int]) -> None:
        for chunk in fetch(number, byte_range):
            arrived.put(chunk)

    def run() -> None:
        try:
            run_ranges(ranges, streams, send, stop=stop)
        except BaseException as exc:
            arrived.put(exc)
        arrived.put(_DONE)

    threading.Thread(target=run, name="fedtrain-download", daemon=True).start()
    try:
        while (item := arrived.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, Chunk)
            yield item
    finally:
        stop.set()
