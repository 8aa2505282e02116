"""A small CNN on scikit-learn's handwritten digits (8x8 grey images, 10 classes)."""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset

from fedtrain.examples._sklearn import split
from fedtrain.task import TorchTask


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two dense layers: ~40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x):
        return self.head(self.features(x))


class DigitsTask(TorchTask):
    """1,797 digits, 20% held out (stratified, fixed seed); pixels scaled to [0, 1]."""

    def __init__(self, test_fraction: float = 0.2, split_seed: int = 0) -> None:
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def model(self) -> nn.Module:
        return DigitsCNN()

    def datasets(self) -> tuple[Dataset, Dataset]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.images / 16.0).reshape(-1, 1, 8, 8)
        return split(x, digits.target, self.test_fraction, self.split_seed)
