"""Test-only fault injection: pause the server at a named point so a test can kill it there.

The crash tests need a server killed (SIGKILL, from outside, like a real crash) at
exact moments of a round's end: after the last fold, after the checkpoint reached
the disk but before the metrics line, and so on. Killing at random times hits the
narrow windows too rarely to test them. With `FEDTRAIN_FAULT_POINT=NAME@ROUND` in its
environment, the thread that reaches point NAME of round (or FedBuff version) ROUND
logs `fault point NAME@ROUND reached` and blocks for good; the test then waits for
what else it wants on disk and kills the process. Unset (always, outside tests), a
point costs one environment lookup.

`POINTS` lists the points in the order a round's end passes them (the `checkpoint_*`
ones are on the checkpoint writer's thread, beside the coordinator's).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

ENV = "FEDTRAIN_FAULT_POINT"

POINTS = (
    "finalize",  # the last update is folded; the strategy has not made the new model
    "published",  # the new model is the global model; nothing of it is on disk
    "evaluated",  # its metrics record is complete; its checkpoint is not started
    "checkpoint_writing",  # the writer starts on the checkpoint (which carries the record)
    "checkpoint_saved",  # the checkpoint is on disk; its audit record is not written
    "checkpoint_submitted",  # the coordinator handed the checkpoint to the writer
    "metrics_logged",  # the round's metrics line is written; its audit record is not
    "round_recorded",  # the round is recorded everywhere; the next one has not started
)


def fault_point(name: str, server_round: int) -> None:
    """Block this thread for good if the environment names this point and round."""
    if os.environ.get(ENV) == f"{name}@{server_round}":
        log.warning(
            "fault point %s@%d reached (%s); this thread stops here", name, server_round, ENV
        )
        threading.Event().wait()
