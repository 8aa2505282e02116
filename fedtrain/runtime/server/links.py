"""What each site's link can move, measured from its own transfers, so a round never
starts a transfer that cannot finish before its deadline.

A site on a 10 Mbit/s link chosen for a round with a 45 s deadline would download a
40 MB model (32 s), train, start its upload and be cut off at the deadline: every
byte wasted, every round, and nothing would say why. Each download and upload is timed
here from the moment it gets its transfer slot (time spent queueing for a slot is the
server's, not the link's); a transfer cut off part way still measures the rate it
reached; one that moved nothing says nothing; the ranges of one transfer over parallel
streams, one call each, are measured together (SERIES_GAP_S). A site's compute time is what passes
between the end of a training round's download and its upload's request (evaluation
downloads, slot queues and secure rounds' key agreement, which waits on the other
sites, are not the site's). Before a round starts, a site whose estimated round
(download + compute + upload, from its latest figures) exceeds the round's deadline is
left out, audited with the estimate, as long as the round can still complete without
it. Estimates only ever leave sites out; a failure to make one leaves nobody out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

#: A site's figures are a moving average: one slow transfer (a busy moment) does not
#: condemn a site, a lasting change shows within a few rounds.
SMOOTHING = 0.5
#: Transfers shorter than this say more about latency than about the link's rate.
MIN_MEASURED_S = 0.05
#: A transfer still under way counts once it has run this long (a site still moving
#: the last round's bytes when the next round is planned is judged by them).
LIVE_MEASURED_S = 1.0
#: A site's figures are forgotten this long after its last transfer: a skipped site
#: moves no bytes, so without this it could never show that its link got better
#: (an outage ended, a line was upgraded); it then tries a round again.
FORGET_AFTER_S = 1800.0
#: Meters of one transfer (`TransferMeter.transfer`) that follow each other within this
#: long are measured as one: the ranges of parallel streams (a range's call ends here as soon as
#: its bytes are in gRPC's buffers, long before the site has read them, and the site
#: asks for its next range only once it has, seconds later on a slow link; measured
#: alone, each looked like megabytes moved in milliseconds).
SERIES_GAP_S = 10.0
#: Rounds in a row a site may be skipped before the operator is told what to change.
SKIPS_BEFORE_WARNING = 3


@dataclass
class Link:
    """One site's latest figures (bytes per second; None until measured)."""

    down_bps: float | None = None
    up_bps: float | None = None
    down_bytes: int = 0  # the latest whole download (its codec's size)
    up_bytes: int = 0  # the latest whole upload (its codec's size)
    compute_s: float = 0.0  # from the end of its download to the start of its upload
    computed: bool = False  # compute_s was measured (a cached model or secagg: never)
    measured_at: float = 0.0  # time.monotonic() of its latest training-round transfer
    download_ended: float | None = None
    skipped_in_a_row: int = 0


@dataclass
class _Series:
    """Transfers of one site and direction measured as one (SERIES_GAP_S)."""

    started: float
    ended: float
    nbytes: int
    #: The smoothed rate before the series began: each new part replaces the series'
    #: contribution instead of adding another.
    before: float | None
    transfer: Hashable = None


@dataclass(frozen=True)
class Estimate:
    seconds: float
    slowest_bps: float
    #: The parts of `seconds`, and the rates they were estimated at (None: not measured).
    down_s: float = 0.0
    compute_s: float = 0.0
    up_s: float = 0.0
    down_bps: float | None = None
    up_bps: float | None = None
    #: Every part measured (download, compute and upload; a whole download too quick
    #: to time counts as instant): enough to size a deadline.
    complete: bool = False

    def describe(self, deadline_s: float) -> str:
        return (
            f"estimated {self.seconds:.0f}s at {self.slowest_bps * 8 / 1e6:.1f} Mbit/s "
            f"> deadline {deadline_s:.0f}s"
        )


@dataclass(frozen=True)
class Watched:
    """What the watch last saw of one transfer (`transfer_watch.py`; a snapshot:
    replaced whole, so any thread may read it)."""

    #: Bytes per second over the last `transfer_watch.RATE_WINDOW_S` (None: too early).
    bps: float | None
    #: time.monotonic() when its byte count last grew, the server last worked on it
    #: (`TransferMeter.serving`), or it began: the site's silence starts here.
    last_moved: float

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.last_moved)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


class TransferMeter:
    """Counts one transfer's bytes from the moment it has its slot (`add`, or `counted`:
    a running count to read); `close` records them, and, when the transfer went through
    (`whole`), its size."""

    def __init__(
        self,
        links: LinkEstimates,
        site: str,
        direction: str,
        counted: Callable[[], int] | None,
        training: bool,
        transfer: Hashable = None,
    ) -> None:
        self._links, self._site, self._direction = links, site, direction
        self._counted, self.training = counted, training
        #: What the site transfers (a model version, an upload's id): meters of the same
        #: one in a row are measured as one (`LinkEstimates.record`).
        self.transfer = transfer
        self.started = time.monotonic()
        self._added = 0
        self.whole = False
        #: The transfer's whole size and what the site held before this stream began (a
        #: resumed one), once known: its progress is (before + nbytes) of total.
        self.total = 0
        self.before = 0
        #: What `transfer_watch.TransferWatch` last saw of it (replaced whole, read anywhere).
        self.watched: Watched | None = None
        #: Its streams doing the server's work now (encoding a download, journaling or
        #: folding a chunk): the site is not silent then, the server is busy.
        self.serving = 0
        #: The handler tasks of its streams (the servicer's, on the loop), and why the
        #: server cut them ("" while it has not: `transfer_watch.IDLE_CUT_STALLS`).
        self.streams: set[Any] = set()
        self.cut = ""

    @property
    def site(self) -> str:
        return self._site

    @property
    def direction(self) -> str:
        return self._direction

    def expect(self, total: int, before: int = 0) -> None:
        """The transfer moves `total` bytes in all, `before` of them already moved."""
        self.total, self.before = total, before

    @property
    def done(self) -> int:
        """Bytes of the whole transfer moved so far, this stream's and earlier ones'."""
        return self.before + self.nbytes

    def add(self, nbytes: int) -> None:
        self._added += nbytes

    @contextlib.contextmanager
    def on_server(self) -> Iterator[None]:
        """The server works on the transfer meanwhile: its silence is not the site's."""
        self.serving += 1
        try:
            yield
        finally:
            self.serving -= 1

    @property
    def nbytes(self) -> int:
        return self._added + (self._counted() if self._counted is not None else 0)

    def rate(self, now: float) -> float | None:
        """Bytes per second so far; None while too short, or nothing moved, to say."""
        seconds, nbytes = now - self.started, self.nbytes
        return nbytes / seconds if seconds >= LIVE_MEASURED_S and nbytes > 0 else None

    def completed(self) -> None:
        """The transfer (or a range of it on a parallel stream) went through: its size
        is `total` (what this meter counted may be only a range's: one is reopened
        between two ranges when none was open for a moment)."""
        self.whole = True

    def close(self) -> None:
        self._links.record(
            self._site,
            self._direction,
            self.nbytes,
            time.monotonic() - self.started,
            whole=self.whole,
            training=self.training,
            transfer=self.transfer,
            size=self.total,
        )
        self._links.forget(self)


class LinkEstimates:
    """Every site's `Link`, written by transfers on the loop and read by the coordinator."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}
        self._live: dict[tuple[str, str], TransferMeter] = {}
        self._series: dict[tuple[str, str], _Series] = {}
        self._lock = threading.Lock()

    def meter(
        self,
        site: str,
        direction: str,
        counted: Callable[[], int] | None = None,
        *,
        training: bool = True,
        transfer: Hashable = None,
    ) -> TransferMeter:
        """`direction`: "down" (a model download) or "up" (an update upload);
        `training`: part of a training round (an evaluation's download is not);
        `transfer`: what it moves (see TransferMeter.transfer)."""
        meter = TransferMeter(self, site, direction, counted, training, transfer)
        with self._lock:
            self._live[(site, direction)] = meter
        return meter

    def forget(self, meter: TransferMeter) -> None:
        with self._lock:
            key = (meter._site, meter._direction)
            if self._live.get(key) is meter:
                del self._live[key]

    def live(self, site: str, direction: str) -> TransferMeter | None:
        """`site`'s transfer in `direction` under way now, if any."""
        with self._lock:
            return self._live.get((site, direction))

    def transfers(self) -> list[TransferMeter]:
        """Every transfer under way (at most `max_transfers`)."""
        with self._lock:
            return list(self._live.values())

    def _rate(self, site: str, direction: str, measured: float | None) -> float | None:
        """The measured rate, folded with the one of a transfer still under way."""
        with self._lock:
            live = self._live.get((site, direction))
        current = live.rate(time.monotonic()) if live is not None else None
        return measured if current is None else _smooth(measured, current)

    def record(
        self,
        site: str,
        direction: str,
        nbytes: int,
        seconds: float,
        *,
        whole: bool,
        training: bool = True,
        transfer: Hashable = None,
        size: int = 0,
    ) -> None:
        """One finished (or cut off) transfer of `nbytes` in `seconds` (when `whole`,
        of `size` bytes in all, default `nbytes`); one that continues `transfer` (its
        ranges on parallel streams) is measured with it."""
        with self._lock:
            link = self._live_link(site)
            if training or not link.measured_at:  # only training keeps figures fresh
                link.measured_at = time.monotonic()
            now = time.monotonic()
            series = self._series.get((site, direction))
            gap = now - seconds - series.ended if series is not None else -1.0
            if (
                series is not None
                and transfer is not None
                and series.transfer == transfer
                and -1e-3 <= gap <= SERIES_GAP_S
            ):
                series.nbytes += nbytes
                series.ended = now
            else:
                before = link.down_bps if direction == "down" else link.up_bps
                series = self._series[(site, direction)] = _Series(
                    now - seconds, now, nbytes, before, transfer
                )
            span = series.ended - series.started
            if series.nbytes > 0 and span >= MIN_MEASURED_S:
                rate = _smooth(series.before, series.nbytes / span)
                if direction == "down":
                    link.down_bps = rate
                else:
                    link.up_bps = rate
            if direction == "down":
                link.download_ended = time.monotonic() if training else None
                if whole:
                    link.down_bytes = size or nbytes
            elif whole:
                link.up_bytes = size or nbytes

    def upload_started(self, site: str, *, count_compute: bool = True) -> None:
        """`site` asked to upload (before any wait for a slot): the end of its compute
        since its training download, unless `count_compute` is off (a secure round's
        upload also waited for the other sites' key agreement)."""
        with self._lock:
            link = self._live_link(site)
            if link.download_ended is not None and count_compute:
                link.compute_s = time.monotonic() - link.download_ended
                link.computed = True
            link.download_ended = None

    def _live_link(self, site: str) -> Link:
        """`site`'s figures, reset when they are older than `FORGET_AFTER_S` (under the lock)."""
        link = self._links.get(site)
        if link is None or (
            link.measured_at and time.monotonic() - link.measured_at > FORGET_AFTER_S
        ):
            skipped = link.skipped_in_a_row if link is not None else 0
            link = self._links[site] = Link(skipped_in_a_row=skipped)
        return link

    def rates(self, site: str) -> tuple[float | None, float | None]:
        """(download, upload) bytes per second of `site` as estimated now (None: unknown)."""
        link = self.link(site) or Link()
        return self._rate(site, "down", link.down_bps), self._rate(site, "up", link.up_bps)

    def link(self, site: str) -> Link | None:
        """`site`'s figures (forgotten ones reset: `FORGET_AFTER_S`); None if never seen."""
        with self._lock:
            return self._live_link(site) if site in self._links else None

    def estimate(self, site: str, model_bytes: int, update_bytes: int | None) -> Estimate | None:
        """Seconds `site` needs for a round (None: not measured yet). `update_bytes`: what
        an upload of a whole update weighs when the site has not completed one yet
        (None: unknown, e.g. a compressed update; then only what was measured counts)."""
        link = self.link(site) or Link()
        down_bps, up_bps = self.rates(site)
        if down_bps is None and up_bps is None:
            return None
        down_s = up_s = 0.0
        rates = []
        if down_bps is not None:
            down_s = (link.down_bytes or model_bytes) / down_bps
            rates.append(down_bps)
        up_bytes = link.up_bytes or update_bytes or 0
        if up_bps is not None and up_bytes:
            up_s = up_bytes / up_bps
            rates.append(up_bps)
        if not rates:
            return None
        return Estimate(
            down_s + link.compute_s + up_s,
            min(rates),
            down_s=down_s,
            compute_s=link.compute_s,
            up_s=up_s,
            down_bps=down_bps,
            up_bps=up_bps,
            # a whole download too quick to time (the network's buffers took it) is instant
            complete=(down_bps is not None or link.down_bytes > 0) and bool(up_s) and link.computed,
        )

    def plan_round(
        self,
        plan: list[str],
        deadline_s: float,
        model_bytes: int,
        update_bytes: int | None,
        enough: int,
    ) -> dict[str, Estimate]:
        """The sites of `plan` to leave out of a round with `deadline_s` (slowest first),
        keeping at least `enough` of them: a round is never made impossible by an
        estimate. Counts each site's skips in a row."""
        doomed = {
            site: e
            for site in plan
            if (e := self.estimate(site, model_bytes, update_bytes)) is not None
            and e.seconds > deadline_s
        }
        room = max(0, len(plan) - enough)
        skipped = dict(sorted(doomed.items(), key=lambda kv: -kv[1].seconds)[:room])
        with self._lock:
            for site in plan:
                link = self._live_link(site)
                link.skipped_in_a_row = link.skipped_in_a_row + 1 if site in skipped else 0
        return skipped

    def skipped_in_a_row(self, site: str) -> int:
        link = self.link(site)
        return 0 if link is None else link.skipped_in_a_row
