"""Rounds to reach 90% test accuracy on digits under pathological non-IID data.

    python simulations/strategies.py [--max-rounds 150] [--only fedavg fedbuff]

20 clients, 2 shards each (`shards` partition, McMahan et al.: 1-4 labels, 2 for most),
local training of 2 epochs (SGD lr 0.02, momentum 0.9, batch 16). Each strategy runs
with the settings in STRATEGIES below (server-side hyper-parameters tuned coarsely once, by hand;
a `-suffix` labels another setting of the same strategy).

Synchronous strategies: every client trains every round. FedBuff (asynchronous):
`concurrency` clients train at once and every `buffer_size` arrivals make a model
version; it runs for as many client updates as the synchronous runs get
(max_rounds x 20). Devices differ in speed: each client's slowdown is drawn from
SPEED_RANGE (seeded, log-uniform), and a job takes slowdown x epochs x examples
units of simulated time. A synchronous round lasts as long as its slowest client;
FedBuff's clock is the simulation's own. The table reports, for the first round
(or version) whose global model reaches 90% on the 360 held-out digits: its number,
the client updates used so far, and the simulated time so far; then the final
accuracy and the real wall time of the run.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from fedtrain.config import from_dict
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.population import ClientPopulation
from fedtrain.task import load_task

TARGET = 0.90
NUM_CLIENTS = 20
SPEED_RANGE = [1.0, 10.0]
STRATEGIES: dict[str, dict] = {
    "fedavg": {},
    "fedprox": {"proximal_mu": 0.01},
    "fedadam": {"server_lr": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedavgm": {"server_lr": 1.0, "server_momentum": 0.5},
    "fedbuff": {"buffer_size": 10, "concurrency": 20, "server_lr": 1.0},
    "fedbuff-k4": {"buffer_size": 4, "concurrency": 20, "server_lr": 1.0},
}


def base_config(run_dir: str, rounds: int) -> dict:
    return {
        "task": "fedtrain.examples:DigitsTask",
        "rounds": rounds,
        "num_clients": NUM_CLIENTS,
        "seed": 0,
        "run_dir": run_dir,
        "partition": {"kind": "shards", "labels_per_client": 2},
        "strategy": {"min_fit_clients": NUM_CLIENTS, "min_available_clients": NUM_CLIENTS},
        "heterogeneity": {"speed_range": SPEED_RANGE},
        "client": {"epochs": 2, "batch_size": 16, "lr": 0.02, "momentum": 0.9},
    }


def sync_round_time(config: SimConfig) -> float:
    """Simulated length of a synchronous round where every client trains: its slowest job."""
    task = load_task(config.task, config.task_options)
    population = ClientPopulation.build(task, task.datasets()[0], config)
    hetero = Heterogeneity(config.heterogeneity, len(population), config.seed)
    return max(
        hetero.job_duration(i, population.size(c), config.client)
        for i, c in enumerate(population.ids)
    )


def first_at_target(history: list[dict]) -> dict | None:
    for record in history:
        if record.get("accuracy") is not None and record["accuracy"] >= TARGET:
            return record
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rounds", type=int, default=150)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    args = parser.parse_args()
    print(
        "| strategy | options | rounds to 90% | client updates to 90% | simulated time to 90% "
        "| final accuracy | wall time |"
    )
    print("|---|---|---|---|---|---|---|")
    for label in args.only:
        options = STRATEGIES[label]
        name = label.split("-")[0]
        with tempfile.TemporaryDirectory() as run_dir:
            asynchronous = name == "fedbuff"
            rounds = (
                args.max_rounds * NUM_CLIENTS // options["buffer_size"]
                if asynchronous
                else args.max_rounds
            )
            raw = base_config(run_dir, rounds)
            raw["strategy"] = {**raw["strategy"], "name": name, "options": options}
            config = from_dict(SimConfig, raw)
            start = time.perf_counter()
            result = run_simulation(config)
            seconds = time.perf_counter() - start
        reached = first_at_target(result.history)
        if reached is None:
            cells = [f"> {rounds}", "-", "-"]
        elif asynchronous:
            cells = [f"{reached['round']} versions", reached["client_updates"], reached["sim_time"]]
        else:
            r = reached["round"]
            cells = [r, r * NUM_CLIENTS, r * sync_round_time(config)]
        if isinstance(cells[2], float):
            cells[2] = f"{cells[2]:,.0f}"
        print(
            f"| {label} | {options or '-'} | {cells[0]} | {cells[1]} | {cells[2]} "
            f"| {result.final_accuracy:.4f} | {seconds:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
