"""One round's plan: who was chosen, who drops out, and which worker trains whom.

The assignment of clients to workers is fixed (client index modulo the number of
workers), for two reasons: a worker's partial sum then covers the same clients
whatever the machine's timing, which keeps results bit-exact across backends; and
a client always lands on the same worker, which is where its state (for stateful
tasks) lives, so that state never travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.population import ClientPopulation
from fedtrain.strategy import RoundConfig, Strategy

ClientWork = tuple[str, RoundConfig]


@dataclass(frozen=True)
class RoundPlan:
    """What a round asks of the workers, decided entirely in the driver."""

    server_round: int
    selected: tuple[str, ...]  # the strategy's choice, in client order
    dropped: tuple[str, ...]  # selected clients that never report
    shares: tuple[tuple[ClientWork, ...], ...]  # per worker, in client order
    fold_in_workers: bool  # workers return one partial sum instead of each update
    #: The clients evaluate `global_state` on their held-out data instead of training:
    #: each `ClientResult` then carries the evaluation (`num_examples`, metrics with
    #: `loss`), or `rejected` when the client holds no held-out examples.
    evaluate: bool = False

    @property
    def training(self) -> tuple[str, ...]:
        """The clients that train this round, in client order (the fold order)."""
        dropped = set(self.dropped)
        return tuple(c for c in self.selected if c not in dropped)


def plan_round(
    server_round: int,
    strategy: Strategy,
    population: ClientPopulation,
    heterogeneity: Heterogeneity,
    rng: np.random.Generator,
    num_workers: int,
    fold_in_workers: bool,
) -> RoundPlan:
    """Sample the round's clients (strategy), apply heterogeneity, assign to workers."""
    chosen = strategy.configure_round(server_round, population.ids, rng)
    selected = sorted(chosen)
    dropped = heterogeneity.dropouts(server_round, selected)
    shares: list[list[ClientWork]] = [[] for _ in range(num_workers)]
    for client_id in selected:
        if client_id in dropped:
            continue
        index = population.index(client_id)
        config = heterogeneity.client_config(index, chosen[client_id])
        shares[index % num_workers].append((client_id, config))
    return RoundPlan(
        server_round,
        tuple(selected),
        tuple(sorted(dropped)),
        tuple(tuple(share) for share in shares),
        fold_in_workers,
    )
