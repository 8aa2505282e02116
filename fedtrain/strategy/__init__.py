"""Server algorithms. Each one is a file; `build_strategy` maps config names to them."""

from __future__ import annotations

from typing import Any

from fedtrain.errors import ConfigError
from fedtrain.strategy.aggregate import WeightedSum, compute_delta, validate_update
from fedtrain.strategy.base import RoundConfig, Scalar, Strategy, weighted_metrics
from fedtrain.strategy.fedavg import FedAvg

STRATEGIES: dict[str, type[Strategy]] = {FedAvg.name: FedAvg}


def build_strategy(name: str, **options: Any) -> Strategy:
    """The strategy a config names, with its options; a clear error for unknown names."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"strategy.name = {name!r} is unknown; choose one of {sorted(STRATEGIES)}"
        ) from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"strategy {name!r}: {exc}") from None


__all__ = [
    "STRATEGIES",
    "FedAvg",
    "RoundConfig",
    "Scalar",
    "Strategy",
    "WeightedSum",
    "build_strategy",
    "compute_delta",
    "validate_update",
    "weighted_metrics",
]
