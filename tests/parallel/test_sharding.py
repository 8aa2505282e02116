"""Rank-aware sharding in iterate_batches: DistributedSampler(drop_last=False) semantics."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from fedtrain.errors import ConfigError
from fedtrain.task import TaskContext, iterate_batches


def labels(data: Dataset, batch: int, rank: int, world: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    batches = iterate_batches(data, batch, shuffle=True, generator=gen, rank=rank, world_size=world)
    return [y.tolist() for _, y in batches]


@pytest.mark.parametrize("n", [1, 2, 23, 24])
def test_rank_batches_together_are_the_padded_permutation_in_blocks(n):
    data = TensorDataset(torch.zeros(n, 1), torch.arange(n))
    b, world = 4, 2
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7))
    padded = torch.cat([perm, perm.repeat(world)[: -n % world]]).tolist()
    shards = [labels(data, b, r, world) for r in range(world)]
    assert len(shards[0]) == len(shards[1])  # DDP needs the same number of steps
    for k, (a, c) in enumerate(zip(*shards, strict=True)):
        assert len(a) == len(c)  # equal per-rank batches: DDP's mean == big-batch mean
        assert sorted(a + c) == sorted(padded[k * b * world : (k + 1) * b * world])
    # every example is seen; only the padding repeats some
    assert sorted(i for batch in shards[0] + shards[1] for i in batch) == sorted(padded)


def test_sharding_is_the_same_through_the_dataloader_path():
    base = TensorDataset(torch.zeros(30, 1), torch.arange(30))

    class Plain(Dataset):  # not a TensorDataset: goes through a DataLoader
        def __len__(self):
            return 25

        def __getitem__(self, i):
            return base[i + 5]

    fast = Subset(base, list(range(5, 30)))
    for rank in range(3):
        assert labels(Plain(), 4, rank, 3) == labels(fast, 4, rank, 3)


def test_world_of_one_is_unchanged_and_bad_ranks_are_refused():
    data = TensorDataset(torch.zeros(10, 1), torch.arange(10))
    assert labels(data, 3, 0, 1) == [
        y.tolist()
        for _, y in iterate_batches(
            data, 3, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
    ]
    with pytest.raises(ConfigError, match="rank 2 is outside a group of 2"):
        labels(data, 3, 2, 2)
    with pytest.raises(ConfigError, match="rank 1 is outside a group of 1"):
        TaskContext(rank=1)
