"""Rounds to reach 90% test accuracy on digits under pathological non-IID data.

    python simulations/strategies.py [--max-rounds 150]

20 clients, 2 labels each (`shards` partition, McMahan et al.), every client trains
every round (2 local epochs, SGD lr 0.02, momentum 0.9, batch 16). Each strategy runs
with the settings in STRATEGIES below (server-side hyper-parameters tuned coarsely
once, by hand); the table reports the first round whose global model reaches 90% on
the 360 held-out digits, and the final accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from fedtrain.config import from_dict
from fedtrain.simulation import SimConfig, run_simulation

TARGET = 0.90
STRATEGIES: dict[str, dict] = {
    "fedavg": {},
    "fedprox": {"proximal_mu": 0.01},
    "fedadam": {"server_lr": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedavgm": {"server_lr": 1.0, "server_momentum": 0.5},
}


def base_config(run_dir: str, rounds: int) -> dict:
    return {
        "task": "fedtrain.examples:DigitsTask",
        "rounds": rounds,
        "num_clients": 20,
        "seed": 0,
        "run_dir": run_dir,
        "partition": {"kind": "shards", "labels_per_client": 2},
        "strategy": {"min_fit_clients": 20, "min_available_clients": 20},
        "client": {"epochs": 2, "batch_size": 16, "lr": 0.02, "momentum": 0.9},
    }


def rounds_to_target(history: list[dict]) -> int | None:
    for record in history:
        if record.get("accuracy") is not None and record["accuracy"] >= TARGET:
            return record["round"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rounds", type=int, default=150)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    args = parser.parse_args()
    print("| strategy | options | rounds to 90% | final accuracy | wall time |")
    print("|---|---|---|---|---|")
    for name in args.only:
        with tempfile.TemporaryDirectory() as run_dir:
            raw = base_config(run_dir, args.max_rounds)
            raw["strategy"] = {**raw["strategy"], "name": name, "options": STRATEGIES[name]}
            start = time.perf_counter()
            result = run_simulation(from_dict(SimConfig, raw))
            seconds = time.perf_counter() - start
        reached = rounds_to_target(result.history)
        print(
            f"| {name} | {STRATEGIES[name] or '-'} | {reached or f'> {args.max_rounds}'} "
            f"| {result.final_accuracy:.4f} | {seconds:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
