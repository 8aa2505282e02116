"""TensorBoard scalars per round (`tensorboard = true` in server.toml or sim.toml).

One observer serves both drivers: it takes the same per-round record that goes to
`metrics.jsonl` and writes each number as a scalar at step = round, under
`RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`). Tags are grouped so the
dashboard reads well: `eval/accuracy`, `transfer/bytes_in`, `time/seconds`,
`privacy/epsilon`, `train/train_loss`, `round/clients`. A list (e.g. `dropped`
sites) is written as its length.

A federated evaluation adds where the model does worst: `eval/worst_accuracy`,
`eval/site_spread` and the worst site's name as text (`eval/worst_site`). Each site's
own figures (`sites/<site>/accuracy`) only with `tensorboard_sites = true`: a tag per
site is unreadable, and heavy, with thousands. All of it comes from the record's
`site_metrics`, so the privacy opt-out and secure evaluation leave it out.
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
TENSORBOARD_SITES_DOC = (
    "With tensorboard: also write each site's (virtual client's) evaluation figures as "
    "scalars (sites/<site>/accuracy, ...); the worst site and the spread are always "
    "written. Nothing per site under secure aggregation or with site_metrics = false."
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
    "worst_accuracy": "eval",
    "worst_loss": "eval",
    "site_spread": "eval",
}
#: Not a measurement: the step itself.
_SKIP = frozenset({"round"})

RoundObserver = Callable[[dict[str, Any]], None]


def tag(key: str) -> str:
    """The TensorBoard tag of a record key (see the module docstring)."""
    group = _GROUPS.get(key) or next(
        (g for prefix, g in (("train_", "train"), ("eval_", "eval")) if key.startswith(prefix)),
        "round",
    )
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


def site_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Each site's evaluation figures by tag (`sites/<site>/<metric>`)."""
    return {
        f"sites/{site}/{key}": float(value)
        for site, figures in (record.get("site_metrics") or {}).items()
        for key, value in figures.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


class TensorBoardWriter:
    """Writes each round's record as scalars; a callable round observer."""

    def __init__(self, run_dir: str | Path, *, sites: bool = False) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"tensorboard = true needs the tensorboard package: {INSTALL_HINT} "
                "(or set tensorboard = false)"
            ) from None
        self.log_dir = Path(run_dir) / SUBDIR
        self.sites = sites
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def __call__(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        if record.get("worst_site"):
            self._writer.add_text("eval/worst_site", str(record["worst_site"]), global_step=step)
        if self.sites:
            for name, value in site_scalars(record).items():
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a round is minutes apart: let the dashboard see it now

    def close(self) -> None:
        self._writer.close()
