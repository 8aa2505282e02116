"""What the operator sees of transfers in flight: progress and stall lines in the log,
and each transfer's recent rate and silence for `fedtrain status` and per-site deadlines.

A 40 MB upload over a hospital's link takes minutes; without this the log is silent
from "round 3 started" to "aggregated" or "dropped". Chunks are counted by the
transfer's `TransferMeter` (an integer add, nothing else per chunk); once a second
the server's loop calls `TransferWatch.tick`, which samples every transfer in flight
(at most `max_transfers`), so the work here never grows with chunks or with sites.

Per transfer, the log gets at most: a progress line at 25, 50 and 75% once it has run
`transfers.progress_after_s`; one "stalled" warning after `transfers.stall_s` without
a byte, and one line when it moves again.

A transfer that holds a slot and moves no byte for `IDLE_CUT_STALLS` x `stall_s` is
handed to `on_idle` every tick until it takes it (the servicer cuts its streams and
frees its slot once another transfer waits for one): under FedBuff nothing else would
ever end it, and in rounds it would hold its slot until the round's deadline. Silence
is the site's only: waiting for a slot is not holding one (a meter exists from the
grant on), and time the server spends on the transfer (encoding a download, journaling
a chunk: `TransferMeter.serving`) counts as movement.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fedtrain.observability.status import amount, mbit
from fedtrain.runtime.config import TransfersConfig
from fedtrain.runtime.server.links import LinkEstimates, TransferMeter, Watched

log = logging.getLogger(__name__)

#: How often the loop samples the transfers in flight.
TICK_S = 1.0
#: A transfer's recent rate is its bytes over about this many seconds of samples.
RATE_WINDOW_S = 5.0
#: A transfer that holds a slot and moves no byte for this many `transfers.stall_s` is
#: cut while another transfer waits for a slot (60 s with the defaults). Derived from
#: stall_s, not a key of its own: stall_s is
#: the operator's one statement of how long without a byte is abnormal on their links
#: (a slow site's chunk must take less, or each of its chunks would log a stall, so a
#: federation of slow links raises it, and the cut follows). The stall warning comes
#: first, and 3x leaves room to recover from a stall (TCP's retransmission backoff after
#: a short loss, a busy moment at the site). It may fall inside an outage the server
#: forgives (heartbeat.timeout_s + grace_s) on purpose: the cut drops nobody, the site
#: needs no slot while its link is down and resumes where it stopped (an upload is
#: kept upload_grace_s, a download continues from its offset), and others need the slot.
#: Only while another transfer waits, because bytes are counted by the chunk (gRPC hands
#: over whole messages): a chunk on its way over a link slower than chunk_bytes / this
#: bound (0.56 Mbit/s with the defaults) looks idle, and a cut loses it; cut whenever it
#: is idle, such a site would never finish a transfer, cut only when the slot is needed,
#: it finishes once the queue is empty.
IDLE_CUT_STALLS = 3.0


@dataclass
class _Notes:
    """The loop's own bookkeeping for one transfer."""

    samples: deque[tuple[float, int]] = field(default_factory=deque)
    last_moved: float = 0.0
    quarters: int = 0  # progress lines written (25, 50, 75%)
    stalled: bool = False
    cut: bool = False  # `on_idle` took it


def idle_cut_s(config: TransfersConfig) -> float:
    """Seconds without a byte after which a transfer holding a slot is cut."""
    return IDLE_CUT_STALLS * config.stall_s


def describe(meter: TransferMeter) -> str:
    """ "upload 12.5 of 40.0 MB", or "upload 12.5 MB" while its size is unknown."""
    what = "download" if meter.direction == "down" else "upload"
    return f"{what} {amount(meter.done, meter.total)}"


class TransferWatch:
    """Samples the transfers in flight (see the module docstring); `tick` on the loop."""

    def __init__(
        self,
        links: LinkEstimates,
        config: TransfersConfig,
        on_idle: Callable[[TransferMeter, float], bool] | None = None,
    ) -> None:
        self.links = links
        self.config = config
        #: Called (on the loop) each tick for a transfer idle `idle_cut_s`, with its idle
        #: seconds, until it returns True (it cut the transfer).
        self.on_idle = on_idle
        self._notes: dict[TransferMeter, _Notes] = {}

    def tick(self, now: float | None = None) -> None:
        """Sample every transfer in flight once; log progress and stalls."""
        now = time.monotonic() if now is None else now
        meters = self.links.transfers()
        notes = {meter: self._notes.get(meter) or _Notes(last_moved=now) for meter in meters}
        self._notes = notes  # transfers that ended are forgotten
        for meter, note in notes.items():
            self._sample(meter, note, now)

    def _sample(self, meter: TransferMeter, note: _Notes, now: float) -> None:
        nbytes = meter.nbytes
        samples = note.samples
        if meter.serving or (samples and nbytes > samples[-1][1]):
            if note.stalled:
                log.info(
                    "site %r: %s moves again after %.0fs without a byte",
                    meter.site,
                    describe(meter),
                    now - note.last_moved,
                )
            note.last_moved, note.stalled = now, False
        samples.append((now, nbytes))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        first_t, first_bytes = samples[0]
        bps = (nbytes - first_bytes) / (now - first_t) if now - first_t >= TICK_S else None
        meter.watched = Watched(bps, note.last_moved)
        idle = now - note.last_moved
        if idle >= self.config.stall_s and not note.stalled:
            note.stalled = True
            log.warning(
                "transfer stalled: no bytes %s site %r for %.0fs (%s)",
                "to" if meter.direction == "down" else "from",
                meter.site,
                idle,
                describe(meter),
            )
        if idle >= idle_cut_s(self.config) and not note.cut and self.on_idle is not None:
            try:
                note.cut = self.on_idle(meter, idle)
            except Exception:  # one transfer's cut must not stop the watch of the others
                note.cut = True
                log.exception("cutting site %r's idle %s failed", meter.site, describe(meter))
        self._progress(meter, note, now, bps)

    def _progress(self, meter: TransferMeter, note: _Notes, now: float, bps: float | None) -> None:
        after = self.config.progress_after_s
        if not after or not meter.total or now - meter.started < after:
            return
        quarter = min(3, 4 * meter.done // meter.total)
        if quarter <= note.quarters:
            return
        note.quarters = quarter
        log.info(
            "site %r: %s (%d%%), %s Mbit/s, %.0fs so far",
            meter.site,
            describe(meter),
            100 * meter.done // meter.total,
            mbit(bps),
            now - meter.started,
        )
