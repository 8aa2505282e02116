"""TensorBoard scalars per round (`tensorboard = true` in server.toml or sim.toml).

One observer serves both drivers: it takes the same per-round record that goes to
`metrics.jsonl` and writes each number as a scalar at step = round, under
`RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`). Tags are grouped so the
dashboard reads well: `eval/accuracy`, `transfer/bytes_in`, `time/seconds`,
`privacy/epsilon`, `train/train_loss`, `round/clients`. A list (e.g. the runtime's
`dropped` sites) is written as its length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedtrain.errors import ConfigError

#: The folder under the run directory that holds the event files.
SUBDIR = "tensorboard"
INSTALL_HINT = "pip install 'fedtrain[tensorboard]'"
#: The `tensorboard` key's documentation, shared by server.toml and sim.toml.
TENSORBOARD_DOC = (
    f"Write each round's metrics as TensorBoard scalars under RUN_DIR/{SUBDIR} "
    f"(needs `{INSTALL_HINT}`); view them with `tensorboard --logdir RUN_DIR`."
)

_GROUPS = {
    "accuracy": "eval",
    "loss": "eval",
    "personalized_accuracy": "eval",
    "personalized_loss": "eval",
    "personalized_examples": "eval",
    "bytes": "transfer",
    "bytes_in": "transfer",
    "bytes_out": "transfer",
    "bytes_in_accepted": "transfer",
    "bytes_in_discarded": "transfer",
    "bytes_in_resent": "transfer",
    "seconds": "time",
    "train_seconds": "time",
    "clients_per_s": "time",
    "epsilon": "privacy",
    "delta": "privacy",
    "clip_norm": "privacy",
}
#: Not a measurement: the step itself.
_SKIP = frozenset({"round"})

RoundObserver = Callable[[dict[str, Any]], None]


def tag(key: str) -> str:
    """The TensorBoard tag of a record key (see the module docstring)."""
    group = _GROUPS.get(key) or ("train" if key.startswith("train_") else "round")
    return f"{group}/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers by tag; None (not evaluated this round) and text are skipped."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _SKIP or value is None:
            continue
        if isinstance(value, list | tuple):
            value = len(value)
        if isinstance(value, bool | int | float):
            out[tag(key)] = float(value)
    return out


class TensorBoardWriter:
    """Writes each round's record as scalars; a callable round observer."""

    def __init__(self, run_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"tensorboard = true needs the tensorboard package: {INSTALL_HINT} "
                "(or set tensorboard = false)"
            ) from None
        self.log_dir = Path(run_dir) / SUBDIR
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def __call__(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a round is minutes apart: let the dashboard see it now

    def close(self) -> None:
        self._writer.close()
