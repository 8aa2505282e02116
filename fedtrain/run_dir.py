"""The run directory both drivers write: config used, metrics, checkpoints, final model.

Layout (the runtime adds `audit.jsonl`):

    RUN_DIR/config.json        the resolved config, every default filled in
    RUN_DIR/metrics.jsonl      one JSON line per round
    RUN_DIR/checkpoint.ft      latest round: model + strategy state + round (atomic;
                               `fedtrain.tensor_file` format, written past the page cache,
                               checksummed), and that round's metrics line
    RUN_DIR/model.pt           the final global model (tensors only)

Files are replaced atomically (write to a temporary file, fsync, rename), so a crash
at any moment leaves the previous checkpoint intact. A resume settles metrics.jsonl
against the checkpoint (`settle_metrics`): lines of rounds after it go (those rounds
run again), and the checkpointed round's own line is written from the checkpoint if
the crash came before it, so every round has exactly one line.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedtrain.errors import ConfigError
from fedtrain.files import atomic_write, read_jsonl
from fedtrain.tensor_file import load_tensor_file, save_tensor_file
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


def save_state(path: Path, state: ModelState) -> None:
    atomic_write(path, lambda f: torch.save(dict(state.items()), f))


def load_state(path: Path) -> ModelState:
    # weights_only: a model file never executes code when loaded.
    return ModelState(torch.load(path, map_location="cpu", weights_only=True))


class RunProgress(enum.Enum):
    """Where a run directory's run stands (`RunDir.progress`), for a restart's decision."""

    NOT_STARTED = "not_started"  # no checkpoint: start the run
    INTERRUPTED = "interrupted"  # a checkpoint before the end, or no final model yet: resume
    COMPLETE = "complete"  # the last round is checkpointed and the final model saved


class RunDir:
    """One run's directory; see the module docstring for its files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.ft"

    @property
    def legacy_checkpoint_path(self) -> Path:
        """Where fedtrain before the `fedtrain.tensor_file` format kept it (`torch.save`)."""
        return self.path / "checkpoint.pt"

    @property
    def model_path(self) -> Path:
        return self.path / "model.pt"

    def write_config(self, config: Mapping[str, Any]) -> None:
        text = json.dumps(config, indent=2, sort_keys=True, default=str).encode()
        atomic_write(self.path / "config.json", lambda f: f.write(text))

    def write_json(self, name: str, data: Mapping[str, Any]) -> Path:
        """RUN_DIR/`name`, written atomically (e.g. the cross-site validation)."""
        text = json.dumps(data, indent=2, sort_keys=True).encode()
        path = self.path / name
        atomic_write(path, lambda f: f.write(text))
        return path

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one round's line (append + flush: a crash loses at most that line)."""
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def settle_metrics(
        self, server_round: int, record: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]:
        """Make metrics.jsonl end with round `server_round` (the checkpointed one): remove
        the lines of later rounds (a resume runs them again) and, when `record` (that
        round's line, carried in its checkpoint) is given and its line is missing, write
        it. Returns (lines removed, whether `record` was written)."""
        records, torn = self._read_metrics()
        keep = [r for r in records if r.get("round", 0) <= server_round]
        restored = record is not None and all(r.get("round") != server_round for r in keep)
        if restored:
            keep.append(dict(record or {}))
        if keep != records or torn:
            text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode()
            atomic_write(self.metrics_path, lambda f: f.write(text))
        return len(records) + restored - len(keep), restored

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every line; a last line cut short by a crash (no newline, not JSON) is skipped."""
        return self._read_metrics()[0]

    def _read_metrics(self) -> tuple[list[dict[str, Any]], bool]:
        """The lines, and whether the file ends in a line cut short (skipped)."""
        lines = read_jsonl(self.metrics_path)
        if lines.dropped:
            log.warning("%s: its last line was cut short by a crash; skipped", self.metrics_path)
        return lines.records, lines.unterminated

    def save_checkpoint(
        self,
        server_round: int,
        state: ModelState,
        strategy_state: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        payload = {
            "round": server_round,
            "model": dict(state.items()),
            "strategy": dict(strategy_state),
            "extra": dict(extra or {}),
        }
        save_tensor_file(self.checkpoint_path, payload)

    def load_checkpoint(self) -> tuple[int, ModelState, dict[str, Any], dict[str, Any]]:
        """(round, model, strategy state, extra) of the checkpoint, every checksum verified."""
        if self.checkpoint_path.exists():
            payload = load_tensor_file(self.checkpoint_path)
        elif self.legacy_checkpoint_path.exists():
            log.warning(
                "%s is a torch.save checkpoint from before checksums: it is loaded unverified; "
                "the next checkpoint is written, with checksums, to %s",
                self.legacy_checkpoint_path,
                self.checkpoint_path.name,
            )
            payload = torch.load(self.legacy_checkpoint_path, map_location="cpu", weights_only=True)
        else:
            raise ConfigError(
                f"no checkpoint in {self.path}: nothing to resume (start without --resume)"
            )
        return payload["round"], ModelState(payload["model"]), payload["strategy"], payload["extra"]

    def checkpointed_round(self) -> int | None:
        """The round the checkpoint holds (its header alone is read); None without one."""
        if self.checkpoint_path.exists():
            return int(load_tensor_file(self.checkpoint_path, tensors=False)["round"])
        if self.legacy_checkpoint_path.exists():
            payload = torch.load(self.legacy_checkpoint_path, mmap=True, weights_only=True)
            return int(payload["round"])
        return None

    def progress(self, rounds: int) -> RunProgress:
        """Where this directory's run of `rounds` rounds stands: the one rule a restart
        (`fedtrain server --resume-if-present`, the systemd unit) decides by."""
        done = self.checkpointed_round()
        if done is None:
            return RunProgress.NOT_STARTED
        if done >= rounds and self.model_path.exists():
            return RunProgress.COMPLETE
        return RunProgress.INTERRUPTED

    def save_model(self, state: ModelState) -> None:
        save_state(self.model_path, state)
