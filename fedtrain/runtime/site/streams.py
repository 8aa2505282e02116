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

How many streams (`transfer_streams` in site.toml): a fixed count, or 0 (automatic, the
default), which adapts to the link per transfer and per direction. No fixed count serves
every link: on a fast one ranges cost CPU per chunk (a 400 MB model on loopback moved
3-4x slower over them than in one call: benchmarks/RESULTS.md, "The automatic count:
not the default"), on a clean WAN link they cost a little too (79% of the line rate with
32 against 89% with one), and at 1% loss under cubic 32 / 64 streams reach 58% / 68% of
it where one reaches 3% ("WAN: parallel streams"). So a transfer starts as one plain
call, exactly as with `transfer_streams = 1`, and `CallSwitch` watches it
(`StreamCount.poll`): once its rate is measured (its first wire.HEAD_BYTES travel in
small chunks, so a lossy link's single flow shows its rate within a second) or after
DECIDE_S, if at its rate the rest would still take more than SWITCH_S, the call is cut
where it stands and the rest moves in ranges: a download asks for the bytes after those
it received; an upload's call is resumed on the server with its range ending where the
server holds it (`resumable.py` there), and the ranges join that upload. A measured
call steps at once to the power of GROWTH at which every stream moving what it did
would end the rest within FIRST_STEP_S (1 -> 64 at 1% loss), an unmeasured one to
GROWTH. From then on `StreamCount` multiplies the count by GROWTH (4) while the
streams raise the rate the transfer moves its bytes at by more than GAIN, measured after
a warm-up (a new connection's handshake and slow start are not "no gain") over about a
chunk per stream, and never in the transfer's last ranges. A step that gains less stays
if more streams were measured to multiply the rate on this link (`paid`: a step gained
PAID_GAIN, far above a window's noise) and it is not SLOWER (a
window cannot tell 64 streams from 16 on a lossy link, whole rounds can), and one that
reads SLOWER there is measured over a second window before it is taken back; else the
streams it added finish their range and take no other; a count that stopped is probed
again every REPROBE_S (what limited it, e.g. a server busy with other sites, may have
gone). `StreamMemory` starts the next transfer in the same direction at the count this
one stayed at (an upload with no history at its download's), ranged from the start: a
lossy link's streams are not probed for anew every round. One transfer in DESCEND_EVERY
that starts above one stream first steps down (a quarter of the streams while they move
as much as more), so a link that got clean goes back to one stream, and the transfers
after one that found one stream as fast as more are plain calls again (one that is
slower than that one was is cut and probed at once). A descent keeps fewer streams only
if two windows say they move as much, and only a transfer with room for those windows
descends (`descent_room`: a 40 MB upload over 64 streams has none). Transfers under
PROBE_MIN_BYTES are one call. With many streams the server's download-rate estimate
(`links.py`) reads high by what the streams' buffers hold.

Ranges are cut as the streams ask for them (`RangeCutter`): what the asking stream
moved in RANGE_S at its last range's rate, at most 1 / (RANGES_PER_STREAM x the most
streams the count may reach) of what is left, so that streams added later find some
and no stream is left holding a large range at the end (a range cut for one of four
streams' share of a lossy link takes 16 times as long once 64 share it).
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
#: 1 / (RANGES_PER_STREAM x the count's limit) of what is left, so they shrink towards
#: the end).
RANGES_PER_STREAM = 4
#: Calls in flight on each stream's connection: while one waits for its go-ahead, its
#: manifest or its receipt (a round trip each), the other keeps the link busy.
LANES = 2
#: Upload chunks are at most this large with parallel streams (the server accepts any
#: chunk up to its chunk_bytes), so that there are enough ranges to share out. Not finer:
#: each range is a call with its go-ahead and receipt, and at 64 KB a 40 MB upload over
#: 64 streams at 1% loss moved at 6-9 MB/s instead of 11-13 (a ranged download's pieces
#: are finer, wire.RANGE_CHUNK_BYTES: it asks once per range and pays no go-ahead).
PARALLEL_CHUNK_BYTES = 256 * 1024
#: The automatic choice probes more streams only for transfers at least this large: a
#: smaller one is over before a probe could tell (and costs a connection for nothing).
#: (The server sends such a download's first bytes in small pieces: wire.HEAD_BYTES.)
PROBE_MIN_BYTES = wire.PROBE_MIN_BYTES
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
#: A plain call that reaches this share of the rate one stream had in the previous
#: transfer (when more streams gained nothing) does not switch: the link is as it was.
AS_BEFORE = 0.8
#: A plain call is judged unmeasured once it has run this long: a fast link (a LAN,
#: loopback) is done by then, or close to it, and never sees a second connection.
DECIDE_S = 1.2
#: A plain call's rate counts from its first chunk past this on (not the request's
#: round trip, nor the start of slow start, which on a clean 40 ms link reaches the
#: line rate in ~0.2 s), over at least this long and MEASURE_CHUNKS chunks: shorter than
#: a window of streams (a measured call is judged as soon as this says its rate, and
#: at 1% loss every 0.1 s of it is 0.1 s at 5% of what 64 streams move; the server's
#: small first pieces, wire.HEAD_BYTES, give it its chunks), long enough that a
#: clean link's call reads far above what would have it cut.
CALL_WARMUP_S = 0.2
CALL_MEASURE_S = 0.5
#: ...and switches to ranges over more streams when at its rate the rest would still
#: take longer than this: long enough to pay for a probe step (~1.2 s at partial rate),
#: so that a clean link's single flow, which would gain nothing, is left alone.
SWITCH_S = 5.0
#: A plain call whose rate would take longer than this to measure (MEASURE_CHUNKS
#: chunks at its rate's upper bound) switches unmeasured: a lossy link's single flow
#: moves a 4 MiB chunk in seconds, and it is not worth waiting for.
MEASURE_LIMIT_S = 2.0
#: A plain call measured slow and cut steps to the count at which, if every stream moved
#: what the call did, the rest would take at most this long (flows add up until they
#: fill the link; on a link one flow fills the step reads no faster, and is taken back
#: after its window): at 1% loss a call reads 0.3-2.2 MB/s (its first half second
#: holds some of slow start), and 40 MB go over 64 streams at once, not after steps to
#: 4 and 16 of a window each (RESULTS, "Round 1 at 1% loss: the call measured").
FIRST_STEP_S = 1.0
#: A plain call whose chunks stopped coming for longer than this, and STALL_WAITS times
#: its longest wait for one so far, is stalled (its link is down), not slow: it is not
#: cut for more streams, it resumes when the link is back (a 10 s outage mid-download
#: cost 18 s, not 12, when its call was cut into ranges whose connections were dialled
#: during it). A lossy link's call is cut before its first chunk, or moves steadily.
STALL_S = 1.0
STALL_WAITS = 3.0
#: A count that stopped growing is probed again after this long: what limited it may
#: have gone (other sites' transfers that loaded the server ended).
REPROBE_S = 5.0
#: More streams (GROWTH times as many) grow further only if they raise the aggregate
#: rate by more than this: on a lossy link they multiply it, where the link or the server
#: is the limit they add little (a flow's own overheads, noise) but cost connections, and
#: with many the server's download-rate estimate reads high (`links.py` there). The first
#: step (from one call) is taken back when it gains less: a clean link keeps one flow.
GAIN = 0.25
#: Two counts whose rates differ by less than this share move about as much (a window's
#: noise: a lossy link's flows swing, chunks arrive whole). Once more streams were
#: measured to pay (`StreamCount.paid`: the link is flow-limited), a step that gained
#: less than GAIN is still kept unless it is this much slower: measured within a
#: transfer, 64 streams at 1% loss read as fast as 16 about as often as faster (and up
#: to ~25% slower), while over whole rounds they move 65% of a 100 Mbit/s link against
#: 16's 39% (RESULTS, "The automatic count keeps the streams that do not lose").
SLOWER = 0.3
#: A step marks the link flow-limited (`StreamCount.paid`) only if it multiplied the rate
#: by at least this: at 1% loss the step from 4 streams to 16 read 2.1-6.6x (12 sites'
#: logs), while on a clean 2 MB/s link 16 read 1.1-1.9x of 4 (whose window, the first
#: after the plain call was cut, shares the link with what the cut call had in flight),
#: and marked paid, 64 streams stayed there and made the server's rate estimate read
#: high (a slow site it should have skipped tried the next round).
PAID_GAIN = GROWTH / 2


class UpdateChunks:
    """An update's chunks, made anew for each stream (or range) of its upload: cheap
    `pieces` of `chunk_bytes` (views of the model, or of the encoded update), turned
    into the update's chunks by `convert` (the delta of each) only for the chunks a
    stream sends."""

    def __init__(
        self,
        pieces: Callable[[int], Iterator[Chunk]],
        chunk_bytes: int,
        convert: Callable[[Chunk], Chunk] | None = None,
        head: int = 0,
    ) -> None:
        self._pieces = pieces
        self.chunk_bytes = chunk_bytes
        self._convert = convert
        #: The chunks that start in the first `head` bytes are cut to PARALLEL_CHUNK_BYTES.
        self.head = head

    def __call__(self) -> Iterator[Chunk]:
        return self.between(0, None)

    def sizes(self) -> list[int]:
        return [len(piece.data) for piece in self._chunked()]

    def _chunked(self) -> Iterator[Chunk]:
        pieces = self._pieces(self.chunk_bytes)
        return wire.cut_chunks(pieces, PARALLEL_CHUNK_BYTES, self.head) if self.head else pieces

    def between(self, start: int, end: int | None) -> Iterator[Chunk]:
        """The chunks of bytes [start, end) (None: to the end), chunk boundaries."""
        pieces = self._chunked()
        pieces = (
            wire.chunks_after(pieces, start)
            if end is None
            else wire.chunks_between(pieces, start, end)
        )
        return pieces if self._convert is None else map(self._convert, pieces)

    def for_ranges(self) -> UpdateChunks:
        """The same update in chunks of at most PARALLEL_CHUNK_BYTES, for ranges (enough
        of them to share out), whose boundaries include all of these chunks' (a plain
        call cut at one of its chunks continues in ranges from there); these chunks
        themselves when their size is no multiple of it."""
        if not self._finer():
            return self
        return UpdateChunks(self._pieces, PARALLEL_CHUNK_BYTES, self._convert)

    def with_head(self) -> UpdateChunks:
        """The same update for a plain call the automatic count judges: the chunks in its
        first wire.HEAD_BYTES cut as for ranges (a chunk counts as moved once gRPC took
        it whole, and a slow link's single flow moves no 4 MiB chunk in the second the
        call is judged in), the rest whole."""
        if not self._finer():
            return self
        return UpdateChunks(self._pieces, self.chunk_bytes, self._convert, wire.HEAD_BYTES)

    def in_flight(self, moved: int) -> int:
        """The size of the chunk a call that moved `moved` bytes is sending."""
        return PARALLEL_CHUNK_BYTES if moved < self.head else self.chunk_bytes

    def _finer(self) -> bool:
        """Whether ranges' chunks (PARALLEL_CHUNK_BYTES) cut these, ending where they do."""
        size = self.chunk_bytes
        return size > PARALLEL_CHUNK_BYTES and size % PARALLEL_CHUNK_BYTES == 0


class StreamCount:
    """How many streams a transfer runs: a fixed count, or (automatic) one that grows
    while more streams raise the rate the transfer moves its bytes at.

    Automatic, from one stream: the transfer is one plain call (`alone`), exactly as
    with a fixed one, watched by `poll`: once its rate is measured (or it has run
    DECIDE_S), if at its rate the rest would still take more than SWITCH_S, the count
    becomes what its rate says (`_first_step`; `parallel`), and the transfer cuts its
    call where it stands and moves the rest in ranges. A fast link so never pays for
    ranges, a slow one is probed within a second or two.

    With more than one stream, after each change the aggregate rate is measured (past
    WARMUP_S, over MEASURE_S and at least MEASURE_CHUNKS chunks and one per stream; not
    once the last range is handed out: `ending`, which judges a step whose window it
    cut short over all it moved). The first measurement grows the count
    GROWTH times (with `descend`: shrinks it GROWTH times, to find out whether the link
    got better); a later one grows it again if the rate rose by more than GAIN over the
    best so far; it stays where it is if more streams paid (`paid`) and the rate is at
    most SLOWER below it; else the count goes back to that best one (the streams added
    last finish the range they hold and take no other). Either way it stays for
    REPROBE_S. A descent goes on while fewer streams move at least as much as the best,
    and comes back up to it when they do not. `limit` caps it. The bytes are those the
    streams moved: a download's read off its connections, an upload's taken by gRPC
    (HTTP/2 flow control takes a chunk only as the server reads the earlier ones, so
    past the warm-up it is the rate the server receives)."""

    def __init__(
        self,
        start: int,
        limit: int,
        *,
        adaptive: bool = True,
        known: float | None = None,
        total: int = 0,
        descend: bool = False,
        paid: bool = False,
        range_chunk: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = max(1, limit)
        #: The size of a range's chunks (RANGE_CHUNKS): a range is at least one, so a
        #: count's lanes take at least count x LANES of them when it starts.
        self.range_chunk = range_chunk
        #: More streams than one were measured to multiply the rate on this link (a step's
        #: gain of PAID_GAIN over a measured rate, here or in a transfer before): it is
        #: flow-limited, and a step up stays unless SLOWER. Not for a plain call cut
        #: unmeasured (a stall or a slow first chunk is no evidence that more streams pay).
        self.paid = paid
        self.adaptive = adaptive
        self.current = max(1, min(start, self.limit))
        #: The transfer's bytes (what `poll` judges the rest by).
        self.total = total
        #: One plain call, measured by `poll`, until it says more streams would pay.
        self.alone = adaptive and self.current == 1 and self.limit > 1
        self.settled = not adaptive or (self.current >= self.limit and not descend)
        #: Notified when `current` changes (run_ranges starts the new streams).
        self.changed = threading.Condition()
        #: The counts tried, in order (the last is where it stayed), and the rates
        #: (bytes/s) measured at each decision.
        self.tried = [self.current]
        self.rates: list[float] = []
        self._clock = clock
        self._changed_at = clock()
        self._mark: tuple[float, int] | None = None  # (when, bytes moved): the window's start
        self._step = (self._changed_at, 0)  # (when, bytes moved): the count's last change
        self._chunks = 0
        self._moved = 0
        self._best = (self.current, 0.0)  # (count, its rate)
        self._descend = descend and self.current > 1
        #: Whether the count went back to the best one after a step that did not pay.
        self._held_back = False
        #: Whether the current count is being measured a second time before a decision
        #: that would cost a flow-limited link most of its rate (`_second_look`).
        self._looking_again = False
        #: Counts taken back in this transfer (a re-probe takes them back at once).
        self._taken_back: set[int] = set()
        if known is not None and self.current > 1 and not self._descend:
            # the previous transfer took back the step above `start`: no probe at once
            self.settled, self._best, self._held_back = True, (self.current, known), True
        #: The rate one stream had in the previous transfer when more gained nothing:
        #: a plain call that moves about as fast does not switch (see `next_start`).
        self._known = known
        self._as_before = False
        #: A plain call's chunks: (when, bytes moved) at the first and at the last.
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None
        self._arrived = 0
        #: When the transfer's last chunk arrived (on any stream), and the longest wait
        #: for one so far (from the start for the first): a silence far longer is a
        #: stall, not a rate (`stalled`).
        self._arrival: float | None = None
        self._longest_wait = 0.0
        #: Every range is handed out: the streams run out of work one by one, and what
        #: they move then says nothing about their count.
        self._ending = False

    @classmethod
    def fixed(cls, count: int) -> StreamCount:
        return cls(count, count, adaptive=False)

    @property
    def parallel(self) -> bool:
        """Whether the transfer uses more than one stream (ranges, not one call) now."""
        return self.limit > 1 and not self.alone

    def moved(self, nbytes: int) -> None:
        """A stream moved a chunk of `nbytes`: measure, and perhaps change the count."""
        with self.changed:
            self._moved += nbytes
            now = self._clock()
            since = self._changed_at if self._arrival is None else self._arrival
            self._longest_wait = max(self._longest_wait, now - since)
            self._arrival = now
            if self.alone:  # measured from the first chunk past the warm-up
                if self._first is None and now - self._changed_at >= CALL_WARMUP_S:
                    self._first = (now, self._moved)
                if self._first is not None:
                    self._last = (now, self._moved)
                    self._arrived += 1
                return
            if not self.adaptive or self._ending or (self.settled and self.current >= self.limit):
                return
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
            if now - since < MEASURE_S or self._chunks < max(MEASURE_CHUNKS, self.current):
                return
            self._decide((self._moved - before) / (now - since), now)

    @property
    def moved_bytes(self) -> int:
        """What the transfer's streams have moved so far."""
        return self._moved

    @property
    def arrived_at(self) -> float | None:
        """When the last chunk arrived (the count's clock); None before the first."""
        return self._arrival

    def stalled(self) -> bool:
        """Whether chunks came, then none for far longer than any wait for one so far
        (STALL_WAITS times the longest, at least STALL_S): the link is down (an outage),
        not slow."""
        with self.changed:
            return self._stalled(self._clock())

    def _stalled(self, now: float) -> bool:
        return self._arrival is not None and now - self._arrival > max(
            STALL_S, STALL_WAITS * self._longest_wait
        )

    def ending(self) -> None:
        """The transfer's last range is handed out: no more decisions, but a step up whose
        window this cut short is judged over all it moved since it began (`_cut_short`)."""
        with self.changed:
            if not self._ending:
                self._cut_short(self._clock())
            self._ending = True

    def _cut_short(self, now: float) -> None:
        """A step up that the transfer's end left unmeasured paid if, warm-up and all (so
        reading low), it moved PAID_GAIN times the best rate: the next transfer then
        starts there (a 6 MB download at 0.5 MB/s a flow, cut from its call for 16
        streams, ended before their window, and the next began as one call again)."""
        count, best = self._best
        when, moved = self._step
        if self.settled or self.alone or self.current <= count or best <= 0 or now <= when:
            return
        rate = (self._moved - moved) / (now - when)
        if rate >= best * PAID_GAIN:
            self.paid, self._best = True, (self.current, rate)
            self.rates.append(rate)

    def began(self) -> None:
        """The transfer's bytes start moving now (an upload's go-ahead: the wait for the
        server's transfer slot before it is no slow link)."""
        with self.changed:
            self._changed_at = self._clock()

    def poll(self, in_flight: int) -> bool:
        """While the transfer is one plain call (`in_flight`: the bytes of the chunk it
        is moving): True once more streams should take over (the count is then
        `_first_step`'s: cut the call where it stands and move the rest in ranges). The
        call's rate counts from its first chunk past CALL_WARMUP_S on; a chunk arrives
        whole, so until MEASURE_CHUNKS more have (over CALL_MEASURE_S), the rate is
        bounded above by counting the one in flight as moved. The call switches when
        even that bound leaves more than SWITCH_S of transfer, and either the rate is
        measured or, after DECIDE_S, measuring it would take longer than
        MEASURE_LIMIT_S (a lossy link's single flow: 4 MiB chunks take seconds each); it
        stays alone when the previous transfer found one stream as fast as more and
        this one moves about as fast."""
        with self.changed:
            if not self.alone or self.settled:
                return False
            now = self._clock()
            if self._stalled(now):
                # New connections dialled during an outage would back off through it
                # and come up seconds after the call resumes.
                return False
            first, last = self._first, self._last
            if first is None or last is None:
                since, moved, measured = self._changed_at, self._moved, False
            else:
                since, moved = first[0], self._moved - first[1]
                measured = self._arrived > MEASURE_CHUNKS and last[0] - first[0] >= CALL_MEASURE_S
            if not measured and now - self._changed_at < DECIDE_S:
                return False
            bound = (moved + in_flight) / max(now - since, 1e-6)
            rate = 0.0
            if measured and first is not None and last is not None:
                rate = (last[1] - first[1]) / (last[0] - first[0])
            if measured and self._known is not None and rate >= self._known * AS_BEFORE:
                self.settled = self._as_before = True  # the link is as it was: no probe
                self.rates.append(rate)
                return False
            if (self.total - self._moved) / bound <= SWITCH_S:
                return False  # soon done at this rate (asked again later)
            if not measured and MEASURE_CHUNKS * in_flight / bound <= MEASURE_LIMIT_S:
                return False  # measure it first: a clean link is not probed for nothing
            self.rates.append(rate)
            self.alone = False
            self._best = (1, rate)
            self.current = self._first_step(rate)
            self.tried.append(self.current)
            self._changed_at, self._mark, self._step = now, None, (now, self._moved)
            self.changed.notify_all()
            return True

    def _first_step(self, rate: float) -> int:
        """The count a plain call cut for more streams steps to: GROWTH, or, when its
        rate was measured, the first power of GROWTH at which the rest would take at most
        FIRST_STEP_S if every stream moved what the call did, short of one whose lanes'
        first ranges alone would take half the rest (a 40 MB upload's 64 x LANES 256 KiB
        ranges: 33 MB at once, then nothing is left to judge 64 streams by, and on a
        narrow link they stayed for the whole transfer, 41.6 s where one call took
        34.6). On a link that one flow fills the step then reads no faster than the
        call, and is taken back (`_decide`)."""
        step = min(GROWTH, self.limit)
        rest = self.total - self._moved
        while rate > 0 and step < self.limit and rest > FIRST_STEP_S * step * rate:
            larger = min(step * GROWTH, self.limit)
            if 2 * larger * LANES * self.range_chunk > rest:
                break
            step = larger
        return step

    def _decide(self, rate: float, now: float) -> None:
        log.debug("%d streams: %.2f MB/s", self.current, rate / 1e6)
        self.rates.append(rate)
        best_count, best_rate = self._best
        if self._descend:
            before = self.current
            self._step_down(rate, best_count, best_rate, now)
            if self.current == before:
                return
        elif self.current != best_count and rate <= best_rate * (1 + GAIN):
            if self.paid and rate >= best_rate * (1 - SLOWER):
                # the link is flow-limited and these are not slower: they stay
                self._best, self.settled, self._held_back = (self.current, rate), True, False
                return
            if self.paid and self.current not in self._taken_back and self._second_look(now):
                return  # (a count taken back before is taken back at once again)
            # the streams added last did not pay: back to the best count, for good
            self._taken_back.add(self.current)
            self.current, self.settled, self._held_back = best_count, True, True
        else:
            if self.current != best_count and 0 < best_rate * PAID_GAIN <= rate:
                self.paid = True  # a measured gain, far above a window's noise
            self._best, self._held_back = (self.current, rate), False
            if self.current >= self.limit:
                self.settled = True
                return
            self.current = min(GROWTH * self.current, self.limit)
        self.tried.append(self.current)
        self._changed_at, self._mark, self._looking_again = now, None, False
        self._step = (now, self._moved)
        self.changed.notify_all()

    def _second_look(self, now: float) -> bool:
        """Whether to measure the current count over one more window before a decision
        that, if one window's noise misled it, costs a flow-limited link most of its rate
        (taking back streams that paid, or keeping fewer): True the first time (the
        window starts again now), False once it was looked at twice. On a real link
        with 1% loss a window right after 48 new streams started read 64 at half of 16's
        rate, and the transfer and the next two ran at 16 (RESULTS, stop 28)."""
        if self._looking_again:
            return False
        self._looking_again = True
        self._mark, self._chunks = (now, self._moved), 0
        return True

    def _step_down(self, rate: float, best_count: int, best_rate: float, now: float) -> None:
        """A descent's decision: fewer streams while they move at least as much as the best
        (the more were not needed: seen in two windows, `_second_look`); back up to the
        best, for good, when they do not. Not within SLOWER, as a step up is kept: too
        many streams cost connections, too few on a lossy link most of its rate (16 for
        64: 39% of line rate for 65%), and a window reads 16 within SLOWER of 64 about
        as often as not."""
        if self.current == best_count or rate >= best_rate:
            if self.current != best_count and self._second_look(now):
                return
            self._best = (self.current, rate)
            if self.current > 1:
                self.current = max(1, self.current // GROWTH)
                return
        else:
            self.current = best_count
        self._descend, self.settled = False, True

    def next_start(self) -> tuple[int, float | None]:
        """Where the next transfer in this direction starts (its `start`, `known`): at the
        count this one stayed at (if it ended mid-probe: the step it was in where more
        streams were measured to pay, `paid`, as that step stays unless slower; else the
        best measured count), so that
        a lossy link's many streams are not probed for anew, with its rate where more
        streams were tried and did not pay (the next does not try them again before
        REPROBE_S); at one stream, a plain call, where one moved as fast as more (then
        with its rate: the next call does not switch while it moves about as fast, so a
        clean link pays no probe each time)."""
        count, rate = self._best
        if self.current == 1:
            if self._as_before:
                return 1, self._known
            if count == 1 and rate > 0 and len(self.tried) > 1:
                return 1, rate
            return 1, None
        if not self.settled and rate > 0:
            if self.current in self._taken_back:  # re-probing a count found slower
                return count, rate
            # mid-probe: a step up past more streams that paid is kept unless slower;
            # one down (a descent) only if it moves as much
            return (self.current if self.paid and not self._descend else count), None
        if self.settled and self._held_back and rate > 0:
            return self.current, rate
        return self.current, None

    def describe(self) -> str:
        """E.g. "1 -> 4 -> 1 streams (automatic; measured 11.2, 11.5 MB/s)"."""
        rates = ", ".join(f"{rate / 1e6:.1f}" for rate in self.rates)
        counts = " -> ".join(str(n) for n in self.tried)
        return f"{counts} streams (automatic; measured {rates or 'nothing'} MB/s)"


#: Every this many transfers in a direction that start above one stream, one starts by
#: stepping down (`StreamCount` descend): a link that got better sheds its streams, at
#: the cost of a measurement at fewer on one transfer in this many where it did not.
#: Only a transfer with room to judge it descends (`descent_room`).
DESCEND_EVERY = 4
#: The size of a range's chunks in each direction (what a window counts).
RANGE_CHUNKS = {"down": wire.RANGE_CHUNK_BYTES, "up": PARALLEL_CHUNK_BYTES}


def descent_room(count: int, chunk_bytes: int) -> int:
    """The bytes a transfer needs for a descent from `count` streams to be judged: a
    window at `count` and two at a quarter of it (`StreamCount._second_look`), each of at
    least a chunk per stream and MEASURE_CHUNKS, twice over for the warm-ups and the
    transfer's end, where nothing is judged. A 40 MB upload over 64 streams has none
    (its first window alone takes 16 MB in 256 KiB chunks): descending, it moved most of
    its bytes over 16 streams, and ended before they were judged (RESULTS, stop 28)."""
    fewer = max(1, count // GROWTH)
    return 2 * chunk_bytes * (max(MEASURE_CHUNKS, count) + 2 * max(MEASURE_CHUNKS, fewer))


class StreamMemory:
    """Where the automatic count starts each transfer, per direction ("down", "up"):
    at the count the previous one in that direction stayed at; without one, at the
    other direction's (a site's first upload starts where its download's probe ended);
    else one plain call."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float | None]] = {}
        self._above: dict[str, int] = {}  # transfers started above one stream, per direction
        #: Whether more streams paid on this link (`StreamCount.paid`) in the last transfer
        #: that ended above one stream, in either direction (they share the link's loss).
        self._paid = False

    def start(self, direction: str) -> tuple[int, float | None]:
        if direction in self._last:
            return self._last[direction]
        for other, (count, _) in self._last.items():
            if other != direction:
                return count, None
        return 1, None

    def plan(self, configured: int, nbytes: int, direction: str) -> StreamCount:
        start = self.start(direction)
        descend = (
            start[0] > 1
            and self._above.get(direction, 0) % DESCEND_EVERY == DESCEND_EVERY - 1
            and nbytes >= descent_room(start[0], RANGE_CHUNKS[direction])
        )
        return stream_plan(configured, nbytes, start, descend, self._paid, RANGE_CHUNKS[direction])

    def ended(self, direction: str, count: StreamCount) -> None:
        """Remember where an automatic transfer stayed."""
        if not count.adaptive:
            return
        if count.tried[0] > 1:
            self._above[direction] = self._above.get(direction, 0) + 1
        self._last[direction] = count.next_start()
        self._paid = count.paid and self._last[direction][0] > 1


#: How often a plain call's rate is judged (`CallSwitch`).
POLL_S = 0.2


class CallSwitch:
    """Watches a transfer's plain call (`StreamCount.poll`, every POLL_S, in a thread of
    its own while it runs: a lossy link's chunk may take seconds to arrive) and cancels
    it once more streams should take over; the transfer then moves the rest in ranges
    from where the call stood. `follow` each call the transfer makes (a broken one is
    resumed by another). A count that is not automatic is not watched. `in_flight`: the
    size of the chunk the call is moving, from the bytes it moved."""

    def __init__(self, count: StreamCount, in_flight: Callable[[int], int]) -> None:
        self.count = count
        self._in_flight = in_flight
        self._call: object = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def switched(self) -> bool:
        return self.count.parallel

    def follow(self, call: object) -> None:
        """`call` (with a `cancel()`) carries the transfer now."""
        with self._lock:
            self._call = call
        if self.switched:
            self._cut()

    def _cut(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            if self.count.poll(self._in_flight(self.count.moved_bytes)):
                self._cut()
                return

    def __enter__(self) -> CallSwitch:
        if self.count.alone:
            self._thread = threading.Thread(target=self._watch, name="fedtrain-switch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def stream_plan(
    configured: int,
    nbytes: int,
    start: tuple[int, float | None] = (1, None),
    descend: bool = False,
    paid: bool = False,
    range_chunk: int = 0,
) -> StreamCount:
    """Streams for a transfer of `nbytes`: `configured`, or (0) the automatic choice,
    which starts at `start` (the previous transfer's `next_start`; one, for a transfer
    smaller than PROBE_MIN_BYTES); a transfer of one chunk or less has nothing to share."""
    if nbytes <= PARALLEL_CHUNK_BYTES or (configured <= 0 and nbytes < PROBE_MIN_BYTES):
        return StreamCount.fixed(1)
    if configured > 0:
        return StreamCount.fixed(configured)
    return StreamCount(
        start[0],
        wire.MAX_TRANSFER_STREAMS,
        known=start[1],
        total=nbytes,
        descend=descend,
        paid=paid,
        range_chunk=range_chunk,
    )


class RangeCutter:
    """The bytes [start, end) of a transfer, cut into ranges as the streams ask for
    them: what the asking stream moves in RANGE_S, at most 1 / (RANGES_PER_STREAM x
    the most streams the count may reach, its `limit`) of what is left (so that
    streams added later find ranges to take, and no stream holds the transfer's last
    seconds with a range cut for a larger share of the link), at least `least` bytes,
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
    def over_chunks(cls, sizes: Sequence[int], start: int = 0, first_end: int = 0) -> RangeCutter:
        """An upload's (from byte `start`, a chunk boundary): ranges end at chunk
        boundaries, and there are at most wire.MAX_UPLOAD_RANGES of them (the server
        refuses more)."""
        ends = list(itertools.accumulate(sizes))
        total = ends[-1] if ends else 0
        return cls(start, total, ends, -(-total // wire.MAX_UPLOAD_RANGES), first_end)

    @classmethod
    def over_download(cls, start: int, end: int, first_end: int = 0) -> RangeCutter:
        """A download's: no range shorter than the server's range pieces
        (wire.RANGE_CHUNK_BYTES), since a range gets the pieces that start in it; cut
        finer, the end of a transfer became thousands of calls that each got one piece
        or none (64 streams at 1% loss: 39-45% of line rate instead of 64-76%)."""
        return cls(start, end, least=wire.RANGE_CHUNK_BYTES, first_end=first_end)

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
                # by the limit, not the current count: at 1% loss the first four
                # streams' 1 MB ranges, taken while they had the link to themselves,
                # took 7-8 s once 64 shared it, and held the round-1 download 5 s past
                # its last range (RESULTS, stop 29)
                size = left // (RANGES_PER_STREAM * count.limit)
                size = min(size, int(want) if want is not None else FIRST_RANGE_BYTES)
            stop = min(self.end, self._first_end or self._next + max(self._least, size))
            self._first_end = 0
            if self._boundaries is not None:
                stop = self._boundaries[bisect.bisect_left(self._boundaries, stop)]
            byte_range, self._next = (self._next, stop), stop
            if stop >= self.end:
                count.ending()
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
    the count dropped takes no new range, and starts again if the count comes back up
    to it). The first range goes first, and with
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

    lanes: dict[int, threading.Thread] = {}  # the running (or last) lane of each number
    threads: list[threading.Thread] = []

    def start(number: int, byte_range: tuple[int, int] | None = None) -> None:
        thread = threading.Thread(
            target=lane, args=(number, byte_range), name="fedtrain-stream", daemon=True
        )
        lanes[number] = thread
        threads.append(thread)
        thread.start()

    def missing() -> list[int]:
        """Lanes the count wants that do not run (new, or retired by a count that fell
        and wanted again)."""
        return [
            n for n in range(count.current * LANES) if n not in lanes or not lanes[n].is_alive()
        ]

    start(0, first)
    while True:
        with count.changed:
            count.changed.wait_for(
                lambda: (
                    failed.is_set()
                    or cutter.exhausted
                    or bool(missing())
                    or not any(t.is_alive() for t in threads)
                ),
                timeout=1.0,
            )
        if failed.is_set() or cutter.exhausted or not any(t.is_alive() for t in threads):
            break
        for number in missing():
            start(number)
    for thread in threads:
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
