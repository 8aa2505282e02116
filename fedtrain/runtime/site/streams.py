"""Parallel streams: one transfer spread over several connections to the server.

One TCP flow under loss-based congestion control (cubic, reno) collapses on a lossy,
long link: its window is cut at every loss, and it grows back one segment per round
trip, so its rate is about MSS / RTT x 1.22 / sqrt(loss) whatever the link's capacity
(Mathis et al.): 3.5 Mbit/s at 40 ms and 1% loss, on a 100 Mbit/s link. K flows get
about K times that until they fill the link. gRPC multiplexes every call of a channel
over one connection, so each stream has a channel (a connection) of its own.

A transfer's bytes are cut into ranges, several per stream, that the streams take one
after another as they get free: a flow that a burst of losses slowed down takes fewer
ranges, instead of the whole transfer waiting for its fixed share. Uploads
use the server's resumable addressing (`resumable.py` there): the first range opens
the upload and learns its id, every other range joins it (UploadHeader.resume_id
and range_start/range_end), and a stream that breaks resumes only its own range.
Downloads ask for byte ranges of the same download (ModelRequest.offset/end); the
chunks of all streams go into one `StateAssembler`, which refuses any byte twice.

How many streams (`transfer_streams` in site.toml): the site's choice (default one),
or 0 (automatic), which adapts to the link per transfer and per direction. Not the
default: ranges cost CPU per chunk, and on a fast link (a 400 MB model on loopback)
even the automatic choice's first, ranged stream moved 3-4x slower than one call
(benchmarks/RESULTS.md, "The automatic count: not the default"). Measured on the
emulated 100 Mbit/s, 40 ms links (benchmarks/RESULTS.md "WAN: parallel streams"): at 1%
loss under cubic 32 / 64 streams reach 58% / 68% of the line rate where one reaches 3%,
but on a clean link they cost (79% with 32 against 89% with one), and with many streams
the server's download-rate estimate (`links.py`) reads high by what the streams'
buffers hold. No fixed count serves both links, so `StreamCount` starts from one and
multiplies the count by GROWTH (4) while the streams raise the rate the transfer moves
its bytes at by more than GAIN, measured after a warm-up (a new connection's handshake
and slow start are not "no gain"); when a step does not pay, the streams it added
finish their range and take no other; a count that stopped is probed again every
REPROBE_S (what limited it, e.g. a server busy with other sites, may have gone). A
clean link so keeps one stream (after a probe of four for about a second), a lossy one
gets many. The next transfer in the same direction starts from half the count this
one stayed at; one that stayed at one stream tells the next the rate it had, and the
next is one call, as with `transfer_streams = 1`, measured: if it moves slower, the one
after probes (a clean link pays the probe once, not every transfer). Transfers under
PROBE_MIN_BYTES are not probed.

Ranges are cut as the streams ask for them (`RangeCutter`): what the asking stream
moved in RANGE_S at its last range's rate, at most 1 / (RANGES_PER_STREAM x streams)
of what is left, so that streams added later find some and no slow stream is left
holding a large range at the end.
Each stream keeps LANES calls in flight on its connection, so the round trips between
ranges (an upload's go-ahead and receipt, a download's request) leave no link time
idle. The server accepts at most wire.MAX_UPLOAD_RANGES ranges per upload: no range is
shorter than 1 / that of it.

A stream costs the server a connection (a file descriptor, ~50 KB) while it
transfers; the streams of one transfer share one of the server's `max_transfers` slots.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fedtrain.errors import ProtocolError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.tensors import Chunk, torch_dtype

_T = TypeVar("_T")
log = logging.getLogger(__name__)

#: Ranges per stream: streams that run fast take more of them (a range is cut to
#: 1 / (RANGES_PER_STREAM x streams) of what is left, so they shrink towards the end).
RANGES_PER_STREAM = 4
#: Calls in flight on each stream's connection: while one waits for its go-ahead, its
#: manifest or its receipt (a round trip each), the other keeps the link busy.
LANES = 2
#: Upload chunks are at most this large with parallel streams (the server accepts any
#: chunk up to its chunk_bytes), so that there are enough ranges to share out; the
#: server cuts a ranged download's chunks as finely.
PARALLEL_CHUNK_BYTES = wire.RANGE_CHUNK_BYTES
#: The automatic choice probes more streams only for transfers at least this large: a
#: smaller one is over before a probe could tell (and costs a connection for nothing).
PROBE_MIN_BYTES = 4 << 20
#: After the count of streams changes, the rate is measured only from this long on: a
#: new connection's handshake (with TLS its join) and slow start are not "no gain".
WARMUP_S = 0.5
#: ...over at least this long and MEASURE_CHUNKS chunks (a chunk arrives whole, so a
#: slow stream's rate needs several to be seen at all; a lossy flow's rate swings from
#: one loss to the next, so a window spans a few dozen round trips).
MEASURE_S = 0.7
MEASURE_CHUNKS = 4
#: A stream's next range is what it moved in this long at its last range's rate: long
#: enough that the round trips between ranges are few, short enough that a range cut
#: for a fast stream early does not leave the end of the transfer to a slow one.
RANGE_S = 1.0
#: A stream's first range, before its rate is known: large enough that one stream on a
#: fast link is not held back by round trips while the count is probed, small enough for
#: a lossy link's single flow (a few seconds at 3 Mbit/s).
FIRST_RANGE_BYTES = 1 << 20
#: The count grows by this factor at each step: a lossy link's gain (about the factor)
#: then stands far above the noise of a measurement, a clean link's (none) far below,
#: and 64 streams are three steps away.
GROWTH = 4
#: A transfer at one stream that reaches this share of the rate the previous one had
#: (when more streams gained nothing) does not probe: the link is as it was.
AS_BEFORE = 0.8
#: A count that stopped growing is probed again after this long: what limited it may
#: have gone (other sites' transfers that loaded the server ended).
REPROBE_S = 5.0
#: More streams (GROWTH times as many) are kept only if they raise the aggregate rate by
#: more than this: on a lossy link they multiply it, where the link or the server is the
#: limit they add little (a flow's own overheads, noise) but cost connections, and with
#: many the server's download-rate estimate reads high (`links.py` there).
GAIN = 0.5


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


class StreamCount:
    """How many streams a transfer runs: a fixed count, or (automatic) one that grows
    while more streams raise the rate the transfer moves its bytes at.

    Adaptive: from `start`, after each change the aggregate rate is measured (past
    WARMUP_S, over MEASURE_S and MEASURE_CHUNKS chunks). The first measurement grows
    the count GROWTH times; a later one grows it again if the rate rose by more than
    GAIN over the best so far, else the count goes back to that best one (the streams
    added last finish the range they hold and take no other) and stays for REPROBE_S.
    `limit` caps it. The
    bytes are those the streams moved: a download's read off its connections, an
    upload's taken by gRPC (HTTP/2 flow control takes a chunk only as the server reads
    the earlier ones, so past the warm-up it is the rate the server receives)."""

    def __init__(
        self,
        start: int,
        limit: int,
        *,
        adaptive: bool = True,
        known: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = max(1, limit)
        self.adaptive = adaptive
        self.current = max(1, min(start, self.limit))
        self.settled = not adaptive or self.current >= self.limit
        #: Notified when `current` changes (run_ranges starts the new streams).
        self.changed = threading.Condition()
        #: The counts tried, in order (the last is where it stayed), and the rates
        #: (bytes/s) measured at each decision.
        self.tried = [self.current]
        self.rates: list[float] = []
        self._clock = clock
        self._changed_at = clock()
        self._mark: tuple[float, int] | None = None  # (when, bytes moved): the window's start
        self._chunks = 0
        self._moved = 0
        self._best = (self.current, 0.0)  # (count, its rate)
        #: The rate the previous transfer had at `start` streams when more gained
        #: nothing: reached again, this one does not probe (see `next_start`).
        self._known = known
        self._skipped = False
        #: One call for the whole transfer, measured: where one stream was as fast as
        #: more the last time (`next_start`), so that a clean link moves its bytes
        #: exactly as with `transfer_streams = 1`; if it turns out slower, the next
        #: transfer probes.
        self.alone = adaptive and self.current == 1 and known is not None

    @classmethod
    def fixed(cls, count: int) -> StreamCount:
        return cls(count, count, adaptive=False)

    @property
    def parallel(self) -> bool:
        """Whether the transfer may use more than one stream (ranges, not one call)."""
        return self.limit > 1 and not self.alone

    def moved(self, nbytes: int) -> None:
        """A stream moved a chunk of `nbytes`: measure, and perhaps change the count."""
        with self.changed:
            self._moved += nbytes
            if not self.adaptive or (self.settled and (self.alone or self.current >= self.limit)):
                return
            now = self._clock()
            if self.settled:
                if now - self._changed_at < REPROBE_S:
                    return
                self.settled, self._best = False, (self.current, 0.0)  # probe again
                self._changed_at, self._mark = now, None
            if self._mark is None:
                if now - self._changed_at >= WARMUP_S:
                    self._mark, self._chunks = (now, self._moved), 0
                return
            self._chunks += 1
            since, before = self._mark
            if now - since < MEASURE_S or self._chunks < MEASURE_CHUNKS:
                return
            self._decide((self._moved - before) / (now - since), now)

    def _decide(self, rate: float, now: float) -> None:
        log.debug("%d streams: %.2f MB/s", self.current, rate / 1e6)
        self.rates.append(rate)
        best_count, best_rate = self._best
        known, self._known = self._known, None
        if known is not None and rate >= known * AS_BEFORE:  # no probe
            self._best, self.settled, self._skipped = (self.current, rate), True, True
            self._changed_at = now
            return
        if self.alone:  # slower than before, on one call: the next transfer probes
            self._best, self.settled = (self.current, 0.0), True
            return
        if self.current != best_count and rate <= best_rate * (1 + GAIN):
            # the streams added last did not pay: back to the best count, for good
            self.current, self.settled = best_count, True
        else:
            self._best = (self.current, rate)
            if self.current >= self.limit:
                self.settled = True
                return
            self.current = min(GROWTH * self.current, self.limit)
        self.tried.append(self.current)
        self._changed_at, self._mark = now, None
        self.changed.notify_all()

    def next_start(self) -> tuple[int, float | None]:
        """Where the next transfer in this direction starts (its `start`, `known`): at
        half the count this one stayed at; at one stream, when more gained nothing (or
        were not tried, as before), with the rate one had: the next does not probe
        again while one stream moves about as fast (a clean link pays no probe each
        transfer, and a link that turned lossy is probed at once)."""
        count, rate = self._best
        if self.current == 1 == count and rate > 0 and (len(self.tried) > 1 or self._skipped):
            return 1, rate
        return max(1, self.current // 2), None

    def describe(self) -> str:
        """E.g. "1 -> 4 -> 1 streams (automatic; measured 11.2, 11.5 MB/s)"."""
        rates = ", ".join(f"{rate / 1e6:.1f}" for rate in self.rates)
        counts = " -> ".join(str(n) for n in self.tried)
        return f"{counts} streams (automatic; measured {rates or 'nothing'} MB/s)"


def stream_plan(
    configured: int, nbytes: int, start: tuple[int, float | None] = (1, None)
) -> StreamCount:
    """Streams for a transfer of `nbytes`: `configured`, or (0) the automatic choice,
    which starts at `start` (the previous transfer's `next_start`; one, for a transfer
    smaller than PROBE_MIN_BYTES); a transfer of one chunk or less has nothing to share."""
    if nbytes <= PARALLEL_CHUNK_BYTES or (configured <= 0 and nbytes < PROBE_MIN_BYTES):
        return StreamCount.fixed(1)
    if configured > 0:
        return StreamCount.fixed(configured)
    return StreamCount(start[0], wire.MAX_TRANSFER_STREAMS, known=start[1])


class RangeCutter:
    """The bytes [start, end) of a transfer, cut into ranges as the streams ask for
    them: what the asking stream moves in RANGE_S, at most 1 / (RANGES_PER_STREAM x
    streams) of what is left (so that streams added later find ranges to take, and no
    slow stream holds the transfer's last seconds), at least `least` bytes,
    ending at one of `boundaries` (an upload's chunk ends; None: any byte). One fixed
    stream takes all that is left in one call. With `first_end`,
    the first range ends there."""

    def __init__(
        self,
        start: int,
        end: int,
        boundaries: Sequence[int] | None = None,
        least: int = 1,
        first_end: int = 0,
    ) -> None:
        self.end = end
        self._next = start
        self._boundaries = boundaries
        self._least = max(1, least)
        self._first_end = first_end  # (a download's first range, asked for before its size)
        self._lock = threading.Lock()

    @classmethod
    def over_chunks(cls, sizes: Sequence[int]) -> RangeCutter:
        """An upload's: ranges end at chunk boundaries, and there are at most
        wire.MAX_UPLOAD_RANGES of them (the server refuses more)."""
        ends = list(itertools.accumulate(sizes))
        total = ends[-1] if ends else 0
        return cls(0, total, ends, -(-total // wire.MAX_UPLOAD_RANGES))

    @property
    def exhausted(self) -> bool:
        return self._next >= self.end

    def take(self, count: StreamCount, want: float | None = None) -> tuple[int, int] | None:
        """The next range for a stream that would move `want` bytes in RANGE_S at the
        rate its last range went (None: its first, FIRST_RANGE_BYTES); None: every
        byte is handed out."""
        with self._lock:
            left = self.end - self._next
            if left <= 0:
                return None
            if not count.adaptive and count.current == 1:
                size = left
            else:
                size = left // (RANGES_PER_STREAM * count.current)
                size = min(size, int(want) if want is not None else FIRST_RANGE_BYTES)
            stop = min(self.end, self._first_end or self._next + max(self._least, size))
            self._first_end = 0
            if self._boundaries is not None:
                stop = self._boundaries[bisect.bisect_left(self._boundaries, stop)]
            byte_range, self._next = (self._next, stop), stop
            return byte_range


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
    cutter: RangeCutter,
    count: StreamCount,
    send: Callable[[int, tuple[int, int]], _T],
    upload: SharedUpload | None = None,
    stop: threading.Event | None = None,
) -> list[_T]:
    """`send(stream, range)` for every range `cutter` hands out, `LANES` at a time on
    each of the `count.current` streams (more are started as the count grows; a stream
    the count dropped takes no new range). The first range goes first, and with
    `upload` the others start once its id is known. Returns the results in range order;
    the first failure is raised once every stream has stopped (none takes a new range
    after it, nor after `stop`)."""
    results: dict[tuple[int, int], _T] = {}
    errors: list[BaseException] = []
    failed = upload.failed if upload is not None else (stop or threading.Event())
    first = cutter.take(count)
    if first is None:
        return []

    def lane(number: int, byte_range: tuple[int, int] | None) -> None:
        stream = number // LANES
        try:
            if byte_range is None and upload is not None and not upload.wait():
                return
            want: float | None = None  # bytes this lane moves in RANGE_S
            while not failed.is_set():
                if byte_range is None and stream < count.current:  # else: retired
                    byte_range = cutter.take(count, want)
                if byte_range is None:
                    return
                began = time.monotonic()
                results[byte_range] = send(stream, byte_range)
                took = max(time.monotonic() - began, 1e-3)
                want = (byte_range[1] - byte_range[0]) / took * RANGE_S
                byte_range = None
        except BaseException as exc:
            errors.append(exc)
            failed.set()
        finally:
            with count.changed:
                count.changed.notify_all()

    lanes: list[threading.Thread] = []

    def start(byte_range: tuple[int, int] | None = None) -> None:
        thread = threading.Thread(
            target=lane, args=(len(lanes), byte_range), name="fedtrain-stream", daemon=True
        )
        lanes.append(thread)
        thread.start()

    start(first)
    while True:
        with count.changed:
            count.changed.wait_for(
                lambda: (
                    failed.is_set()
                    or cutter.exhausted
                    or count.current * LANES > len(lanes)
                    or not any(t.is_alive() for t in lanes)
                ),
                timeout=1.0,
            )
        if failed.is_set() or cutter.exhausted or not any(t.is_alive() for t in lanes):
            break
        while len(lanes) < count.current * LANES:
            start()
    for thread in lanes:
        thread.join()
    if errors:
        raise errors[0]
    if not cutter.exhausted:  # (every lane ended without a failure: cannot happen)
        raise ProtocolError("a transfer's streams stopped before its last range")
    return [results[r] for r in sorted(results)]


def completed(receipts: Sequence[pb.UploadReceipt]) -> pb.UploadReceipt:
    """The receipt of the stream that completed an upload (the others are partial)."""
    whole = [r for r in receipts if not r.partial]
    if len(whole) != 1:
        raise ProtocolError(
            f"{len(whole)} of the upload's {len(receipts)} streams were told the update is "
            "complete (exactly one should be)"
        )
    return whole[0]


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
    cutter: RangeCutter,
    count: StreamCount,
    fetch: Callable[[int, tuple[int, int]], Iterator[Chunk]],
) -> Iterator[Chunk]:
    """The chunks of every range of `cutter`, fetched on `count` streams
    (`fetch(stream, range)` yields one range's chunks), in the order they arrive; a
    stream's failure is raised here."""
    arrived: queue.SimpleQueue[object] = queue.SimpleQueue()
    stop = threading.Event()  # the reader gave up: no stream starts another range

    def send(number: int, byte_range: tuple[int, int]) -> None:
        for chunk in fetch(number, byte_range):
            arrived.put(chunk)

    def run() -> None:
        try:
            run_ranges(cutter, count, send, stop=stop)
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
