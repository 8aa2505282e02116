"""Fold an encoded update into a strategy's aggregator: decode once it is whole, then add.

A server receives an encoded update chunk by chunk, like any other (the parts are
ordinary tensors, checked against `codec.encoded_specs`). Codecs decode tensor by
tensor from parts that may arrive in any order, so `DecodingFold` stands in for the
round's aggregator while one update arrives: it stages the parts, and at `commit`
decodes them and adds the dense update to the real aggregator. Memory: one encoded
update (in the aggregator's staging dtypes) plus one decoded update, per upload being
folded.
"""

from __future__ import annotations

import torch

from fedtrain.compression import Codec
from fedtrain.strategy.aggregate import Aggregator
from fedtrain.tensors import ModelState, TensorSpec, torch_dtype


class DecodingFold(Aggregator):
    """Receives one update encoded with `codec`; `commit` adds it, decoded, to `target`."""

    def __init__(self, codec: Codec, specs: tuple[TensorSpec, ...], target: Aggregator) -> None:
        super().__init__(codec.encoded_specs(specs))
        self.codec = codec
        self.model_specs = specs
        self.target = target

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        self._stage(name, start, values)  # staged exactly: uint8/int32/float16 fit float64/32

    def commit(self, weight: float) -> None:
        staged = self._take_staged()
        encoded = ModelState(
            {
                name: staged[name].to(torch_dtype(spec.dtype)).reshape(spec.shape)
                for name, spec in self.specs.items()
            }
        )
        self.target.add(self.codec.decode(encoded, self.model_specs), weight)
        super().commit(weight)
