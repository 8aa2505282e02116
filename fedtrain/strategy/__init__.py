"""Server algorithms. Each one is a file; `build_strategy` maps config names to them."""

from __future__ import annotations

from typing import Any

from fedtrain.errors import ConfigError
from fedtrain.strategy.aggregate import WeightedSum, compute_delta, validate_update
from fedtrain.strategy.base import RoundConfig, Scalar, Strategy, weighted_metrics
from fedtrain.strategy.dpfedavg import DPFedAvg
from fedtrain.strategy.fedavg import FedAvg
from fedtrain.strategy.fedbuff import FedBuff, StalenessBuffer, StaleUpdate
from fedtrain.strategy.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from fedtrain.strategy.fedprox import FedProx
from fedtrain.strategy.robust import FedMedian, FedTrimmedAvg, Krum

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        DPFedAvg,
        FedProx,
        FedAvgM,
        FedAdagrad,
        FedAdam,
        FedYogi,
        FedBuff,
        FedMedian,
        FedTrimmedAvg,
        Krum,
    )
}


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
    "DPFedAvg",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedBuff",
    "FedMedian",
    "FedProx",
    "FedTrimmedAvg",
    "FedYogi",
    "Krum",
    "RoundConfig",
    "Scalar",
    "StaleUpdate",
    "StalenessBuffer",
    "Strategy",
    "WeightedSum",
    "build_strategy",
    "compute_delta",
    "validate_update",
    "weighted_metrics",
]
