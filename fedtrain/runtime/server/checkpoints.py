"""Round checkpoints written on their own thread, while the next round already runs.

Writing a large model (`fedtrain.tensor_file`: direct I/O, fsync, rename) takes about as
long as moving it over the wire once; done inline it would sit between one round's
last update and the next round's instructions. Here round k's checkpoint is written
while round k+1's sites download and train. One write is in flight at a
time, and the coordinator waits for it before it finalizes the next round (so nothing
the write reads is changed under it) and before the server exits.

Durability is unchanged in kind: `checkpoint.ft` is always a complete round, replaced
atomically. A server killed during a write resumes from the round before and runs the
lost round again (`RunDir.settle_metrics` removes that round's line).

The run's record survives any crash: a checkpoint carries its round's metrics record
and audit summary (`extra["record"]`, `extra["round_audit"]`), submitted before the
metrics line is written. A crash after the checkpoint is on disk but before the line
(or the `round_completed` audit record) loses nothing: `settle_run_record`, on
resume, writes what is missing from the checkpoint, once. A crash before it is on disk
runs the round again, and the line it may have written is dropped. (Writing the line
first and the checkpoint after would be as safe against a kill, but not against a
power loss: the line is flushed, not fsynced; the checkpoint is.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from fedtrain.run_dir import RunDir
from fedtrain.runtime.server.audit import AuditLog, read_audit
from fedtrain.runtime.server.faults import fault_point
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes one checkpoint at a time in the background; `wait` re-raises its failure."""

    def __init__(self, run_dir: RunDir, audit: AuditLog) -> None:
        self.run_dir = run_dir
        self.audit = audit
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(
        self,
        server_round: int,
        state: ModelState,
        strategy_state: Mapping[str, Any],
        extra: Mapping[str, Any],
    ) -> None:
        """Start writing round `server_round`'s checkpoint (after the previous one ended)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write,
            args=(server_round, state, dict(strategy_state), dict(extra)),
            name=f"fedtrain-checkpoint-{server_round}",
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(
        self,
        server_round: int,
        state: ModelState,
        strategy_state: dict[str, Any],
        extra: dict[str, Any],
    ) -> None:
        try:
            fault_point("checkpoint_writing", server_round)
            self.run_dir.save_checkpoint(server_round, state, strategy_state, extra)
            fault_point("checkpoint_saved", server_round)
            self.audit.record(
                "checkpoint_saved", round=server_round, model_version=extra.get("model_version")
            )
        except BaseException as exc:  # handed to the coordinator at its next `wait`
            log.exception("writing the checkpoint of round %d failed", server_round)
            self._error = exc


def settle_run_record(
    run_dir: RunDir, audit: AuditLog, server_round: int, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """On resume from round `server_round`'s checkpoint: drop the metrics lines of later
    rounds, and write that round's line and `round_completed` audit record from the
    checkpoint if a crash lost them. Returns its metrics record ({} for a checkpoint
    written before checkpoints carried it)."""
    record = extra.get("record")
    dropped, restored = run_dir.settle_metrics(server_round, record)
    if dropped:
        log.info(
            "round(s) after %d were not checkpointed and run again (%d)", server_round, dropped
        )
    if restored:
        log.warning(
            "round %d's metrics line was lost in the crash; written from its checkpoint",
            server_round,
        )
    summary = extra.get("round_audit")
    version = extra.get("model_version")
    if summary is not None and not any(
        r.get("event") == "round_completed"
        and (r.get("round"), r.get("model_version")) == (server_round, version)
        for r in read_audit(audit.path)
    ):
        audit.record(
            "round_completed", round=server_round, model_version=version, recovered=True, **summary
        )
    return dict(record or {})
