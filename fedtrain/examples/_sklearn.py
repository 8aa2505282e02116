"""A deterministic stratified train/test split of a scikit-learn bundled dataset."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset


def split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset]:
    """Stratified split into float32 features / int64 labels, same for every process."""
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )

    def as_dataset(features: np.ndarray, labels: np.ndarray) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(features, dtype=torch.float32),
            torch.as_tensor(labels, dtype=torch.int64),
        )

    return as_dataset(x_tr, y_tr), as_dataset(x_te, y_te)
