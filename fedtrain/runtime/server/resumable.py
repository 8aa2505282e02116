"""Uploads kept across broken streams, so that a site resumes where it stopped.

An upload's journal (a plain update's `UpdateSpool`; a masked vector's `MaskedUpload`,
whose chunks are already in the secure sum) outlives the stream that filled it. When
the stream breaks, the server keeps the journal for `upload_grace_s` under an id the
site learned with the go-ahead (`wire.UPLOAD_ID`); the site reopens the upload with
`UploadHeader.resume_id`, the go-ahead tells it how many bytes the server holds
(`wire.UPLOAD_OFFSET`), and it sends only the rest. The journal holds whole chunks
only, so that offset is a chunk boundary: what travels twice is at most the chunk
that was in flight when the link broke.

The fold is unchanged: a plain update is folded from its journal once whole, in the
order its chunks arrived, which a resumed stream simply continues, so the aggregate
is bit for bit that of an unbroken upload. Nothing of an upload that never completes
touches the sum (a masked vector's partial fold is taken back out, exactly, when it
is discarded: `SecureRoundState.abandon`).

Only the same session (its token, and with TLS its certificate) may resume an upload,
in the same round attempt, with the same header, within the grace; a chunk that
overlaps what the server holds or runs past its tensor is refused by the journal's
validator like in any upload. A stream that resumes a range may end it sooner, past
what the server holds of it: a site that cuts its plain call for parallel streams
(`site/streams.py`) resumes the call's range to where it stood and sends the rest in
ranges of their own. Each stream that feeds an upload gets a generation
number: a stream a resume superseded (its connection still looked open to the
server) can add nothing once the new one has taken over.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from fedtrain.errors import TensorStreamError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.rounds import UploadRefused
from fedtrain.runtime.server.sessions import Session
from fedtrain.runtime.server.uploads import MaskedUpload, UpdateSpool
from fedtrain.tensors import Chunk


class Superseded(Exception):
    """This stream no longer feeds its upload: a resume took over, or it was discarded."""


def header_terms(header: pb.UploadHeader) -> tuple[Any, ...]:
    """What a resumed upload's header must repeat: everything but the token and id."""
    return (
        header.round,
        header.num_examples,
        tuple(sorted(header.metrics.items())),
        header.model_version,
        header.masked,
        header.codec or "none",
    )


@dataclass(eq=False)
class Lane:
    """One stream's share of an upload: the update's bytes in [start, end), in the order
    the site sends them. It is fed by one stream at a time (`generation`)."""

    start: int
    end: int
    received: int = 0
    generation: int = 0
    attached: bool = False
    #: The handler task of the stream that feeds it now (cancelled when superseded).
    task: Any = None

    @property
    def done(self) -> bool:
        return self.received == self.end - self.start


@dataclass(eq=False)
class HeldUpload:
    """One upload and its journal, whichever streams feed it (see the module doc).

    An upload spread over parallel streams has one `Lane` per range; the journal (and
    its validator, which refuses any byte twice) is shared, and the update is
    committed once, by the stream whose range completes it."""

    site: str
    token: str
    certificate: bytes
    state: Any  # the RoundState (or BufferedRounds) the upload was admitted to
    terms: tuple[Any, ...]
    sink: UpdateSpool | MaskedUpload
    #: What a plain update counts for (decided once, at its first stream); None: masked.
    weight: Any = None
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    #: The ranges streams have fed, by their start.
    lanes: dict[int, Lane] = field(default_factory=dict)
    #: When its last stream broke off (the grace runs from then); inf until then.
    broke_at: float = math.inf
    ended: bool = False
    #: Why it was thrown away ("" while live or once completed).
    discarded: str = ""
    #: Bytes of this upload that the site had sent before, in an upload of the same
    #: attempt the server threw away (they arrive a second time: counted as re-sent).
    resend: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def offset(self) -> int:
        """Bytes of the update the server holds (of all its ranges)."""
        return self.sink.bytes_received

    @property
    def attached(self) -> bool:
        """Whether a stream feeds it now."""
        return any(lane.attached for lane in self.lanes.values())

    def tasks(self) -> list[Any]:
        """The handler tasks of the streams that feed it now."""
        with self._lock:
            return [lane.task for lane in self.lanes.values() if lane.task is not None]

    def attach(self, task: Any, start: int, end: int) -> tuple[Lane, int, int, Any]:
        """Let the stream of `task` feed the range [start, end) (0, 0: the whole update):
        (its lane, its generation, the position it starts at, the task it superseded or
        None). A range that overlaps another or runs past the update is refused."""
        with self._lock:
            if self.ended:
                raise Superseded
            lane = self._lane(start, end)
            lane.generation += 1
            old = lane.task if lane.attached else None
            lane.task, lane.attached = task, True
            return lane, lane.generation, lane.start + lane.received, old

    def _lane(self, start: int, end: int) -> Lane:
        """The lane of [start, end), new or resumed (under the lock)."""
        size = self.sink.expected_bytes
        if (start, end) == (0, 0):
            end = size
        lane = self.lanes.get(start)
        if lane is not None:
            if lane.start + lane.received <= end < lane.end:
                # A plain call the site cut for parallel streams: its range ends where the
                # site says (past what it holds), and ranges of their own take the rest.
                lane.end = end
            elif lane.end != end:
                raise _refused(
                    f"a stream resumes the range from byte {start} to {end}, but that "
                    f"range was opened to byte {lane.end} and holds "
                    f"{lane.start + lane.received}"
                )
            return lane
        if not 0 <= start < end <= size:
            raise _refused(
                f"a stream for bytes [{start}, {end}) of an update of {size} bytes (out of range)"
            )
        if isinstance(self.sink, MaskedUpload) and (start, end) != (0, size):
            raise _refused(
                "a masked update travels on one stream (its chunks fold into the secure "
                "sum in order), not in ranges"
            )
        if len(self.lanes) >= wire.MAX_UPLOAD_RANGES:
            raise _refused(f"an upload may be cut into at most {wire.MAX_UPLOAD_RANGES} ranges")
        for other in self.lanes.values():
            if start < other.end and other.start < end:
                raise _refused(
                    f"a stream for bytes [{start}, {end}) overlaps the range "
                    f"[{other.start}, {other.end}) of another stream of this upload"
                )
        lane = self.lanes[start] = Lane(start, end)
        return lane

    def add(self, lane: Lane, generation: int, chunk: Chunk, check: Callable[[], None]) -> int:
        """Journal one chunk of stream `generation` of `lane` (after `check()`, under the
        lock); returns how many of its bytes the site had sent before (`resend`)."""
        with self._lock:
            if generation != lane.generation or self.ended:
                raise Superseded
            check()
            if lane.received + len(chunk.data) > lane.end - lane.start:
                raise TensorStreamError(
                    f"{chunk.name!r}: a chunk runs past its stream's range "
                    f"[{lane.start}, {lane.end}) of the update"
                )
            self.sink.add(chunk)
            lane.received += len(chunk.data)
            again = min(self.resend, len(chunk.data))
            self.resend -= again
            return again

    def detach(self, lane: Lane, generation: int) -> bool:
        """Stream `generation` of `lane` broke: keep the journal; False if another stream
        had taken over or the upload ended (the broken stream then just goes away)."""
        with self._lock:
            if generation != lane.generation or self.ended:
                return False
            self._release(lane)
            return True

    def _release(self, lane: Lane) -> None:
        lane.attached, lane.task = False, None
        if not self.attached:
            self.broke_at = time.monotonic()

    def abandoned_before_start(self) -> None:
        """A stream never came to feed it (the site went away while the stream waited
        for a transfer slot, or its range was refused): the grace runs if none does."""
        with self._lock:
            if not self.attached:
                self.broke_at = min(self.broke_at, time.monotonic())

    def finish(self, lane: Lane, generation: int) -> bool:
        """Stream `generation` delivered its whole range: True if the update is now
        whole and this stream must commit it (once), False if other ranges are missing
        or another stream, whose range ended at the same moment, is committing it (this
        range is in: it must not be told to resume an upload that completed)."""
        with self._lock:
            if generation != lane.generation or self.discarded:
                raise Superseded
            if self.ended:
                lane.attached, lane.task = False, None
                return False
            self._release(lane)
            if not self.sink.whole:
                return False
            self.ended = True
            return True

    def end(self, reason: str) -> tuple[bool, list[Any]]:
        """Discard: (whether it was live, the tasks of the streams feeding it)."""
        with self._lock:
            if self.ended:
                return False, []
            self.ended, self.discarded = True, reason
            tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
            for lane in self.lanes.values():
                lane.attached, lane.task = False, None
        return True, tasks


def _refused(message: str) -> UploadRefused:
    return UploadRefused(grpc.StatusCode.INVALID_ARGUMENT, message)


class HeldUploads:
    """The uploads in flight or waiting to be resumed, by id and by site (thread-safe)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._by_id: dict[str, HeldUpload] = {}
        self._by_site: dict[str, HeldUpload] = {}
        #: Per site, its last discarded upload's attempt and bytes (one entry per site).
        self._lost: dict[str, tuple[Any, int]] = {}

    def add(self, upload: HeldUpload) -> None:
        """Register a new upload; bytes of the site's earlier upload in the same attempt
        that the server threw away will count as re-sent."""
        with self._lock:
            lost = self._lost.pop(upload.site, None)
            if lost is not None and lost[0] is upload.state:
                upload.resend = lost[1]
            self._by_id[upload.id] = upload
            self._by_site[upload.site] = upload

    def lost(self, upload: HeldUpload) -> None:
        """`upload` was thrown away: what it held may come again (see `add`)."""
        with self._lock:
            self._lost[upload.site] = (upload.state, upload.offset)

    def forget(self, upload: HeldUpload) -> None:
        with self._lock:
            self._by_id.pop(upload.id, None)
            if self._by_site.get(upload.site) is upload:
                del self._by_site[upload.site]

    def of_site(self, site: str) -> HeldUpload | None:
        with self._lock:
            return self._by_site.get(site)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def expired(self, now: float | None = None) -> list[tuple[HeldUpload, str]]:
        """Uploads to discard: of an attempt that closed, even with a stream still open
        (a silent stream, e.g. a rogue site's range it never sends, would otherwise hold
        its transfer slot and journal for as long as its connection lives), or broken
        off and past the grace."""
        now = time.monotonic() if now is None else now
        with self._lock:
            uploads = list(self._by_id.values())
        out = []
        for upload in uploads:
            if upload.state.closed:
                out.append((upload, "its round closed"))
            elif not upload.attached and now - upload.broke_at > self.grace_s:  # inf: never
                out.append((upload, f"not resumed within upload_grace_s ({self.grace_s:g}s)"))
        return out

    def claim(
        self, upload_id: str, session: Session, header: pb.UploadHeader, state: Any
    ) -> HeldUpload:
        """The upload `upload_id` for `session` to resume, or UploadRefused saying why not."""
        where = f"site {session.site!r}, round {header.round}"
        with self._lock:
            upload = self._by_id.get(upload_id)
        if upload is None or upload.ended:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: there is no upload {upload_id[:12]!r} to resume (it completed, or "
                "was discarded: its grace passed, its round ended or the site was dropped); "
                "the site must start the upload again",
            )
        if (upload.site, upload.token, upload.certificate) != (
            session.site,
            session.token,
            session.certificate,
        ):
            raise UploadRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{where}: upload {upload_id[:12]!r} belongs to another session; a site may "
                "resume only its own upload, on the session that started it",
            )
        if upload.state is not state or state.closed or upload.terms[0] != header.round:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: upload {upload_id[:12]!r} belongs to round {upload.terms[0]} "
                f"(attempt {getattr(upload.state, 'attempt', '?')}), which is no longer open; "
                "it cannot continue in another round",
            )
        if upload.terms != header_terms(header):
            raise UploadRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: the header of the resumed upload {upload_id[:12]!r} differs from "
                "its first (num_examples, metrics, model_version, codec and masked must stay "
                "the same); start a new upload instead",
            )
        if not upload.attached and time.monotonic() - upload.broke_at > self.grace_s:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: upload {upload_id[:12]!r} broke off more than upload_grace_s "
                f"({self.grace_s:g}s) ago and is discarded; the site must start it again",
            )
        return upload
