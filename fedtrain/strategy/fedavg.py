"""FedAvg (McMahan et al. 2017): the example-weighted mean of the sites' deltas."""

from __future__ import annotations

from fedtrain.strategy.aggregate import WeightedSum, apply_mean_delta
from fedtrain.strategy.base import Strategy
from fedtrain.tensors import ModelState


class FedAvg(Strategy):
    """new global = global + sum_i n_i * delta_i / sum_i n_i.

    Streaming: memory is one accumulator per tensor whatever the number of sites,
    and only the sum is needed, so it runs under secure aggregation.
    """

    name = "fedavg"

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: WeightedSum
    ) -> ModelState:
        return apply_mean_delta(global_state, aggregate.mean(in_place=True), consume=True)
