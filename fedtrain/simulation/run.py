"""What every simulation loop does before its first client trains and after its last
round: the run directory, data, clients and initial model (`prepare`), evaluation in
the driver's model (`evaluate`), the final model on disk (`finish`), and the result.

The synchronous round loop (`engine`) and FedBuff's virtual clock (`async_engine`)
both build on it; `engine.run_simulation` picks one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import nn
from torch.utils.data import Dataset

from fedtrain.export import new_run_id, save_final_model
from fedtrain.run_dir import RunDir
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.population import ClientPopulation
from fedtrain.simulation.worker import WorkerSetup
from fedtrain.task import (
    EvalResult,
    Task,
    TaskContext,
    federated_names,
    model_for,
    resolve_device,
)
from fedtrain.tensors import ModelState

#: on_progress(round, clients done, clients training this round)
ProgressCallback = Callable[[int, int, int], None]


@dataclass
class SimulationResult:
    """The final global model and one metrics record per round."""

    model: ModelState
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_accuracy(self) -> float | None:
        evaluated = [r for r in self.history if r.get("accuracy") is not None]
        return evaluated[-1]["accuracy"] if evaluated else None


class Prepared(NamedTuple):
    """What every simulation loop builds before its first client trains."""

    run_dir: RunDir
    train: Dataset
    test: Dataset | None
    population: ClientPopulation
    heterogeneity: Heterogeneity
    model: nn.Module  # the driver's model: initial weights, then evaluation
    global_state: ModelState
    setup: WorkerSetup


def prepare(config: SimConfig, task: Task) -> Prepared:
    """The run directory (config written), data, clients and the initial global model."""
    run_dir = RunDir(config.run_dir)
    run_dir.write_config(dataclasses.asdict(config))
    train, test = task.datasets()
    population = ClientPopulation.build(task, train, config)
    heterogeneity = Heterogeneity(config.heterogeneity, len(population), config.seed)
    model = model_for(task, config.seed).to(resolve_device(config.device))
    global_state = ModelState.from_module(model, federated_names(task, model))
    setup = WorkerSetup(task, config, global_state.specs)
    return Prepared(run_dir, train, test, population, heterogeneity, model, global_state, setup)


def finish(
    config: SimConfig,
    task: Task,
    run_dir: RunDir,
    state: ModelState,
    history: list[dict[str, Any]],
) -> None:
    """Save the final model: safetensors with the task's names and its card, then
    model.pt (`fedtrain.export.save_final_model`)."""
    save_final_model(
        run_dir,
        task,
        state,
        task_ref=config.task,
        server_round=history[-1]["round"] if history else 0,
        run_id=new_run_id(),
        metrics=history[-1] if history else {},
    )


def evaluate(
    task: Task, model: nn.Module, state: ModelState, test: Dataset, config: SimConfig
) -> EvalResult:
    """`state` evaluated on the test set, in the driver's model object."""
    state.load_into(model, federated_names(task, model))
    context = TaskContext(
        device=resolve_device(config.device), client_id="server", seed=config.seed
    )
    return task.evaluate(model, test, config.client, context)
