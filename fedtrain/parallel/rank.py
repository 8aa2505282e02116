"""What one rank of a site's DDP group is: its task, the site's data, the wrapped model.

The same `RankTrainer` runs in a spawned worker (local group) and in a process that
torchrun started (multi-node site), so both paths train identically.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from fedtrain.errors import ConfigError
from fedtrain.parallel.sharding import gather_federated, scatter_federated, shard_module
from fedtrain.strategy.base import RoundConfig
from fedtrain.task import Task, TaskContext, TrainResult, federated_names, load_task, model_for
from fedtrain.tensors import ModelState, select

log = logging.getLogger(__name__)

#: Builds a site's training set from its task. Must pickle (a module-level function or
#: a functools.partial of one) because spawned workers and torchrun ranks call it.
DataFactory = Callable[[Task], Dataset]


@dataclass(frozen=True)
class GroupSpec:
    """Everything a rank needs to build the same trainer as every other rank.

    `client_id` and `seed` seed the shuffle, so they must be equal on every rank
    (the daemon passes its site name and site seed). `data=None` trains on
    `task.datasets()[0]`.
    """

    task_ref: str
    task_options: Mapping[str, Any] = field(default_factory=dict)
    data: DataFactory | None = None
    seed: int = 0
    client_id: str = "local"
    #: "ddp": every rank holds the whole model; "fsdp": the ranks shard it (see
    #: `fedtrain.parallel.sharding`).
    sharding: str = "ddp"

    def check_picklable(self) -> None:
        """Fail in the daemon, not in a worker, when the spec cannot travel."""
        try:
            pickle.dumps(self)
        except Exception as exc:
            raise ConfigError(
                f"the worker group's task options or data factory cannot be sent to worker "
                f"processes ({type(exc).__name__}: {exc}); pass a module-level function or a "
                "functools.partial of one as `data`, and plain values as task options"
            ) from None


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


class RankTrainer:
    """One rank's long-lived state, kept across rounds: task, full site data, model.

    Each rank holds the whole site dataset; `TorchTask` (or a custom task, through
    `context.rank/world_size`) trains on this rank's shard of it.
    """

    def __init__(self, spec: GroupSpec, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.task = load_task(spec.task_ref, spec.task_options)
        self.data = spec.data(self.task) if spec.data is not None else self.task.datasets()[0]
        # Same seed on every rank; DDP also broadcasts rank 0's weights when it wraps.
        self.module = model_for(self.task, spec.seed).to(device)
        #: The tensors that travel (None: all); only they come in and go out.
        self.federated = federated_names(self.task, self.module)
        self.sharded = spec.sharding == "fsdp" and world_size > 1
        self.model: nn.Module = self.module
        if self.sharded:  # in place: the task trains the sharded module itself
            shard_module(self.module, device, world_size)
        elif world_size > 1:
            device_ids = [device.index or 0] if device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=device_ids)
        self.context = TaskContext(
            device=device, client_id=spec.client_id, seed=spec.seed, rank=rank,
            world_size=world_size,
        )  # fmt: skip

    def train(
        self, config: RoundConfig, global_state: ModelState | None, seed: int | None = None
    ) -> TrainResult:
        """One round: rank 0 loads `global_state`, every rank receives it, all train.

        `seed` (the same on every rank) replaces the context's seed for this round: a
        site draws a fresh one per job, so a re-run of a round never repeats an update.
        """
        if self.sharded:
            scatter_federated(self.module, global_state, self.federated, self.rank)
        else:
            if self.rank == 0:
                if global_state is None:
                    raise ValueError("rank 0 needs the global state")
                global_state.load_into(self.module, self.federated)
            if self.world_size > 1:
                broadcast_module(self.module, self.federated)
        context = self.context if seed is None else replace(self.context, seed=seed)
        return self.task.train(self.model, self.data, dict(config), context)

    def trained_state(self) -> Mapping[str, torch.Tensor] | None:
        """The federated tensors after training, on rank 0 (views of the live weights
        unless sharded); None elsewhere. Every rank calls it: sharded, it gathers."""
        if self.sharded:
            return gather_federated(self.module, self.federated, self.rank)
        return select(self.module.state_dict(), self.federated) if self.rank == 0 else None


@torch.no_grad()
def broadcast_module(module: nn.Module, names: Collection[str] | None = None) -> None:
    """The federated parameters and buffers (`names`; None: all) from rank 0 to all
    ranks, in place; a frozen base is the same on every rank already."""
    for tensor in select(module.state_dict(), names).values():
        dist.broadcast(tensor, src=0)
