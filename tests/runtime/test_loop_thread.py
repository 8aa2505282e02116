"""The loop thread's exception handler: one known-harmless gRPC error dropped, the rest logged."""

from __future__ import annotations

import asyncio
import logging

from fedtrain.runtime.loop_thread import LoopThread


class PollerCompletionQueue:
    """Named like grpc.aio's poller, whose `_handle_events` hits a stopped server's loop."""

    def _handle_events(self) -> None:
        raise AssertionError("never run here")


def _report(loop: asyncio.AbstractEventLoop, callback, error: BaseException) -> None:
    handle = asyncio.Handle(callback, (), loop)
    loop.call_exception_handler(
        {"message": "Exception in callback", "exception": error, "handle": handle}
    )


def test_a_completion_for_a_closed_loop_is_dropped_and_other_errors_are_logged(caplog) -> None:
    thread = LoopThread("test-loop")
    loop = thread.loop
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            poller = PollerCompletionQueue()._handle_events
            _report(loop, poller, RuntimeError("Event loop is closed"))
            assert caplog.records == []
            _report(loop, poller, RuntimeError("something else"))
            _report(loop, lambda: None, RuntimeError("Event loop is closed"))
        assert len(caplog.records) == 2
    finally:
        loop.close()
