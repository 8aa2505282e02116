"""ServerApp: FedAvg over the sampled clients, each round's end stamped by the timed
FedAvg of fedtrain's deployment peer app (copied beside this package by the harness)."""

from __future__ import annotations

from pathlib import Path

from flowerpeer_app.server_app import TimedFedAvg
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flowersim_app.workload import initial_weights

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_clients = int(cfg["num-clients"])
    per_round = int(cfg["clients-per-round"])
    strategy = TimedFedAvg(
        results_path=Path(str(cfg["results-path"])),
        fraction_train=per_round / num_clients,
        fraction_evaluate=0.0,  # train-only rounds, as on fedtrain's side
        min_train_nodes=per_round,
        min_available_nodes=num_clients,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([initial_weights(cfg)]),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout"]),
    )
    ok = len(strategy.t_aggregate) == int(cfg["num-server-rounds"]) and not any(strategy.failures)
    strategy.dump(done=True, ok=ok)
