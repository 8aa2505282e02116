"""Split one dataset's examples among virtual clients, deterministically.

Every partitioner takes the labels (or just the count) and a seed, and returns one
index array per client covering every example exactly once. Label skew is how
real federations differ (each hospital sees its own case mix), so the simulation
and the bundled examples share these.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedtrain.errors import ConfigError

PARTITIONERS = ("iid", "dirichlet", "shards", "quantity")


def iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A shuffled, near-equal split."""
    _check(num_examples, num_clients)
    order = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet(
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Label skew: each class is split among clients with Dirichlet(alpha) proportions.

    Small alpha gives each client few classes; large alpha approaches IID. Draws are
    repeated (deterministically) until every client holds at least `min_size` examples.
    """
    y = np.asarray(labels)
    _check(len(y), num_clients)
    if alpha <= 0:
        raise ConfigError(f"partition.alpha must be > 0, got {alpha}")
    if len(y) < num_clients * min_size:
        raise ConfigError(f"{len(y)} examples cannot give {num_clients} clients {min_size} each")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    for _ in range(1000):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(idx)).astype(int)
            for client, piece in enumerate(np.split(idx, cuts[:-1])):
                parts[client].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ConfigError(
        f"Dirichlet(alpha={alpha}) left a client with fewer than {min_size} examples in "
        "1000 draws; raise alpha or lower num_clients"
    )


def shards(
    labels: Sequence[int] | np.ndarray, num_clients: int, labels_per_client: int, seed: int
) -> list[np.ndarray]:
    """Pathological non-IID (McMahan et al.): sort by label, cut into
    num_clients * labels_per_client shards, give each client `labels_per_client` shards."""
    y = np.asarray(labels)
    _check(len(y), num_clients)
    if labels_per_client < 1:
        raise ConfigError(f"partition.labels_per_client must be >= 1, got {labels_per_client}")
    num_shards = num_clients * labels_per_client
    if num_shards > len(y):
        raise ConfigError(f"{len(y)} examples cannot be cut into {num_shards} shards")
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(y)), y))  # by label, ties shuffled
    pieces = np.array_split(order, num_shards)
    assignment = rng.permutation(num_shards)
    return [
        np.sort(np.concatenate([pieces[s] for s in assignment[c::num_clients]]))
        for c in range(num_clients)
    ]


def quantity(num_examples: int, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Quantity skew: IID labels, client sizes drawn from Dirichlet(alpha) (at least 1 each)."""
    _check(num_examples, num_clients)
    rng = np.random.default_rng(seed)
    sizes = 1 + np.floor(rng.dirichlet(np.full(num_clients, alpha)) * (num_examples - num_clients))
    sizes = sizes.astype(int)
    sizes[-1] += num_examples - sizes.sum()
    order = rng.permutation(num_examples)
    return [np.sort(p) for p in np.split(order, np.cumsum(sizes)[:-1])]


def partition(
    kind: str,
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    *,
    seed: int,
    alpha: float = 0.5,
    labels_per_client: int = 2,
) -> list[np.ndarray]:
    """Dispatch by name (the `partition.kind` config key)."""
    n = len(labels)
    if kind == "iid":
        return iid(n, num_clients, seed)
    if kind == "dirichlet":
        return dirichlet(labels, num_clients, alpha, seed)
    if kind == "shards":
        return shards(labels, num_clients, labels_per_client, seed)
    if kind == "quantity":
        return quantity(n, num_clients, alpha, seed)
    raise ConfigError(f"partition.kind = {kind!r} is unknown; choose one of {PARTITIONERS}")


def _check(num_examples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if num_examples < num_clients:
        raise ConfigError(f"{num_examples} examples cannot be split among {num_clients} clients")
