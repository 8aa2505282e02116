"""Where virtual clients run. Every backend trains the same shares with the same
`ClientRunner` and yields the same events; only the transport differs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Protocol

from torch.utils.data import Dataset

from fedtrain.parallel.placement import assign_devices, slots, visible_devices
from fedtrain.simulation.backends.cpus import machine_cpus
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.events import WorkerEvent
from fedtrain.simulation.plan import RoundPlan
from fedtrain.simulation.population import ClientPopulation
from fedtrain.simulation.worker import WorkerSetup
from fedtrain.tensors import ModelState


class Backend(Protocol):
    """A context manager that owns its workers; `num_workers` is final once entered."""

    num_workers: int

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc: object) -> None: ...

    def run_round(self, plan: RoundPlan, global_state: ModelState) -> Iterator[WorkerEvent]:
        """Train the plan's shares from `global_state` (or, for an evaluation plan,
        evaluate it at each client); events in any order across workers."""
        ...


def open_backend(
    config: SimConfig,
    setup: WorkerSetup,
    data: tuple[Dataset, ClientPopulation] | None = None,
) -> Backend:
    """The backend `config.backend` names; `data` lets the inline one reuse the driver's."""
    workers = config.workers or machine_cpus()
    if config.backend == "inline":
        from fedtrain.simulation.backends.inline import InlineBackend

        return InlineBackend(setup, workers, data)
    if config.backend == "process":
        from fedtrain.simulation.backends.process_pool import ProcessPoolBackend

        workers, devices = gpu_placement(config, visible_devices())
        setup = dataclasses.replace(setup, devices=devices)
        return ProcessPoolBackend(setup, workers, cpus=machine_cpus())
    from fedtrain.simulation.backends.ray_actors import RayActorsBackend

    return RayActorsBackend(setup, config.workers, config.ray)


def gpu_placement(config: SimConfig, visible: Sequence[str]) -> tuple[int, tuple[str, ...]]:
    """(workers, device of each worker) for the process backend.

    With `device = "cuda"` and GPUs visible, workers spread round-robin over them,
    `gpus_per_client` of a GPU each, so a multi-GPU box trains that many clients at
    once; `workers = 0` then means as many as fit. Otherwise every worker uses
    `config.device` and `workers = 0` means one per CPU core.
    """
    if config.device != "cuda" or not visible:
        return config.workers or machine_cpus(), ()
    workers = config.workers or slots(visible, config.gpus_per_client)
    names = [str(w) for w in range(workers)]
    placed = assign_devices(names, visible, config.gpus_per_client)
    return workers, tuple(placed[n][0] for n in names)
