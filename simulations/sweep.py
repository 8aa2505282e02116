"""Run one configuration of a sweep: timed, in a temporary or kept run directory.

Shared by the table scripts in this folder (`privacy.py`, `compression.py`); each
builds its configurations from `strategies.base_config`, the digits setup of the
rounds-to-90% table.
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


def arguments(doc: str) -> argparse.Namespace:
    """--rounds and --keep, the options every table script takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--keep", help="keep each run's directory under this folder")
    return parser.parse_args()


def print_header(*columns: str) -> None:
    """A markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)


def table_config(rounds: int) -> dict[str, Any]:
    """The digits setup of the rounds-to-90% table, evaluated every 5 rounds."""
    return {**base_config("", rounds), "eval_every": 5}


def run(raw: dict[str, Any], name: str, keep: str | None) -> tuple[SimulationResult, float]:
    """(result, wall seconds) of the run `raw` describes (its `run_dir` is replaced):
    under `keep/name` when `keep` is given (for `fedtrain report`), else in a temporary
    directory."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(keep) / name if keep else Path(tmp)
        start = time.perf_counter()
        result = run_simulation(from_dict(SimConfig, {**raw, "run_dir": str(run_dir)}))
        return result, time.perf_counter() - start
