"""A fedtrain Task whose model is one flat float32 tensor and whose "training" is an add.

Used by ``benchmarks/runtime_vs_flower.py`` to measure the deployment runtime's own
overhead (transport, serialization, validation, aggregation, checkpointing) against
Flower's deployment engine. Flower's peer app (``benchmarks/flower_peer/app``) starts
from a zero vector of P float32 values and each client adds ``delta = 0.001`` to it
and reports 100 examples; this task does exactly the same, so compute is equal on
both sides and anything else in a round's time is the runtime's cost.

With ``incompressible=True`` (the WAN benchmark) the initial model is seeded random
normal values and each site adds a slightly different delta: a transport that
deduplicates identical chunks (Flower 1.42 content-addresses its array chunks, so a
constant 40 MB array travels as one chunk) or compresses them then moves every byte,
as it would with a real model. Flower's peer app has the same switch.

It must be importable by the server and site *processes*: the benchmark puts the
repository root on their ``PYTHONPATH`` and names it ``benchmarks.flat_task:FlatTask``.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.strategy.base import RoundConfig
from fedtrain.task import EvalResult, Task, TaskContext, TrainResult

__all__ = ["DELTA", "NUM_EXAMPLES", "FlatModel", "FlatTask", "site_delta"]

DELTA = 0.001
"""What each site adds to every parameter per round (the Flower ClientApp's ``delta``)."""

NUM_EXAMPLES = 100
"""Examples in the (dummy) training set: Flower's ``num-examples``, so weights match."""


class FlatModel(nn.Module):
    """One float32 parameter vector of ``num_params`` zeros, like Flower's initial array."""

    def __init__(self, num_params: int, incompressible: bool = False) -> None:
        super().__init__()
        # zeros, not randn, by default: no RNG pass over hundreds of MB at start-up,
        # and it is what Flower's ServerApp starts from.
        if incompressible:
            generator = torch.Generator().manual_seed(0)
            weights = torch.randn(num_params, generator=generator, dtype=torch.float32)
        else:
            weights = torch.zeros(num_params, dtype=torch.float32)
        self.weights = nn.Parameter(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Never used for learning; defined because every nn.Module needs one."""
        return x * self.weights[:1]


def site_delta(site: str) -> float:
    """A delta of about ``DELTA`` that differs per site, so no two updates are equal."""
    return DELTA * (1.0 + (zlib.crc32(site.encode()) % 64) / 64)


class FlatTask(Task):
    """The benchmark task; ``num_params`` comes from ``task_options`` in server/site.toml."""

    def __init__(self, num_params: int = 1_000_000, incompressible: bool = False) -> None:
        if num_params < 1:
            raise ValueError(f"num_params must be >= 1, got {num_params}")
        self.num_params = int(num_params)
        self.incompressible = bool(incompressible)

    def model(self) -> nn.Module:
        """A fresh vector of ``num_params`` float32 values (zeros unless incompressible)."""
        return FlatModel(self.num_params, self.incompressible)

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
        delta = site_delta(context.client_id) if self.incompressible else DELTA
        with torch.no_grad():
            for param in model.parameters():
                param.add_(delta)
        return TrainResult(NUM_EXAMPLES)

    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        """Nothing to evaluate (there is no test set); present because Task requires it."""
        return EvalResult(num_examples=0, loss=0.0)
