"""Round checkpoints written on their own thread, while the next round already runs.

Writing a large model (`fedtrain.tensor_file`: direct I/O, fsync, rename) takes about as
long as moving it over the wire once; done inline it would sit between one round's
last update and the next round's instructions. Here round k's checkpoint is written
while round k+1's sites download and train. One write is in flight at a
time, and the coordinator waits for it before it finalizes the next round (so nothing
the write reads is changed under it) and before the server exits.

Durability is unchanged in kind: `checkpoint.ft` is always a complete round, replaced
atomically. A server killed during a write resumes from the round before and runs the
lost round again (`RunDir.drop_metrics_after` removes that round's line).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from fedtrain.run_dir import RunDir
from fedtrain.runtime.audit import AuditLog
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
            self.run_dir.save_checkpoint(server_round, state, strategy_state, extra)
            self.audit.record(
                "checkpoint_saved", round=server_round, model_version=extra.get("model_version")
            )
        except BaseException as exc:  # handed to the coordinator at its next `wait`
            log.exception("writing the checkpoint of round %d failed", server_round)
            self._error = exc
