"""Which GPUs each virtual client of a simulation uses.

Many virtual clients share one machine's GPUs. `gpus_per_client` says how much of
the machine a client takes: a fraction packs several concurrent clients on one GPU
(0.25: four per GPU), a whole number gives each client that many GPUs. Clients are
placed round-robin so the load spreads evenly, and the result is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedtrain.errors import ConfigError


def visible_devices() -> list[str]:
    """This machine's GPUs as device names (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def slots(devices: Sequence[str], gpus_per_client: float) -> int:
    """How many clients can train at once on `devices` (at least 1, on the CPU)."""
    _check(devices, gpus_per_client)
    if not devices:
        return 1
    return max(1, math.floor(len(devices) / gpus_per_client + 1e-9))


def assign_devices(
    client_ids: Sequence[str], devices: Sequence[str], gpus_per_client: float = 1.0
) -> dict[str, tuple[str, ...]]:
    """Each client's devices, round-robin: client i gets GPU group i mod (number of groups).

    A fraction (<= 1) makes every GPU its own group; `gpus_per_client = k` (a whole
    number) cuts the GPUs into consecutive groups of k, leftovers unused. Without
    GPUs every client gets ("cpu",).
    """
    _check(devices, gpus_per_client)
    if not devices:
        return {cid: ("cpu",) for cid in client_ids}
    size = 1 if gpus_per_client <= 1 else int(gpus_per_client)
    groups = [tuple(devices[i : i + size]) for i in range(0, len(devices) - size + 1, size)]
    return {cid: groups[i % len(groups)] for i, cid in enumerate(client_ids)}


def _check(devices: Sequence[str], gpus_per_client: float) -> None:
    if not gpus_per_client > 0:
        raise ConfigError(f"gpus_per_client must be > 0, got {gpus_per_client}")
    if gpus_per_client > 1 and gpus_per_client != int(gpus_per_client):
        raise ConfigError(
            f"gpus_per_client = {gpus_per_client}: above 1 it must be a whole number of GPUs"
        )
    if devices and gpus_per_client > len(devices):
        raise ConfigError(
            f"gpus_per_client = {gpus_per_client} but only {len(devices)} GPU(s): {list(devices)}"
        )
    if len(set(devices)) != len(devices):
        raise ConfigError(f"devices {list(devices)} name a device twice")
