"""Logistic regression on scikit-learn's breast-cancer set: a tabular, hospital-like task."""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset

from fedtrain.examples._sklearn import split
from fedtrain.task import TorchTask


class BreastCancerTask(TorchTask):
    """569 tumours, 30 features, benign/malignant; 25% held out (stratified, fixed seed).

    Features are standardised with statistics of the whole set. In a real federation
    each site would standardise with agreed constants; here the constants are simply
    the published set's, which every site can compute identically.
    """

    def __init__(self, test_fraction: float = 0.25, split_seed: int = 0) -> None:
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def model(self) -> nn.Module:
        return nn.Linear(30, 2)  # two logits + cross-entropy == logistic regression

    def datasets(self) -> tuple[Dataset, Dataset]:
        from sklearn.datasets import load_breast_cancer

        data = load_breast_cancer()
        x = (data.data - data.data.mean(axis=0)) / data.data.std(axis=0)
        return split(x, data.target, self.test_fraction, self.split_seed)
