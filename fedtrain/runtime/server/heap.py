"""The server's heap with thousands of sites: the garbage collector kept off the
long-lived objects, and freed memory given back.

Why: each connected site holds ~170 objects the collector tracks (grpc.aio's call
machinery for its control stream, its coroutines, its session), and a full collection
walks every tracked object while it holds the GIL. Python runs one whenever the objects
that survived the younger collections grew by a quarter: while 10,000 sites joined,
eleven of them took 11 s (up to 1.7 s each), and during rounds one now and then took
0.6 s, in which no chunk was read, no Status answered and no heartbeat seen
(benchmarks/RESULTS.md, "Garbage collection at 10,000 sites").

What it does: every `FREEZE_EVERY_S` the objects alive are moved where the collector
never looks (`gc.freeze`, a list splice: microseconds), so a full collection walks only
what was made since. Objects that die later are still freed at once by reference
counting; only garbage in reference cycles among frozen objects (some of a departed
site's) waits. After `thaw_after` sites left, everything is unfrozen and collected once
(what Python would have done anyway, at a moment we choose: between rounds, or mid-round
once twice as many left), then frozen again.

Freed memory: every `TRIM_EVERY_S` the free pages of the C heap are given back to the
kernel (`allocator.release_free_memory`, on the caller's pool: it releases the GIL).
gRPC receives each upload into memory that, once freed, stays resident in pieces
between other connections' buffers (~100 KB per connection that carried an upload);
without this the server's RSS grew with every site that had uploaded once.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from fedtrain.runtime.allocator import release_free_memory

log = logging.getLogger(__name__)

#: How often what is alive is frozen (the objects made since wait at most this long).
FREEZE_EVERY_S = 5.0
#: Departed sites whose cyclic garbage may wait for the next thaw.
THAW_AFTER_DEPARTURES = 1000
#: How often freed C-heap pages are given back (a trim of 400 MB takes ~30 ms).
TRIM_EVERY_S = 10.0


class FrozenHeap:
    """Freezes the server's heap once in a while and thaws it after enough departures;
    has freed C-heap pages given back now and then (`submit` runs the trim off the
    caller's thread).

    Process-wide (the collector is): `close` unfreezes, so a process that runs several
    servers one after another (the tests) loses nothing to a frozen heap."""

    def __init__(
        self,
        thaw_after: int = THAW_AFTER_DEPARTURES,
        submit: Callable[[Callable[[], Any]], object] = lambda work: work(),
        trim: Callable[[], object] = release_free_memory,
    ) -> None:
        self.thaw_after = thaw_after
        self.departed = 0  # sites that left since the last thaw
        self._frozen_at = -math.inf
        self._trimmed_at = -math.inf
        self._submit, self._trim = submit, trim

    def site_left(self) -> None:
        self.departed += 1

    def tick(self, in_round: bool, now: float | None = None) -> None:
        """Once a second or so: trim if due; thaw and collect if due, else freeze if due."""
        now = time.monotonic() if now is None else now
        if now - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = now
            self._submit(self._trim)
        if self.departed >= self.thaw_after * (2 if in_round else 1):
            self.collect()
        elif now - self._frozen_at >= FREEZE_EVERY_S:
            gc.freeze()
            self._frozen_at = now

    def collect(self) -> int:
        """Unfreeze, collect everything once, freeze again; the objects collected."""
        gc.unfreeze()
        start = time.perf_counter()
        found = gc.collect()
        log.info(
            "collected the garbage of %d departed site(s): %d object(s) in %.2fs",
            self.departed,
            found,
            time.perf_counter() - start,
        )
        self.departed = 0
        gc.freeze()
        self._frozen_at = time.monotonic()
        return found

    def close(self) -> None:
        gc.unfreeze()
        self._frozen_at = -math.inf
