"""The simulation's round loop: the same Task and Strategy code as a deployment.

Virtual clients hold index partitions of the task's training set. Each round the
strategy picks clients, each trains from the current global model, and its delta is
folded into the strategy's streaming aggregator at once, so memory stays O(model)
whatever the number of clients.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset

from fedtrain.partition import partition
from fedtrain.run_dir import RunDir
from fedtrain.simulation.config import SimConfig
from fedtrain.strategy import RoundConfig, Strategy, build_strategy, compute_delta
from fedtrain.task import (
    EvalResult,
    Task,
    TaskContext,
    TrainResult,
    load_task,
    model_for,
    resolve_device,
)
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """The final global model and one metrics record per round."""

    model: ModelState
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_accuracy(self) -> float | None:
        evaluated = [r for r in self.history if r.get("accuracy") is not None]
        return evaluated[-1]["accuracy"] if evaluated else None


class InlineBackend:
    """Runs the chosen clients one after another in this process (deterministic).

    One model object is reused for every client: loading the global weights into it
    is cheaper than building a model per client.
    """

    def __init__(self, task: Task, seed: int, device: str) -> None:
        self.task = task
        self.seed = seed
        self.device = resolve_device(device)
        self.model = model_for(task, seed).to(self.device)

    def train_clients(
        self,
        global_state: ModelState,
        plan: dict[str, RoundConfig],
        data: dict[str, Dataset],
    ) -> Iterator[tuple[str, ModelState, TrainResult]]:
        for client_id, config in plan.items():
            global_state.load_into(self.model)
            context = TaskContext(device=self.device, client_id=client_id, seed=self.seed)
            result = self.task.train(self.model, data[client_id], config, context)
            local = ModelState.from_module(self.model)
            yield client_id, compute_delta(local, global_state), result

    def evaluate(self, state: ModelState, data: Dataset, config: RoundConfig) -> EvalResult:
        state.load_into(self.model)
        context = TaskContext(device=self.device, client_id="server", seed=self.seed)
        return self.task.evaluate(self.model, data, config, context)


def client_datasets(task: Task, train: Dataset, config: SimConfig) -> dict[str, Dataset]:
    """Each virtual client's Subset of the training set, per the partition config."""
    labels = (
        task.labels(train).numpy()
        if config.partition.kind in ("dirichlet", "shards")
        else (
            np.zeros(len(train))  # type: ignore[arg-type]
        )
    )
    parts = partition(
        config.partition.kind,
        labels,
        config.num_clients,
        seed=config.seed,
        alpha=config.partition.alpha,
        labels_per_client=config.partition.labels_per_client,
    )
    width = len(str(config.num_clients - 1))
    return {f"client-{i:0{width}d}": Subset(train, p.tolist()) for i, p in enumerate(parts)}


def build_from_config(config: SimConfig) -> tuple[Task, Strategy]:
    task = load_task(config.task, config.task_options)
    strategy = build_strategy(
        config.strategy.name,
        **{k: v for k, v in dataclasses.asdict(config.strategy).items() if k != "name"},
        client_config=config.client,
    )
    return task, strategy


def run_simulation(
    config: SimConfig,
    *,
    task: Task | None = None,
    strategy: Strategy | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> SimulationResult:
    """Run `config.rounds` rounds and write the run directory; returns the final model."""
    if task is None or strategy is None:
        built_task, built_strategy = build_from_config(config)
        task, strategy = task or built_task, strategy or built_strategy
    run_dir = RunDir(config.run_dir)
    run_dir.write_config(dataclasses.asdict(config))
    train, test = task.datasets()
    data = client_datasets(task, train, config)
    backend = InlineBackend(task, config.seed, config.device)
    rng = np.random.default_rng(config.seed)
    global_state = ModelState.from_module(backend.model)
    result = SimulationResult(global_state)
    for server_round in range(1, config.rounds + 1):
        start = time.perf_counter()
        plan = strategy.configure_round(server_round, list(data), rng)
        aggregate = strategy.begin_round(server_round, global_state)
        train_metrics = []
        for _client, delta, res in backend.train_clients(global_state, plan, data):
            aggregate.add(delta, float(res.num_examples))
            train_metrics.append((res.num_examples, res.metrics))
        global_state = strategy.finalize_round(server_round, global_state, aggregate)
        record: dict[str, Any] = {
            "round": server_round,
            "clients": len(plan),
            "bytes": 2 * global_state.nbytes * len(plan),  # what would cross the wire
            **strategy.aggregate_metrics(train_metrics),
            "loss": None,
            "accuracy": None,
        }
        if test is not None and (
            server_round % config.eval_every == 0 or server_round == config.rounds
        ):
            ev = backend.evaluate(global_state, test, config.client)
            record["loss"], record["accuracy"] = ev.loss, ev.metrics.get("accuracy")
        record["seconds"] = time.perf_counter() - start
        run_dir.log_metrics(record)
        result.history.append(record)
        if on_round is not None:
            on_round(record)
    run_dir.save_model(global_state)
    result.model = global_state
    return result
