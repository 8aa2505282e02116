"""Replacing the session's connections that an outage left backing off.

TCP sends again what a connection had in flight when its link went down on a timer
that doubles at every try (Linux: from ~0.2 s up to 120 s). The connections that were
moving bytes then stay silent after the link is back, for up to as long as the outage
again, while a new connection goes through at once: a 10 s outage mid-upload cost the
outage + 9.7 s on the emulated WAN (benchmarks/wan). The kernel setting that caps the
doubling (`net.ipv4.tcp_rto_max_ms`, Linux >= 6.15) is the whole machine's, and gRPC's
Python API sets no socket option, so the daemon does it itself.

While every transfer of the session is stalled (`StreamCount.stalled`: chunks came,
then none for far longer than any wait so far), the watch dials the server on a
connection of its own. A dial that fails, or takes long, says the link was down; once
one goes through while the transfers are still stalled, the link is back and their
connections are not: the session's connections are replaced (the daemon rejoins its
session, and each transfer continues from where the server holds it: at most a chunk
per stream moves again). A stall while dials go through (a busy server, not an outage) replaces
nothing, and is dialled ever less often, since a dial that goes through costs the
server a handshake.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from fedtrain.runtime.site.streams import STALL_S, StreamCount

#: How often the transfers are looked at while they move.
LOOK_S = 0.25
#: A dial that does not reach the server within this long failed: a link that is down
#: loses its first packet (a link 10x further away than a transatlantic one answers
#: well within it).
DIAL_TIMEOUT_S = 2.0
#: A dial that took this long, whether it went through or not, started while the link
#: was down (one that goes through in the end: the link came back meanwhile).
DOWN_S = 1.0
#: While the link is down (the last dial failed) the server is dialled this often, so
#: that the transfers move again within about this long of the link coming back.
DIAL_EVERY_S = 1.0
#: Once a dial shows the link back, the stalled connections are given this long to
#: carry something again before they are replaced.
BACK_S = 0.5
#: While dials go through and the transfers are still stalled (no outage: the server
#: is slow to take them), the time between dials doubles up to this.
DIAL_UP_MAX_S = 30.0


class OutageWatch:
    """Watches the transfers `watching` registers; `dial(timeout_s)` says whether a new
    connection reaches the server within `timeout_s`, `replace(since)` replaces the
    session's connections if they carried the transfers when they stalled (at `since`,
    on the clock: a connection made after is no stalled one) and says whether it did.
    The daemon calls `heard()` whenever the server's answer arrives (a control message,
    a transfer call's end): a connection that carries them is no stalled one. A thread
    of its own runs only while a transfer is watched."""

    def __init__(
        self,
        dial: Callable[[float], bool],
        replace: Callable[[float], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._dial, self._replace = dial, replace
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._counts: list[StreamCount] = []
        self._thread: threading.Thread | None = None
        #: When the server's last answer arrived, and how many so far.
        self._heard_at: float | None = None
        self._heard = 0
        #: A dial failed, or took DOWN_S, while the transfers were stalled: the link
        #: went down.
        self._down = False
        self._next_dial = 0.0
        self._up_every = DIAL_EVERY_S
        #: How many times the watch replaced the session's connections.
        self.replaced = 0

    @contextlib.contextmanager
    def watching(self, count: StreamCount) -> Iterator[None]:
        """Watch the transfer whose streams feed `count` while the block runs."""
        with self._lock:
            self._counts.append(count)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fedtrain-outage-watch", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._counts.remove(count)

    def heard(self) -> None:
        """The server's answer arrived on the session's connections."""
        with self._lock:
            self._heard_at, self._heard = self._clock(), self._heard + 1

    def look(self, counts: Sequence[StreamCount]) -> float:
        """Look at the transfers (`counts`: their streams') once, dialling the server if
        they are stalled; the seconds until the next look."""
        if not self._stalled(counts):
            self._down, self._next_dial, self._up_every = False, 0.0, DIAL_EVERY_S
            return LOOK_S
        now = self._clock()
        if now < self._next_dial:
            return min(LOOK_S, self._next_dial - now)
        before = self._progress(counts)
        through = self._dial(DIAL_TIMEOUT_S)
        self._down = self._down or self._clock() - now >= DOWN_S
        if not through:
            self._next_dial = now + DIAL_EVERY_S
            return max(0.0, self._next_dial - self._clock())
        if self._down:
            # The link is back. What the stalled connections sent as it came back (a
            # chunk, the server's answer) arrives within about a dial's round trips:
            # those that carry nothing a moment later are the backed-off ones.
            self._sleep(BACK_S)
            still = self._stalled(counts) and self._progress(counts) == before
            if still and self._replace(max(c.arrived_at or 0.0 for c in counts)):
                self.replaced += 1
        self._down = False
        self._next_dial = now + self._up_every
        self._up_every = min(2 * self._up_every, DIAL_UP_MAX_S)
        return LOOK_S

    def _stalled(self, counts: Sequence[StreamCount]) -> bool:
        """Every transfer is stalled, and the server has said nothing for as long."""
        with self._lock:
            heard_at = self._heard_at
        quiet = heard_at is None or self._clock() - heard_at > STALL_S
        return quiet and bool(counts) and all(count.stalled() for count in counts)

    def _progress(self, counts: Sequence[StreamCount]) -> tuple[int, int]:
        with self._lock:
            return sum(count.moved_bytes for count in counts), self._heard

    def _run(self) -> None:
        while True:
            with self._lock:
                counts = list(self._counts)
                if not counts:
                    self._thread = None
                    return
            self._sleep(self.look(counts))
