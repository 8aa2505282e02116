"""flowerdigits: the model, the data of one partition, and the train/test loops."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 8x8 grey digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Partition `partition_id` of an IID split of the digits: 80% train, 20% validation."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = np.random.default_rng(42).permutation(len(y))
    part = torch.from_numpy(np.array_split(order, num_partitions)[partition_id])
    cut = int(0.8 * len(part))
    train, val = part[:cut], part[cut:]
    trainloader = DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True)
    valloader = DataLoader(TensorDataset(x[val], y[val]), batch_size=batch_size)
    return trainloader, valloader


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device) -> float:
    """Train with SGD; the mean training loss over all batches."""
    net.to(device).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
    return total / max(batches, 1)


def test(net: nn.Module, testloader: DataLoader, device) -> tuple[float, float]:
    """(mean loss, accuracy) on the validation set."""
    net.to(device).eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
            seen += len(labels)
    return loss / seen, correct / seen
