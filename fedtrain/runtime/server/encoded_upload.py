"""An encoded update's spool: checked against the codec's parts, decoded as it is folded.

With `[compression]` on, a site uploads its codec's parts (e.g. ``fc.weight::idx`` and
``fc.weight::val``) as ordinary tensors. They are validated and spooled like any
update, against `codec.encoded_specs(model specs)`; folding then goes through
`fedtrain.compression.fold.DecodingFold`, which decodes the whole update once and
adds it to the round's aggregator. Everything else about an upload (admission, the
round's lock, a stream that breaks) is the plain path's.
"""

from __future__ import annotations

from pathlib import Path

from fedtrain.compression import Codec
from fedtrain.compression.fold import DecodingFold
from fedtrain.runtime.server.uploads import MemoryBudget, UpdateSpool
from fedtrain.strategy.aggregate import Aggregator
from fedtrain.tensors import TensorSpec


class DecodingSpool(UpdateSpool):
    """`UpdateSpool` for an update encoded with `codec`; `fold_into` folds it decoded."""

    def __init__(
        self,
        codec: Codec,
        specs: tuple[TensorSpec, ...],
        directory: Path,
        max_chunk_bytes: int,
        memory: MemoryBudget | None = None,
    ) -> None:
        super().__init__(codec.encoded_specs(specs), directory, max_chunk_bytes, memory)
        self.codec = codec
        self.model_specs = specs

    def fold_into(self, aggregate: Aggregator, weight: float) -> None:
        super().fold_into(DecodingFold(self.codec, self.model_specs, aggregate), weight)
