"""Federated vs centralized on the same model, data and total epochs.

    python simulations/centralized.py simulations/digits.toml

Trains the task's model on the pooled training set for rounds x local epochs epochs
(same optimizer settings, same seed), then runs the federated simulation the
config describes, and prints both test accuracies.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fedtrain.config import from_dict, load_toml
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.simulation.engine import build_from_config
from fedtrain.task import TaskContext, model_for


def centralized_accuracy(config: SimConfig) -> float:
    """Same model and optimizer, all data in one place, the same total epochs."""
    task, _ = build_from_config(config)
    train, test = task.datasets()
    model = model_for(task, config.seed)
    epochs = config.rounds * int(config.client.get("epochs", 1))
    ctx = TaskContext(seed=config.seed, client_id="centralized")
    task.train(model, train, {**config.client, "epochs": epochs}, ctx)
    return task.evaluate(model, test, config.client, ctx).metrics["accuracy"]


def main(path: str) -> None:
    config = from_dict(SimConfig, {**load_toml(path), "run_dir": "runs/centralized-compare"})
    t0 = time.perf_counter()
    central = centralized_accuracy(config)
    t1 = time.perf_counter()
    federated = run_simulation(config).final_accuracy
    t2 = time.perf_counter()
    print(f"config: {Path(path).name}")
    print(f"centralized: accuracy {central:.4f} ({t1 - t0:.1f} s)")
    print(f"federated:   accuracy {federated:.4f} ({t2 - t1:.1f} s)")
    print(f"gap: {100 * (central - federated):+.2f} points")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "simulations/digits.toml")
