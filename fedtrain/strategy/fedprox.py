"""FedProx (Li et al. 2020): FedAvg on the server, a proximal term at the sites.

Sites minimise loss + mu/2 * ||w - w_global||^2, which keeps heterogeneous sites from
drifting far from the global model. The server side is FedAvg; it only sends
`proximal_mu` in every round config, and `TorchTask` adds the term when it is > 0.
"""

from __future__ import annotations

from typing import Any

from fedtrain.errors import ConfigError
from fedtrain.strategy.base import RoundConfig
from fedtrain.strategy.fedavg import FedAvg


class FedProx(FedAvg):
    name = "fedprox"

    def __init__(self, *, proximal_mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if proximal_mu < 0:
            raise ConfigError(f"strategy.proximal_mu must be >= 0, got {proximal_mu}")
        self.proximal_mu = proximal_mu

    def round_config(
        self, server_round: int, client_id: str, base_config: RoundConfig
    ) -> RoundConfig:
        return {**base_config, "proximal_mu": self.proximal_mu}
