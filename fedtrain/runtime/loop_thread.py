"""An asyncio event loop in a daemon thread of its own, for a grpc.aio server that the
rest of a (threaded) process starts, calls into and stops."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """`start()` the loop, `run()` coroutines on it from other threads, `stop()` it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._stopped = False

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> asyncio.AbstractEventLoop:
        self._thread.start()
        return self.loop

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the loop; its result (or exception) here."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, last: Coroutine[Any, Any, Any] | None = None, timeout: float = 10.0) -> None:
        """Run `last` (e.g. a server's graceful stop) within `timeout`, then stop the loop,
        join its thread and close it (idempotent)."""
        stopping, self._stopped = not self._stopped, True
        if last is not None:
            if stopping and self._thread.is_alive():
                try:
                    self.run(last, timeout)
                except Exception as exc:  # pragma: no cover - a handler stuck past the grace
                    log.warning("%s did not stop cleanly: %s", self._thread.name, exc)
            else:
                last.close()  # never run: no "coroutine was never awaited" warning
        if not stopping:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self.loop.is_running():
            self.loop.close()
