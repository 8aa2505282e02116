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

PARTITIONERS = ("iid", "dirichlet", "shards", "labels", "quantity")
#: The partitioners that read the task's labels (`Task.labels`).
LABEL_PARTITIONERS = ("dirichlet", "shards", "labels")


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
    """Pathological non-IID as McMahan et al. 2017 made it: sort the examples by label,
    cut them into num_clients * labels_per_client equal shards, deal each client
    `labels_per_client` random shards.

    A client holds `labels_per_client` *shards*, not labels: a shard that straddles a
    label boundary brings both labels, and two shards may share one, so where every
    label has at least a shard's worth of examples a client holds between 1 and
    2 * labels_per_client labels (2-4 for 2 shards on the 10 digits; more where labels
    are rarer than a shard is long). Use `labels` for exactly `labels_per_client`.
    """
    y = np.asarray(labels)
    _check(len(y), num_clients)
    _check_per_client(labels_per_client)
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


def exact_labels(
    labels: Sequence[int] | np.ndarray, num_clients: int, labels_per_client: int, seed: int
) -> list[np.ndarray]:
    """Exactly `labels_per_client` distinct labels per client.

    Labels are dealt round-robin over a seeded shuffle of them (client c holds labels
    c*k, ..., c*k + k - 1 of it, modulo their number), so each label goes to as many
    clients as any other, give or take one; each label's examples are split evenly,
    in a seeded random order, among the clients holding it. Covering every example
    needs every label held by someone (num_clients * labels_per_client >= labels) and
    each label to have an example for every holder.
    """
    y = np.asarray(labels)
    _check(len(y), num_clients)
    _check_per_client(labels_per_client)
    classes = np.unique(y)
    if labels_per_client > len(classes):
        raise ConfigError(
            f"partition.labels_per_client = {labels_per_client} exceeds the {len(classes)} "
            "labels the data has"
        )
    if num_clients * labels_per_client < len(classes):
        raise ConfigError(
            f"{num_clients} clients x labels_per_client = {labels_per_client} cannot hold all "
            f"{len(classes)} labels, so some examples would belong to no client; raise "
            "labels_per_client or num_clients"
        )
    rng = np.random.default_rng(seed)
    dealt = rng.permutation(classes)
    holders: dict[int, list[int]] = {}
    for c in range(num_clients):
        for j in range(labels_per_client):
            holders.setdefault(int(dealt[(c * labels_per_client + j) % len(dealt)]), []).append(c)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label in classes:
        idx = rng.permutation(np.flatnonzero(y == label))
        owners = holders[int(label)]
        if len(idx) < len(owners):
            raise ConfigError(
                f"label {label} has {len(idx)} examples for {len(owners)} clients holding it; "
                "lower num_clients or labels_per_client"
            )
        for owner, piece in zip(owners, np.array_split(idx, len(owners)), strict=True):
            parts[owner].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


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
    if kind == "labels":
        return exact_labels(labels, num_clients, labels_per_client, seed)
    if kind == "quantity":
        return quantity(n, num_clients, alpha, seed)
    raise ConfigError(f"partition.kind = {kind!r} is unknown; choose one of {PARTITIONERS}")


def _check_per_client(labels_per_client: int) -> None:
    if labels_per_client < 1:
        raise ConfigError(f"partition.labels_per_client must be >= 1, got {labels_per_client}")


def _check(num_examples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if num_examples < num_clients:
        raise ConfigError(f"{num_examples} examples cannot be split among {num_clients} clients")
