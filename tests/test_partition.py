"""Partitioners: every example exactly once, deterministic, skew that follows alpha."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrain.errors import ConfigError
from fedtrain.partition import PARTITIONERS, exact_labels, partition, shards

LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 10 balanced classes


@pytest.mark.parametrize("kind", PARTITIONERS)
@pytest.mark.parametrize("num_clients", [1, 7, 20])
def test_every_example_exactly_once_and_deterministic(kind, num_clients):
    k = 10 if num_clients == 1 else 2  # one client must hold all 10 labels to cover them
    parts = partition(kind, LABELS, num_clients, seed=3, alpha=0.5, labels_per_client=k)
    assert len(parts) == num_clients
    assert_covers_once(parts, len(LABELS))
    assert all(len(p) > 0 for p in parts)
    again = partition(kind, LABELS, num_clients, seed=3, alpha=0.5, labels_per_client=k)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def assert_covers_once(parts: list[np.ndarray], n: int) -> None:
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))


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
    parts = partition("shards", LABELS, 20, seed=0, labels_per_client=2)
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 2  # shards align with labels here


def test_shards_on_the_digits_give_up_to_twice_k_labels_and_labels_gives_exactly_k():
    from sklearn.datasets import load_digits

    y = load_digits().target  # 1,797 digits, uneven classes: shards straddle labels
    held = [len(np.unique(y[p])) for p in partition("shards", y, 10, seed=0, labels_per_client=2)]
    assert min(held) >= 1 and max(held) <= 4 and max(held) > 2  # McMahan's sort-and-shard
    exact = partition("labels", y, 10, seed=0, labels_per_client=2)
    assert [len(np.unique(y[p])) for p in exact] == [2] * 10


label_arrays = st.lists(st.integers(0, 11), min_size=1, max_size=400).map(np.array)


@settings(max_examples=150, deadline=None)
@given(y=label_arrays, num_clients=st.integers(1, 30), k=st.integers(1, 6), seed=st.integers(0, 9))
def test_labels_gives_every_client_exactly_k_labels_or_refuses(y, num_clients, k, seed):
    classes, counts = np.unique(y, return_counts=True)
    holders = num_clients * k / len(classes)  # clients per label: this, rounded up or down
    possible = len(y) >= num_clients and k <= len(classes) and num_clients * k >= len(classes)
    if not possible or counts.min() < np.floor(holders):  # a label cannot feed its holders
        with pytest.raises(ConfigError):
            exact_labels(y, num_clients, k, seed)
        return
    if counts.min() < np.ceil(holders):  # depends on which labels the deal gives one more
        try:
            exact_labels(y, num_clients, k, seed)
        except ConfigError as exc:
            assert "examples for" in str(exc)
            return
    parts = exact_labels(y, num_clients, k, seed)
    assert_covers_once(parts, len(y))
    assert [len(np.unique(y[p])) for p in parts] == [k] * num_clients
    per_label = [sum(label in y[p] for p in parts) for label in classes]
    assert max(per_label) - min(per_label) <= 1  # labels are dealt evenly
    for label in classes:  # and a label's examples evenly among its holders
        sizes = [int((y[p] == label).sum()) for p in parts if label in y[p]]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(y=label_arrays, num_clients=st.integers(1, 30), k=st.integers(1, 6), seed=st.integers(0, 9))
def test_shards_deal_k_equal_shards_holding_up_to_2k_labels(y, num_clients, k, seed):
    if num_clients * k > len(y):
        with pytest.raises(ConfigError):
            shards(y, num_clients, k, seed)
        return
    parts = shards(y, num_clients, k, seed)
    assert_covers_once(parts, len(y))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= k  # k shards each, shards differ by at most one
    shard = -(-len(y) // (num_clients * k))
    if np.unique(y, return_counts=True)[1].min() >= shard:  # a shard spans at most 2 labels
        assert all(1 <= len(np.unique(y[p])) <= 2 * k for p in parts)


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
        ({"kind": "labels", "labels_per_client": 11}, "exceeds the 10 labels"),
        ({"kind": "labels", "labels_per_client": 1}, "cannot hold all 10 labels"),
    ],
)
def test_bad_partition_config_is_refused(kwargs, message):
    args = {"kind": "iid", "num_clients": 5, **kwargs}
    with pytest.raises(ConfigError, match=message):
        partition(args.pop("kind"), LABELS, args.pop("num_clients"), seed=0, **args)
