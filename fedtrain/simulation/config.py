"""`sim.toml`: what a simulation runs. Every key is documented; unknown keys are errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.config import option, section


@dataclass
class PartitionConfig:
    kind: Literal["iid", "dirichlet", "shards", "quantity"] = option(
        "iid", "How the task's training set is split among clients."
    )
    alpha: float = option(
        0.5, "Dirichlet concentration for `dirichlet` (label skew) and `quantity` (size skew)."
    )
    labels_per_client: int = option(2, "Labels (shards) each client holds for `shards`.")


@dataclass
class StrategyConfig:
    name: str = option("fedavg", "Server algorithm (see fedtrain.strategy.STRATEGIES).")
    fraction_fit: float = option(1.0, "Fraction of available clients that train each round.")
    min_fit_clients: int = option(2, "At least this many clients train each round.")
    min_available_clients: int = option(2, "Rounds wait until this many clients exist.")


@dataclass
class SimConfig:
    task: str = option(doc="Task to run, as 'package.module:ClassName'.")
    task_options: dict[str, Any] = option({}, "Keyword arguments for the task's constructor.")
    rounds: int = option(10, "Number of federated rounds.")
    num_clients: int = option(10, "Number of virtual clients the training set is split into.")
    seed: int = option(0, "Seed of every stochastic choice (model init, partition, sampling).")
    backend: Literal["inline"] = option("inline", "Where clients run: `inline` (one process).")
    run_dir: str = option("runs/simulation", "Directory for config, metrics and models.")
    eval_every: int = option(1, "Evaluate the global model on the test set every N rounds.")
    partition: PartitionConfig = section(PartitionConfig, "How data is split.")
    strategy: StrategyConfig = section(StrategyConfig, "The server algorithm.")
    client: dict[str, Any] = option(
        {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "Round config sent to every client (epochs, batch_size, lr, momentum, ...).",
    )
    device: str = option("cpu", "Device virtual clients train on ('cpu', 'cuda', 'cuda:1').")
