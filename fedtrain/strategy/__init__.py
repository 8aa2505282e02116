"""Server algorithms. Each one is a file; `build_strategy` maps config names to them.

A config names a built-in strategy (`name = "fedadam"`) or a user's own `Strategy`
subclass by import reference (`name = "mylab.strategies:WarmupCosineFedAvgM"`), which
must be importable wherever the server (or the simulation) runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from fedtrain.errors import ConfigError
from fedtrain.references import import_reference
from fedtrain.strategy.aggregate import WeightedSum, compute_delta, validate_update
from fedtrain.strategy.base import RoundConfig, Scalar, Strategy, weighted_metrics
from fedtrain.strategy.dpfedavg import DPFedAvg
from fedtrain.strategy.fedavg import FedAvg
from fedtrain.strategy.fedbuff import FedBuff, StalenessBuffer, StaleUpdate
from fedtrain.strategy.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from fedtrain.strategy.fedprox import FedProx
from fedtrain.strategy.robust import FedMedian, FedTrimmedAvg, Krum
from fedtrain.strategy.schedule import Schedule

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


def strategy_class(name: str) -> type[Strategy]:
    """The class `strategy.name` names: built in, or 'package.module:ClassName'."""
    if ":" not in name:
        try:
            return STRATEGIES[name]
        except KeyError:
            raise ConfigError(
                f"strategy.name = {name!r} is unknown; choose one of {sorted(STRATEGIES)}, "
                "or name your own Strategy subclass as 'package.module:ClassName'"
            ) from None
    cls = import_reference(name, "strategy.name", "ClassName")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(
            f"strategy.name = {name!r} is {_describe(cls)}, not a subclass of "
            "fedtrain.strategy.Strategy; subclass Strategy (or FedAvg) and name that class"
        )
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise ConfigError(
            f"strategy.name = {name!r} is abstract: define {', '.join(missing)} "
            "(see the README's 'Your own strategy')"
        )
    return cls


def _describe(obj: object) -> str:
    kind = "class" if isinstance(obj, type) else type(obj).__name__
    return f"the {kind} {getattr(obj, '__qualname__', repr(obj))}"


def build_strategy(name: str, **options: Any) -> Strategy:
    """The strategy a config names, with its options; a clear error naming what is wrong."""
    cls = strategy_class(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"strategy {name!r}: {exc} (check [strategy.options])") from None


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
    "Schedule",
    "StaleUpdate",
    "StalenessBuffer",
    "Strategy",
    "WeightedSum",
    "build_strategy",
    "compute_delta",
    "strategy_class",
    "validate_update",
    "weighted_metrics",
]
