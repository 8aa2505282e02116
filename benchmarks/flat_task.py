"""A fedtrain Task whose model is one flat float32 tensor and whose "training" is an add.

Used by ``benchmarks/runtime_vs_flower.py`` to measure the deployment runtime's own
overhead (transport, serialization, validation, aggregation, checkpointing) against
Flower's deployment engine. Flower's peer app (``benchmarks/flower_peer/app``) starts
from a zero vector of P float32 values and each client adds ``delta = 0.001`` to it
and reports 100 examples; this task does exactly the same, so compute is equal on
both sides and anything else in a round's time is the runtime's cost.

It must be importable by the server and site *processes*: the benchmark puts the
repository root on their ``PYTHONPATH`` and names it ``benchmarks.flat_task:FlatTask``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.strategy.base import RoundConfig
from fedtrain.task import EvalResult, Task, TaskContext, TrainResult

__all__ = ["DELTA", "NUM_EXAMPLES", "FlatModel", "FlatTask"]

DELTA = 0.001
"""What each site adds to every parameter per round (the Flower ClientApp's ``delta``)."""

NUM_EXAMPLES = 100
"""Examples in the (dummy) training set: Flower's ``num-examples``, so weights match."""


class FlatModel(nn.Module):
    """One float32 parameter vector of ``num_params`` zeros, like Flower's initial array."""

    def __init__(self, num_params: int) -> None:
        super().__init__()
        # zeros, not randn: no RNG pass over hundreds of MB at start-up, and it is
        # what Flower's ServerApp starts from.
        self.weights = nn.Parameter(torch.zeros(num_params, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Never used for learning; defined because every nn.Module needs one."""
        return x * self.weights[:1]


class FlatTask(Task):
    """The benchmark task; ``num_params`` comes from ``task_options`` in server/site.toml."""

    def __init__(self, num_params: int = 1_000_000) -> None:
        if num_params < 1:
            raise ValueError(f"num_params must be >= 1, got {num_params}")
        self.num_params = int(num_params)

    def model(self) -> nn.Module:
        """A fresh zero vector of ``num_params`` float32 values."""
        return FlatModel(self.num_params)

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        """A tiny training set (sites need something to partition) and no test set.

        No test set means the server skips evaluation, as Flower's peer runs with
        ``fraction_evaluate = 0``.
        """
        x = torch.zeros(NUM_EXAMPLES, 1)
        y = torch.zeros(NUM_EXAMPLES, dtype=torch.long)
        return TensorDataset(x, y), None

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        """Add ``DELTA`` to every parameter in place: one float32 pass, like Flower's client.

        Reports ``NUM_EXAMPLES`` whatever this site's partition holds, as Flower's
        ClientApp reports its fixed ``num-examples``.
        """
        with torch.no_grad():
            for param in model.parameters():
                param.add_(DELTA)
        return TrainResult(NUM_EXAMPLES)

    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        """Nothing to evaluate (there is no test set); present because Task requires it."""
        return EvalResult(num_examples=0, loss=0.0)
