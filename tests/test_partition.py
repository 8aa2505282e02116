"""Partitioners: every example exactly once, deterministic, skew that follows alpha."""

from __future__ import annotations

import numpy as np
import pytest

from fedtrain.errors import ConfigError
from fedtrain.partition import PARTITIONERS, partition

LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 10 balanced classes


@pytest.mark.parametrize("kind", PARTITIONERS)
@pytest.mark.parametrize("num_clients", [1, 7, 20])
def test_every_example_exactly_once_and_deterministic(kind, num_clients):
    parts = partition(kind, LABELS, num_clients, seed=3, alpha=0.5, labels_per_client=2)
    assert len(parts) == num_clients
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(LABELS)))
    assert all(len(p) > 0 for p in parts)
    again = partition(kind, LABELS, num_clients, seed=3, alpha=0.5, labels_per_client=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def label_skew(parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each client's label mix and the global one."""
    global_mix = np.bincount(LABELS, minlength=10) / len(LABELS)
    tv = [
        0.5 * np.abs(np.bincount(LABELS[p], minlength=10) / len(p) - global_mix).sum()
        for p in parts
    ]
    return float(np.mean(tv))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    skews = [
        np.mean([label_skew(partition("dirichlet", LABELS, 10, seed=s, alpha=a)) for s in range(5)])
        for a in (100.0, 1.0, 0.1)
    ]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.1 and skews[2] > 0.5


def test_iid_is_balanced_and_shards_hold_few_labels():
    assert label_skew(partition("iid", LABELS, 10, seed=0)) < 0.2  # sampling noise only
    shards = partition("shards", LABELS, 20, seed=0, labels_per_client=2)
    assert max(len(np.unique(LABELS[p])) for p in shards) <= 2


def test_seed_changes_the_split():
    a = partition("dirichlet", LABELS, 5, seed=0)
    b = partition("dirichlet", LABELS, 5, seed=1)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "zipf"}, "partition.kind"),
        ({"kind": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"kind": "iid", "num_clients": 2000}, "cannot be split"),
        ({"kind": "shards", "labels_per_client": 0}, "labels_per_client"),
    ],
)
def test_bad_partition_config_is_refused(kwargs, message):
    args = {"kind": "iid", "num_clients": 5, **kwargs}
    with pytest.raises(ConfigError, match=message):
        partition(args.pop("kind"), LABELS, args.pop("num_clients"), seed=0, **args)
