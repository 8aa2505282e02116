"""The run directory both drivers write: config used, metrics, checkpoints, final model.

Layout (the runtime adds `audit.jsonl`):

    RUN_DIR/config.json        the resolved config, every default filled in
    RUN_DIR/metrics.jsonl      one JSON line per round
    RUN_DIR/checkpoint.ft      latest round: model + strategy state + round (atomic;
                               `fedtrain.tensor_file` format, written past the page cache)
    RUN_DIR/model.pt           the final global model (tensors only)

Files are replaced atomically (write to a temporary file, fsync, rename), so a crash
at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedtrain.errors import ConfigError
from fedtrain.files import atomic_write
from fedtrain.tensor_file import load_tensor_file, save_tensor_file
from fedtrain.tensors import ModelState


def save_state(path: Path, state: ModelState) -> None:
    atomic_write(path, lambda f: torch.save(dict(state.items()), f))


def load_state(path: Path) -> ModelState:
    # weights_only: a model file never executes code when loaded.
    return ModelState(torch.load(path, map_location="cpu", weights_only=True))


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

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one round's line (append + flush: a crash loses at most that line)."""
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def drop_metrics_after(self, server_round: int) -> int:
        """Remove the lines of rounds after `server_round` (a resume re-runs them); returns
        how many were removed."""
        records = self.read_metrics()
        keep = [r for r in records if r.get("round", 0) <= server_round]
        if len(keep) != len(records):
            text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode()
            atomic_write(self.metrics_path, lambda f: f.write(text))
        return len(records) - len(keep)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        with self.metrics_path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

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
        if self.checkpoint_path.exists():
            payload = load_tensor_file(self.checkpoint_path)
        elif self.legacy_checkpoint_path.exists():
            payload = torch.load(self.legacy_checkpoint_path, map_location="cpu", weights_only=True)
        else:
            raise ConfigError(
                f"no checkpoint in {self.path}: nothing to resume (start without --resume)"
            )
        return payload["round"], ModelState(payload["model"]), payload["strategy"], payload["extra"]

    def save_model(self, state: ModelState) -> None:
        save_state(self.model_path, state)
