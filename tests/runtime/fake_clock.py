"""A clock the test moves by hand: pass it where code takes `clock=` (time.monotonic)."""

from __future__ import annotations

import threading


class FakeClock:
    """Reads `now`; `advance` moves it (from any thread)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
