"""ServerApp: FedAvg over one flat float32 tensor, recording per-round wall times.

The per-round timestamps are written by the ServerApp itself (which runs in a
process spawned by the SuperLink's SuperExec), because only it knows when each
round's aggregate is done; the harness reads them from ``results-path``. The file is
rewritten after every round so a run that times out still yields partial figures.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


class TimedFedAvg(FedAvg):
    """FedAvg that stamps the wall clock when sampling ends and when each round aggregates.

    Round 1 starts once ``configure_train`` has sampled enough nodes, so time spent
    waiting for SuperNodes to register is not counted as a round.
    """

    def __init__(self, results_path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.results_path = results_path
        self.t_start: float | None = None
        self.t_aggregate: list[float] = []
        self.failures: list[int] = []
        self.results: list[int] = []  # replies aggregated per round (a timeout drops some)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Stamp the start of round 1 right after node sampling."""
        messages = super().configure_train(server_round, arrays, config, grid)
        if self.t_start is None:
            self.t_start = time.time()
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate as FedAvg does, then stamp and persist the round's end time."""
        replies = list(replies)
        self.failures.append(sum(1 for msg in replies if msg.has_error()))
        self.results.append(sum(1 for msg in replies if not msg.has_error()))
        result = super().aggregate_train(server_round, replies)
        self.t_aggregate.append(time.time())
        self.dump(done=False, ok=result[0] is not None)
        return result

    def dump(self, *, done: bool, ok: bool, checksum: float | None = None) -> None:
        """Atomically (re)write the timing JSON for the harness to read."""
        stamps = [self.t_start or 0.0, *self.t_aggregate]
        payload = {
            "pid": os.getpid(),
            "t_start": self.t_start,
            "t_aggregate": self.t_aggregate,
            "s_per_round": [b - a for a, b in itertools.pairwise(stamps)],
            "failures_per_round": self.failures,
            "results_per_round": self.results,
            "ok": ok,
            "done": done,
            "checksum": checksum,
        }
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(self.results_path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` of FedAvg over ``num-sites`` nodes, no evaluation."""
    cfg = context.run_config
    num_params = int(cfg["num-params"])
    num_sites = int(cfg["num-sites"])
    results_path = Path(str(cfg["results-path"]))
    strategy = TimedFedAvg(
        results_path=results_path,
        fraction_train=1.0,
        fraction_evaluate=0.0,  # train-only rounds: the comparison is one FedAvg step
        min_train_nodes=num_sites,
        min_available_nodes=num_sites,
    )
    if bool(cfg["incompressible"]):
        # seeded random values: no two 5 MiB chunks alike, as with a real model
        values = np.random.default_rng(0).standard_normal(num_params, dtype=np.float32)
    else:
        values = np.zeros(num_params, dtype=np.float32)
    initial = ArrayRecord([values], keep_input=False)
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout"]),
    )
    ok = len(strategy.t_aggregate) == int(cfg["num-server-rounds"]) and not any(strategy.failures)
    checksum = None
    if result.arrays is not None:
        (final,) = result.arrays.to_numpy_ndarrays()
        # Every client adds delta each round, so the mean is rounds * delta.
        checksum = float(final[: min(1024, final.size)].mean())
    strategy.dump(done=True, ok=ok, checksum=checksum)
