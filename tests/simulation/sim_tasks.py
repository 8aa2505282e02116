"""Tasks (and a strategy) with test-only behaviour, importable by worker processes
(see conftest.py)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from fedtrain.examples.synthetic import SyntheticTask
from fedtrain.strategy import FedAvg, RoundConfig
from fedtrain.task import TaskContext, TrainResult


class FailingTask(SyntheticTask):
    """Raises while training client `fail_on` (in round `fail_round`)."""

    def __init__(self, fail_on: str, fail_round: int = 1, **options) -> None:
        super().__init__(**options)
        self.fail_on = fail_on
        self.fail_round = fail_round

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        if context.client_id == self.fail_on and config["round"] == self.fail_round:
            raise RuntimeError(f"boom at {context.client_id}")
        return super().train(model, data, config, context)


class SlowTask(SyntheticTask):
    """Sleeps `seconds` per client, so a round lasts long enough to interrupt."""

    def __init__(self, seconds: float = 0.05, **options) -> None:
        super().__init__(**options)
        self.seconds = seconds

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        time.sleep(self.seconds)
        return super().train(model, data, config, context)


class CountingTask(SyntheticTask):
    """Stateful: each client counts its own rounds in `context.client_state`, and only
    even-numbered clients keep state (so the store must hold just those)."""

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        state = context.client_state
        assert state is not None
        count = state.get("count", torch.zeros((), dtype=torch.int64)) + 1
        if int(context.client_id.rsplit("-", 1)[1]) % 2 == 0:
            state["count"] = count
            state["trace"] = torch.full((3,), float(config["round"]))
        result = super().train(model, data, config, context)
        return TrainResult(result.num_examples, {**result.metrics, "count": float(count)})


class NanTask(SyntheticTask):
    """Every update holds NaN (a diverged client), so the server must reject them all."""

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        result = super().train(model, data, config, context)
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
        return result


class MedianEvalFedAvg(FedAvg):
    """FedAvg whose federated evaluation reports the median client's figures instead
    of the example-weighted mean (a user's `aggregate_evaluate`)."""

    def aggregate_evaluate(self, server_round, results):
        keys = results[0][1].keys()
        return {k: float(np.median([m[k] for _, m in results])) for k in keys}
