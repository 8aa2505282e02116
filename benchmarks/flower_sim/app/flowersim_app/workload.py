"""The benchmark's workload, built from fedtrain's own code so both sides do equal work.

Data: `fedtrain.examples.SyntheticTask` (seeded), split IID with fedtrain's
partitioner, so client i holds the same examples on both sides. Training: the task's
`TorchTask.train` loop (SGD, cross-entropy, `epochs` x batches of `batch-size`).
Weights travel as one flat float32 vector in the model's `state_dict` order.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from fedtrain.examples import SyntheticTask
from fedtrain.partition import iid
from fedtrain.task import model_for


def task_for(config: Any) -> SyntheticTask:
    return SyntheticTask(
        num_train=int(config["num-clients"]) * int(config["examples-per-client"]),
        num_test=0,
        num_features=int(config["num-features"]),
        num_classes=int(config["num-classes"]),
    )


@lru_cache(maxsize=1)
def federation(config_items: tuple) -> tuple[SyntheticTask, Dataset, list[np.ndarray]]:
    """Task, training set and every client's indices: built once per process."""
    config = dict(config_items)
    task = task_for(config)
    train, _ = task.datasets()
    return task, train, iid(len(train), int(config["num-clients"]), int(config["seed"]))


def client_data(config: Any, client: int) -> tuple[SyntheticTask, Dataset]:
    task, train, parts = federation(tuple(sorted(config.items())))
    return task, Subset(train, parts[client].tolist())


def initial_weights(config: Any) -> np.ndarray:
    """The model fedtrain starts from (seeded init), flattened."""
    return to_flat(model_for(task_for(config), int(config["seed"])))


def to_flat(model: nn.Module) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()]).numpy()


def load_flat(model: nn.Module, flat: np.ndarray) -> None:
    values = torch.from_numpy(flat)
    start = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(values[start : start + tensor.numel()].reshape(tensor.shape))
            start += tensor.numel()
