"""Tasks that spawned DDP workers import by name (conftest puts this folder on sys.path).

`ToyTask` is TorchTask's default loop on a small synthetic problem with no dropout,
so DDP and single-process runs can be compared; round config keys `crash_rank`,
`raise_rank` and `hang_rank` make that rank crash (os._exit), raise or hang.
"""

from __future__ import annotations

import os
import time

import psutil
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.task import TaskContext, TorchTask, TrainResult, federated_names, model_for
from fedtrain.tensors import ModelState

SEED, SITE = 3, "site-a"
#: Per-rank batch 8; momentum and two epochs so that any drift would show.
CONFIG = {"epochs": 2, "batch_size": 8, "lr": 0.2, "momentum": 0.9, "round": 4}


class ToyTask(TorchTask):
    def __init__(self, n: int = 96, features: int = 8, classes: int = 3) -> None:
        self.n, self.features, self.classes = n, features, classes

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.features, 16), nn.Tanh(), nn.Linear(16, self.classes))

    def datasets(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, self.features, generator=g)
        y = torch.randint(0, self.classes, (self.n,), generator=g)
        return TensorDataset(x, y), TensorDataset(x[:10], y[:10])

    def train(self, model, data, config, context):
        if config.get("crash_rank") == context.rank:
            os._exit(3)
        if config.get("raise_rank") == context.rank:
            raise RuntimeError(f"injected failure on rank {context.rank}")
        if config.get("hang_rank") == context.rank:
            time.sleep(3600)
        return super().train(model, data, config, context)


class BlockNet(nn.Module):
    """Two blocks in a ModuleList (FSDP's units) and a head; the first block is frozen."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(features, 16), nn.Tanh()),
                nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
            ]
        )
        self.head = nn.Linear(16, classes)
        self.blocks[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlocksTask(ToyTask):
    """ToyTask's problem on `BlockNet`: only the trainable block and the head travel."""

    federated = "trainable"

    def model(self) -> nn.Module:
        return BlockNet(self.features, self.classes)


def first_half(task: ToyTask) -> Dataset:
    """A data factory, as a site daemon passes one (module-level, so it pickles)."""
    train, _ = task.datasets()
    return torch.utils.data.Subset(train, list(range(len(train) // 2)))


def global_state(task: ToyTask | None = None) -> ModelState:
    """A round's global model (not the workers' initial one, so loading it matters)."""
    task = task or ToyTask()
    model = model_for(task, 11)
    return ModelState.from_module(model, federated_names(task, model))


def one_process_twice_the_batch(
    n: int = 96, task_class: type[ToyTask] = ToyTask
) -> tuple[ModelState, TrainResult]:
    """TorchTask's unchanged single-process loop with batch 2 x CONFIG's, from global_state().

    With n divisible by 2 there is no padding, and each of its steps takes exactly
    the examples that ranks 0 and 1 take together in the same DDP step.
    """
    task = task_class(n=n)
    model = model_for(task, SEED)  # the ranks' own frozen base: they build it under SEED
    names = federated_names(task, model)
    global_state(task).load_into(model, names)
    config = {**CONFIG, "batch_size": 2 * CONFIG["batch_size"]}
    result = task.train(model, task.datasets()[0], config, TaskContext(seed=SEED, client_id=SITE))
    return ModelState.from_module(model, names), result


def assert_same_model(a: ModelState, b: ModelState) -> None:
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def gone(procs: list[psutil.Process]) -> bool:
    """Every process has exited (a zombie waiting for its reaper counts as exited)."""

    def dead(p: psutil.Process) -> bool:
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(p) for p in procs)
