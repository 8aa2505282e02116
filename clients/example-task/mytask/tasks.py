"""A tabular classifier whose data comes from site.toml (`[data] source = "parquet"`).

The task is only the model and the training loop (TorchTask's); every site reads its
own files, so `datasets()` is empty: the server, which has no data, evaluates
nothing and the sites report their held-out metrics (`data.eval_fraction`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.task import TorchTask


class MyTask(TorchTask):
    version = "1.0"  # bump with the model: it is part of the fingerprint sites must share

    def __init__(self, features: int = 30, classes: int = 2, hidden: int = 64) -> None:
        self.features, self.classes, self.hidden = features, classes, hidden

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.classes)
        )

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        return TensorDataset(torch.empty(0, self.features), torch.empty(0, dtype=torch.long)), None
