"""Make `sim_tasks` (test-only tasks) importable here and in spawned worker processes.

Worker processes unpickle the task object, so its class must be importable by name
there; spawn hands the parent's sys.path to its children.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fedtrain.config import from_dict
from fedtrain.simulation import SimConfig

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def make_config(tmp_path):
    """A small synthetic-logistic-regression SimConfig; keyword overrides win."""

    def make(name: str = "run", **overrides) -> SimConfig:
        raw = {
            "task": "fedtrain.examples:SyntheticTask",
            "task_options": {"num_train": 1200, "num_test": 300},
            "rounds": 3,
            "num_clients": 40,
            "seed": 3,
            "workers": 2,
            "run_dir": str(tmp_path / name),
            "strategy": {"fraction_fit": 0.5, "min_fit_clients": 2},
            "client": {"epochs": 1, "batch_size": 8, "lr": 0.1},
            **overrides,
        }
        return from_dict(SimConfig, raw)

    return make


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Inline runs train tiny models in this process: torch's thread pool only adds
    contention there (10x slower on a busy 2-core machine). Workers set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
