"""Per-client state kept across rounds for stateful algorithms, stored compactly.

At a real site, state such as SCAFFOLD's control variate or top-k's error-feedback
residual lives with the site. In simulation one worker stands in for thousands of
sites, so it keeps each client's state here: packed into a single flat buffer per
client (no per-tensor Python objects), with the layout shared between clients whose
state has the same shape. Clients that keep no state cost nothing, so FedAvg runs
pay nothing for this.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedtrain.simulation.flat import FlatLayout
from fedtrain.tensors import ModelState, TensorSpec


class ClientStateStore:
    """`get` a client's state before it trains and `put` it back afterwards."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[TensorSpec, ...], FlatLayout] = {}
        self._packed: dict[str, tuple[FlatLayout, torch.Tensor]] = {}

    def get(self, client_id: str) -> dict[str, torch.Tensor]:
        """A fresh, mutable copy of the client's state ({} if it has none)."""
        entry = self._packed.get(client_id)
        if entry is None:
            return {}
        layout, buffer = entry
        return dict(layout.unpack(buffer.clone()).items())

    def put(self, client_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep `state` for the client's next round; an empty state frees its slot."""
        if not state:
            self._packed.pop(client_id, None)
            return
        tensors = ModelState(state)  # validates dtypes, moves to CPU
        layout = self._layouts.setdefault(tensors.specs, FlatLayout(tensors.specs))
        self._packed[client_id] = (layout, layout.pack(tensors))

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def nbytes(self) -> int:
        """Bytes held for all clients' state."""
        return sum(buffer.numel() for _, buffer in self._packed.values())
