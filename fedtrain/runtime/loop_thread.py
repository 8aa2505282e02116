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
        self.loop.set_exception_handler(_quiet_closed_loop_events)
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


def _quiet_closed_loop_events(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The default handler, less one harmless error: grpc.aio delivers completions from
    a poller thread through whichever loop runs its `_handle_events`, so when one of a
    process's gRPC servers (the sites' port, the run dir's status socket) has stopped
    and closed its loop, events for that server's last calls can still arrive through
    the other's and fail with "Event loop is closed" (a 10,000-site run's end logged
    up to 2,600 such tracebacks). The calls were already ended; nothing is lost."""
    error = context.get("exception")
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    if (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and "PollerCompletionQueue" in getattr(callback, "__qualname__", repr(callback))
    ):
        log.debug("a gRPC completion for a stopped server's closed loop was dropped")
        return
    loop.default_exception_handler(context)
