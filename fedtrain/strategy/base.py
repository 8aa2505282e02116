"""The server-side algorithm interface, shared by the runtime and the simulation.

A strategy decides who trains each round and with what config, hands out a
streaming aggregator, and turns the aggregate into the next global model. It never
sees sockets or processes: the drivers feed it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedtrain.errors import ConfigError
from fedtrain.strategy.aggregate import Aggregator, WeightedSum
from fedtrain.tensors import ModelState

Scalar = bool | int | float | str
RoundConfig = dict[str, Scalar]


def weighted_metrics(results: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Example-weighted mean of each metric over the sites that reported it."""
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for n, metrics in results:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + n * float(value)
            weights[key] = weights.get(key, 0) + n
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


class Strategy(ABC):
    """One federated algorithm. Subclasses override what differs from FedAvg's shape."""

    name: ClassVar[str]
    #: Whether the algorithm only needs the (weighted) sum of updates, so it can run
    #: under secure aggregation. Median/Krum-style strategies set this False. When it
    #: is True, `begin_round` must return a `WeightedSum`, and drivers may pre-fold
    #: updates elsewhere into partial `WeightedSum`s (simulation workers do) and
    #: `merge` those into it: the strategy sees the same sum either way.
    needs_only_sum: ClassVar[bool] = True
    #: Whether updates are folded as they arrive, each against the model version its
    #: client trained from, instead of in synchronous rounds (FedBuff). Drivers run
    #: such strategies on their asynchronous loop; secure aggregation refuses them.
    asynchronous: ClassVar[bool] = False

    def __init__(
        self,
        *,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 2,
        min_available_clients: int = 2,
        client_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        if not 0.0 < fraction_fit <= 1.0:
            raise ConfigError(f"strategy.fraction_fit must be in (0, 1], got {fraction_fit}")
        if min_fit_clients < 1:
            raise ConfigError(f"strategy.min_fit_clients must be >= 1, got {min_fit_clients}")
        if min_available_clients < min_fit_clients:
            raise ConfigError(
                f"strategy.min_available_clients ({min_available_clients}) must be >= "
                f"min_fit_clients ({min_fit_clients})"
            )
        self.fraction_fit = fraction_fit
        self.min_fit_clients = min_fit_clients
        self.min_available_clients = min_available_clients
        self.client_config: RoundConfig = dict(client_config or {})

    # -- round planning ---------------------------------------------------------------
    def num_to_sample(self, num_available: int) -> int:
        """How many of the available clients train this round (0: not enough yet)."""
        if num_available < self.min_available_clients:
            return 0
        wanted = max(self.min_fit_clients, math.ceil(self.fraction_fit * num_available))
        return min(wanted, num_available)

    def configure_round(
        self, server_round: int, available: Sequence[str], rng: np.random.Generator
    ) -> dict[str, RoundConfig]:
        """Choose this round's participants (seeded) and the config each receives."""
        k = self.num_to_sample(len(available))
        if k == 0:
            return {}
        ids = sorted(available)
        chosen = sorted(rng.choice(len(ids), size=k, replace=False).tolist())
        return {ids[i]: self.round_config(server_round, ids[i]) for i in chosen}

    def round_config(self, server_round: int, client_id: str) -> RoundConfig:
        """The config a chosen client trains with (hook for per-client configs)."""
        return {**self.client_config, "round": server_round}

    def min_results(self, num_selected: int) -> int:
        """Updates needed for a round to count (the rest may drop out)."""
        return min(self.min_fit_clients, num_selected)

    # -- aggregation ------------------------------------------------------------------
    def begin_round(self, server_round: int, global_state: ModelState) -> Aggregator:
        """A fresh streaming aggregator for this round's updates."""
        return WeightedSum(global_state.specs)

    @abstractmethod
    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        """The next global model from the round's aggregate."""

    def round_metrics(self) -> dict[str, float]:
        """Strategy facts about the round just finalized (e.g. epsilon), for metrics.jsonl."""
        return {}

    def aggregate_metrics(
        self, results: Sequence[tuple[int, Mapping[str, float]]]
    ) -> dict[str, float]:
        return weighted_metrics(results)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy must remember across a server restart."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ConfigError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")
