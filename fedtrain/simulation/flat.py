"""A model's tensors laid out in one flat byte buffer, for moving between processes.

Workers receive the global model through one shared buffer per round and return
partial sums and updates as one buffer each: one copy (or none) instead of pickling
tensor by tensor. The layout is a pure function of the specs, so the driver and
every worker compute the same offsets without exchanging them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from fedtrain.strategy.aggregate import accumulator_dtype
from fedtrain.tensors import ModelState, TensorSpec, dtype_name, torch_dtype

ALIGN = 64  # bytes: every tensor starts on a cache line, so typed views are aligned

Payload = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


def sum_specs(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """Specs of a `WeightedSum`'s flat accumulators over a model with `specs`."""
    return tuple(
        TensorSpec(s.name, dtype_name(accumulator_dtype(torch_dtype(s.dtype))), (s.numel,))
        for s in specs
    )


def as_bytes_tensor(payload: Payload) -> torch.Tensor:
    """A uint8 tensor over `payload`'s memory, without a copy.

    Buffers received from other processes may be read-only (Ray's object store,
    pickled bytes); the result is only ever read, so torch's warning about writing
    to non-writable memory does not apply.
    """
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1).view(torch.uint8)
    view = memoryview(payload).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class FlatLayout:
    """Byte offsets of each tensor of `specs` inside one contiguous buffer."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.specs = specs
        offsets = []
        end = 0
        for spec in specs:
            offsets.append(end)
            end += -(-spec.nbytes // ALIGN) * ALIGN
        self.offsets = tuple(offsets)
        self.nbytes = max(end, ALIGN)

    def empty(self, *, shared: bool = False) -> torch.Tensor:
        """A zeroed buffer for this layout; `shared` puts it in shared memory."""
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8)
        return buffer.share_memory_() if shared else buffer

    def pack(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy `tensors` (named as the specs) into `out` or a new buffer; returns it."""
        buffer = self.empty() if out is None else out
        if buffer.numel() != self.nbytes or buffer.dtype != torch.uint8:
            raise ValueError(f"buffer of {buffer.numel()} bytes for a {self.nbytes}-byte layout")
        for view, spec in zip(self.views(buffer).values(), self.specs, strict=True):
            view.copy_(tensors[spec.name].reshape(view.shape))
        return buffer

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a typed view into `buffer` (zero-copy; writes go to the buffer)."""
        out = {}
        for spec, start in zip(self.specs, self.offsets, strict=True):
            raw = buffer[start : start + spec.nbytes]
            out[spec.name] = raw.view(torch_dtype(spec.dtype)).view(spec.shape)
        return out

    def unpack(self, payload: Payload) -> ModelState:
        """The tensors of a packed buffer as a `ModelState` of views (zero-copy)."""
        buffer = as_bytes_tensor(payload)
        if buffer.numel() != self.nbytes:
            raise ValueError(f"payload of {buffer.numel()} bytes for a {self.nbytes}-byte layout")
        return ModelState(self.views(buffer))
