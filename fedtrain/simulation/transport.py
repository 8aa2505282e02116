"""Move worker events across a process boundary: tensors as one flat buffer each.

An event's tensors (an update, or a partial sum) are packed into one contiguous
buffer that travels beside the event, which itself shrinks to a few ids and floats.
Pickling tensor by tensor would cost a Python object round-trip per tensor, and
torch's own multiprocessing pickler would open a shared-memory file per tensor.
A backend with shared memory may instead hand partial sums over in a buffer it owns.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedtrain.simulation.events import ClientResult, ShareDone, WorkerEvent
from fedtrain.simulation.flat import FlatLayout, Payload, sum_specs
from fedtrain.tensors import TensorSpec


class EventTransport:
    """Detaches tensors from events on the worker side and re-attaches them in the driver."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.model = FlatLayout(specs)
        self.sums = FlatLayout(sum_specs(specs))

    def detach(
        self, event: WorkerEvent, sums_out: torch.Tensor | None = None
    ) -> tuple[WorkerEvent, np.ndarray | None]:
        """(event without tensors, packed tensors); partial sums go to `sums_out` if given."""
        if isinstance(event, ClientResult) and event.delta is not None:
            return dataclasses.replace(event, delta=None), self.model.pack(event.delta).numpy()
        if isinstance(event, ShareDone) and event.sums is not None:
            stripped = dataclasses.replace(event, sums=None)
            if sums_out is not None:
                self.sums.pack(event.sums, out=sums_out)
                return stripped, None
            return stripped, self.sums.pack(event.sums).numpy()
        return event, None

    def attach(
        self,
        event: WorkerEvent,
        payload: Payload | None,
        sums_in: torch.Tensor | None = None,
    ) -> WorkerEvent:
        """The event with its tensors back, as zero-copy views of `payload` or `sums_in`."""
        if isinstance(event, ClientResult) and payload is not None:
            return dataclasses.replace(event, delta=self.model.unpack(payload))
        if isinstance(event, ShareDone) and (payload is not None or sums_in is not None):
            source = payload if payload is not None else sums_in
            assert source is not None
            return dataclasses.replace(event, sums=dict(self.sums.unpack(source).items()))
        return event
