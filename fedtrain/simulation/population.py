"""The virtual clients of a simulation: their ids and their share of the training set.

Each worker process rebuilds the population from the task and the config instead of
receiving it: the partition is a pure function of the seed, so recomputing it is
cheaper than pickling datasets and gives every process the same clients. The shares
are held as one index array with offsets (not one object per client), so 100,000
registered clients cost a few MB, and a client's `Subset` exists only while it trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset, Subset

from fedtrain.partition import LABEL_PARTITIONERS, partition
from fedtrain.simulation.config import SimConfig
from fedtrain.task import Task


def client_ids(num_clients: int) -> tuple[str, ...]:
    """`client-0007`-style ids, zero-padded so that string order is numeric order."""
    width = len(str(num_clients - 1))
    return tuple(f"client-{i:0{width}d}" for i in range(num_clients))


@dataclass(frozen=True)
class ClientPopulation:
    """Client i holds examples `indices[offsets[i]:offsets[i + 1]]` of the training set."""

    ids: tuple[str, ...]
    indices: np.ndarray
    offsets: np.ndarray

    @classmethod
    def build(cls, task: Task, train: Dataset, config: SimConfig) -> ClientPopulation:
        """Split `train` among `config.num_clients` clients per `config.partition`."""
        kind = config.partition.kind
        labels = (
            task.labels(train).numpy() if kind in LABEL_PARTITIONERS else np.zeros(len(train))  # type: ignore[arg-type]
        )
        parts = partition(
            kind,
            labels,
            config.num_clients,
            seed=config.seed,
            alpha=config.partition.alpha,
            labels_per_client=config.partition.labels_per_client,
        )
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        return cls(client_ids(len(parts)), np.concatenate(parts).astype(np.int64), offsets)

    def __len__(self) -> int:
        return len(self.ids)

    def index(self, client_id: str) -> int:
        """Position of a client (its ids sort numerically, so this is a parse)."""
        return int(client_id.rsplit("-", 1)[1])

    def size(self, client_id: str) -> int:
        i = self.index(client_id)
        return int(self.offsets[i + 1] - self.offsets[i])

    def dataset(self, train: Dataset, client_id: str) -> Subset:
        """The client's examples of `train`, as a Subset made on demand."""
        i = self.index(client_id)
        return Subset(train, self.indices[self.offsets[i] : self.offsets[i + 1]].tolist())
