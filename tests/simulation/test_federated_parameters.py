"""A partly federated task in the simulation: only the head travels, on every path."""

from __future__ import annotations

import pytest
import torch

from fedtrain.examples import FrozenBaseTask
from fedtrain.simulation import run_simulation
from fedtrain.task import model_for

FROZEN = {
    "task": "fedtrain.examples:FrozenBaseTask",
    "task_options": {"num_train": 1200, "num_test": 300, "base_seed": 5},
}
HEAD = ["2.weight", "2.bias"]


@pytest.mark.parametrize(
    "path",
    [
        {"backend": "inline"},
        {"backend": "process", "workers": 2},
        {"backend": "inline", "secagg": {"enabled": True, "clip": 2.0, "max_weight": 200.0}},
        {"backend": "inline", "compression": "int8"},
        {
            "backend": "inline",
            "strategy": {
                "name": "dpfedavg",
                "min_fit_clients": 20,
                "min_available_clients": 20,
                "options": {"noise_multiplier": 0.01, "clip_norm": 5.0},
            },
        },
        {"backend": "inline", "strategy": {"name": "fedbuff", "options": {"buffer_size": 4}}},
    ],
    ids=["inline", "process", "secagg", "int8", "dp", "fedbuff"],
)
def test_only_the_trainable_head_travels_and_it_learns_over_a_frozen_base(make_config, path):
    config = make_config("frozen", **FROZEN, **path)
    result = run_simulation(config)
    assert list(result.model) == HEAD  # the global model is the head, nothing else
    first, last = result.history[0], result.history[-1]
    assert last["accuracy"] > 0.6 and last["loss"] < first["loss"] + 0.05, result.history
    initial = model_for(FrozenBaseTask(**FROZEN["task_options"]), config.seed)
    assert not torch.equal(result.model["2.weight"], initial[2].weight)  # it did train
