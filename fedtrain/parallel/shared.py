"""The model's way in and out of a local worker group: one shared-memory block.

Rank 0 runs in a worker process, not in the daemon. The daemon writes the global
model into this block and reads the trained model back from it, so no tensor is
pickled per round and the block is allocated once per group, not once per round.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn

from fedtrain.errors import TensorStreamError
from fedtrain.tensors import ModelState, TensorSpec, dtype_name, select, torch_dtype

_ALIGN = 64  # bytes; every dtype view of the block starts aligned


class SharedState:
    """Named tensor views into one shared-memory uint8 block, in state_dict order.

    It pickles as (block, specs): torch.multiprocessing passes the block's memory,
    not its bytes, so both processes see the same tensors.
    """

    def __init__(self, block: torch.Tensor, specs: tuple[TensorSpec, ...]) -> None:
        self.block, self.specs = block, specs
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        for spec in specs:
            raw = block[offset : offset + spec.nbytes]
            self.views[spec.name] = raw.view(torch_dtype(spec.dtype)).view(spec.shape)
            offset += -(-spec.nbytes // _ALIGN) * _ALIGN

    @classmethod
    def like(cls, module: nn.Module, names: Collection[str] | None = None) -> SharedState:
        """A block shaped like `module`'s state_dict (its entries `names`; None: all),
        in shared memory."""
        specs = tuple(
            TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))
            for name, t in select(module.state_dict(), names).items()
        )
        size = sum(-(-s.nbytes // _ALIGN) * _ALIGN for s in specs)
        return cls(torch.zeros(size, dtype=torch.uint8).share_memory_(), specs)

    def __getstate__(self) -> tuple[torch.Tensor, tuple[TensorSpec, ...]]:
        return self.block, self.specs

    def __setstate__(self, state: tuple[torch.Tensor, tuple[TensorSpec, ...]]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a model state (any device) into the block; names/dtypes/shapes must match."""
        if set(tensors) != set(self.views):
            missing = sorted(set(self.views) - set(tensors))
            extra = sorted(set(tensors) - set(self.views))
            raise TensorStreamError(
                f"state does not match the group's model: missing {missing}, unexpected {extra}"
            )
        for name, view in self.views.items():
            src = tensors[name]
            if src.dtype != view.dtype or src.shape != view.shape:
                raise TensorStreamError(
                    f"{name!r}: state has {src.dtype} {tuple(src.shape)}, "
                    f"the group's model has {view.dtype} {tuple(view.shape)}"
                )
            view.copy_(src.detach())

    def read(self) -> ModelState:
        """A private copy of the block's current contents."""
        return ModelState({name: view.clone() for name, view in self.views.items()})

    def as_state(self) -> ModelState:
        """The block itself as a ModelState (no copy): valid until the next write."""
        return ModelState(self.views)
