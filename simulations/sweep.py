"""Run one configuration of a sweep: timed, in a temporary or kept run directory.

Shared by the table scripts in this folder (`privacy.py`, `compression.py`); each
builds its configurations from `strategies.base_config`, the digits setup of the
rounds-to-90% table. Under 2 labels per client the global model's accuracy swings by
up to 0.1 from one round to the next, so the tables give the mean over the last
TAIL rounds beside the final accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from strategies import base_config

from fedtrain.config import from_dict
from fedtrain.simulation import SimConfig, SimulationResult, run_simulation

TAIL = 10


def arguments(doc: str, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """--rounds, --keep and --only, the options every table script takes (plus `parser`'s)."""
    parser = parser or argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--keep", help="keep each run's directory under this folder")
    parser.add_argument("--only", nargs="*", help="run only the rows of these names")
    return parser.parse_args()


def print_header(*columns: str) -> None:
    """A markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)


def table_config(rounds: int) -> dict[str, Any]:
    """The digits setup of the rounds-to-90% table, evaluated every round."""
    return {**base_config("", rounds), "eval_every": 1}


def tail_accuracy(result: SimulationResult) -> float:
    """Mean test accuracy over the last TAIL rounds."""
    accs = [r["accuracy"] for r in result.history if r.get("accuracy") is not None]
    return sum(accs[-TAIL:]) / len(accs[-TAIL:])


def run(raw: dict[str, Any], name: str, keep: str | None) -> tuple[SimulationResult, float]:
    """(result, wall seconds) of the run `raw` describes (its `run_dir` is replaced):
    under `keep/name` when `keep` is given (for `fedtrain report`), else in a temporary
    directory."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(keep) / name if keep else Path(tmp)
        start = time.perf_counter()
        result = run_simulation(from_dict(SimConfig, {**raw, "run_dir": str(run_dir)}))
        return result, time.perf_counter() - start
