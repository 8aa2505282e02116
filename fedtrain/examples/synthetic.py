"""Logistic regression on generated data: a task of any size that needs no download.

Scale tests and benchmarks need thousands of clients with a model so small that the
framework's own overhead, not arithmetic, is what gets measured. The data is drawn
from a fixed random linear model with numpy under `data_seed`, so every process
(simulation workers, a Flower peer's ClientApps) builds byte-identical datasets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.errors import ConfigError
from fedtrain.task import TorchTask


def make_classification(
    num_examples: int, num_features: int, num_classes: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Features ~ N(0, 1); labels = argmax of a seeded linear map plus Gumbel noise.

    Gumbel noise on the logits makes labels a softmax sample, so logistic regression
    is the right model and `noise` sets how far from separable the data is.
    """
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((num_features, num_classes))
    x = rng.standard_normal((num_examples, num_features)).astype(np.float32)
    logits = x @ weights + noise * rng.gumbel(size=(num_examples, num_classes))
    return x, logits.argmax(axis=1).astype(np.int64)


class SyntheticTask(TorchTask):
    """`num_features` inputs, `num_classes` logits (cross-entropy == logistic regression).

    Train and test sets come from the same generator (one draw, split), so held-out
    accuracy is meaningful. Size the train set to the federation: e.g. 1,000 clients
    with 20 examples each is `num_train = 20_000` with an `iid` partition.
    """

    def __init__(
        self,
        num_train: int = 10_000,
        num_test: int = 2_000,
        num_features: int = 20,
        num_classes: int = 2,
        noise: float = 0.5,
        data_seed: int = 0,
    ) -> None:
        if min(num_train, num_features) < 1 or num_test < 0 or num_classes < 2:
            raise ConfigError(
                "SyntheticTask needs num_train >= 1, num_test >= 0, num_features >= 1 and "
                f"num_classes >= 2, got {num_train}, {num_test}, {num_features}, {num_classes}"
            )
        self.num_train = num_train
        self.num_test = num_test
        self.num_features = num_features
        self.num_classes = num_classes
        self.noise = noise
        self.data_seed = data_seed

    def model(self) -> nn.Module:
        return nn.Linear(self.num_features, self.num_classes)

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        x, y = make_classification(
            self.num_train + self.num_test,
            self.num_features,
            self.num_classes,
            self.noise,
            self.data_seed,
        )
        xs, ys = torch.from_numpy(x), torch.from_numpy(y)
        train = TensorDataset(xs[: self.num_train], ys[: self.num_train])
        if self.num_test == 0:
            return train, None
        return train, TensorDataset(xs[self.num_train :], ys[self.num_train :])


class FrozenBaseTask(SyntheticTask):
    """SyntheticTask behind a frozen random feature layer: the smallest task whose
    model is partly federated (`federated = "trainable"`).

    The feature layer is the "base": drawn from `base_seed` (not the torch seed), so
    every process that builds it with the same `base_seed` holds the same bits, it
    never trains and never travels; only the head does. A site built with another
    `base_seed` holds another base, and the fingerprint tells them apart.
    """

    federated = "trainable"

    def __init__(self, base_seed: int = 0, hidden: int = 32, **options: Any) -> None:
        super().__init__(**options)
        self.base_seed = base_seed
        self.hidden = hidden

    def model(self) -> nn.Module:
        base = nn.Linear(self.num_features, self.hidden)
        gen = torch.Generator().manual_seed(self.base_seed)
        with torch.no_grad():
            base.weight.copy_(
                torch.randn(base.weight.shape, generator=gen) / self.num_features**0.5
            )
            base.bias.copy_(torch.randn(base.bias.shape, generator=gen))
        base.requires_grad_(False)
        return nn.Sequential(base, nn.ReLU(), nn.Linear(self.hidden, self.num_classes))
