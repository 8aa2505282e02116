"""One site's update on its way in: validated chunk by chunk, spooled to disk, folded once whole.

Why a spool: folding chunks straight into the round's aggregate would let a stream
that turns out bad (a NaN in its last chunk, a missing tensor, a dropped connection)
leave half an update behind in it. Holding whole updates in RAM until they are
complete would cost O(sites x model) of server memory. Writing the (already
validated) raw bytes sequentially to a temporary file keeps memory O(chunk) per
upload; a bad or truncated stream is simply deleted, and a complete one is read back
in chunk-sized pieces into the aggregate under the round's lock.

A secure-aggregation round's masked vector is the exception (`MaskedUpload`): it is
uniformly random, so folding it into the modular sum as it arrives reveals nothing,
and a stream that breaks is subtracted back out (`SecAggServer.abort_masked_input`).
It gets the same chunk checks, but no spool.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from fedtrain.errors import TensorStreamError
from fedtrain.runtime.wire import masked_spec
from fedtrain.strategy.aggregate import Aggregator, accumulator_dtype, check_finite
from fedtrain.tensors import Chunk, ChunkValidator, TensorSpec, chunk_values, torch_dtype

log = logging.getLogger(__name__)

SPOOL_PREFIX = "upload-"
SPOOL_SUFFIX = ".spool"


class UpdateSpool:
    """Receives one update's chunks into a temporary file; `fold_into` adds it to an aggregate.

    Use as a context manager: the file is deleted on exit whatever happened.
    """

    def __init__(
        self, specs: tuple[TensorSpec, ...], directory: Path, max_chunk_bytes: int
    ) -> None:
        self._validator = ChunkValidator(specs)
        self.max_chunk_bytes = max_chunk_bytes
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=SPOOL_PREFIX, suffix=SPOOL_SUFFIX)
        self.path = Path(name)
        self._file = os.fdopen(fd, "w+b")
        # (tensor name, byte offset in the tensor, size): where each spooled chunk belongs.
        self._index: list[tuple[str, int, int]] = []
        self._largest = 0
        self._complete = False

    @property
    def bytes_received(self) -> int:
        return self._validator.bytes_received

    def add(self, chunk: Chunk) -> None:
        """Validate one chunk (placement, size, finiteness) and append its bytes to the file."""
        check_chunk_size(chunk, self.max_chunk_bytes)
        size = len(chunk.data)
        spec = self._validator.check(chunk)
        ensure_finite(spec.name, chunk_values(chunk))
        self._file.write(chunk.data)
        self._index.append((spec.name, chunk.offset, size))
        self._largest = max(self._largest, size)

    def finish(self) -> None:
        """Raise unless every tensor arrived whole; after this the update may be folded."""
        self._validator.check_complete()
        self._file.flush()
        self._complete = True

    def fold_into(self, aggregate: Aggregator, weight: float) -> None:
        """Add `weight * update` into `aggregate`, reading the spool back chunk by chunk."""
        if not self._complete:
            raise TensorStreamError("an incomplete upload cannot be aggregated")
        buffer = bytearray(self._largest)
        self._file.seek(0)
        for name, offset, size in self._index:
            view = memoryview(buffer)[:size]
            got = self._file.readinto(view)
            if got != size:
                raise OSError(f"upload spool {self.path} is short: read {got} of {size} bytes")
            dtype = torch_dtype(self._validator.specs[name].dtype)
            values = torch.frombuffer(view, dtype=dtype) if size else torch.empty(0, dtype=dtype)
            aggregate.add_chunk(name, offset // dtype.itemsize, values, weight)
        aggregate.commit(weight)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> UpdateSpool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: Folds one chunk of masked values at an element offset; True once the vector is whole.
MaskedFold = Callable[[int, np.ndarray], bool]


class MaskedUpload:
    """One site's masked vector on its way in: checked chunk by chunk, folded at once.

    The chunks must form exactly one `masked_spec(length)` tensor, in order (the
    secure aggregator keeps a journal of a partial vector so it can take it out again,
    which needs contiguous chunks). `fold` does the folding (under the round's lock).
    """

    def __init__(self, length: int, max_chunk_bytes: int, fold: MaskedFold) -> None:
        self._validator = ChunkValidator((masked_spec(length),))
        self.max_chunk_bytes = max_chunk_bytes
        self._fold = fold
        self._next = 0  # byte offset the next chunk must start at
        self.complete = False

    @property
    def bytes_received(self) -> int:
        return self._validator.bytes_received

    def add(self, chunk: Chunk) -> None:
        check_chunk_size(chunk, self.max_chunk_bytes)
        self._validator.check(chunk)
        if chunk.offset != self._next:
            raise TensorStreamError(
                f"{chunk.name!r}: chunk at byte {chunk.offset}, expected byte {self._next} "
                "(masked vectors must arrive in order)"
            )
        self._next += len(chunk.data)
        values = np.frombuffer(chunk.data, dtype="<u4")
        self.complete = self._fold(chunk.offset // values.itemsize, values)

    def finish(self) -> None:
        """Raise unless the whole vector arrived (and was folded)."""
        self._validator.check_complete()
        if not self.complete:  # pragma: no cover - the validator saw every byte
            raise TensorStreamError("the masked vector arrived but was not completed")


def check_chunk_size(chunk: Chunk, max_chunk_bytes: int) -> None:
    """A chunk larger than the server's `chunk_bytes` is refused (memory per upload)."""
    if len(chunk.data) > max_chunk_bytes:
        raise TensorStreamError(
            f"{chunk.name!r}: a chunk of {len(chunk.data)} bytes exceeds the server's "
            f"chunk_bytes ({max_chunk_bytes})"
        )


def ensure_finite(name: str, values: torch.Tensor) -> None:
    """`check_finite`, at the speed of a sum for the common all-finite case.

    A finite sum proves every value finite (NaN and Inf propagate); a non-finite sum
    may also be an overflow of huge but finite values, so then the exact check decides
    (and words the error).
    """
    if not values.dtype.is_floating_point or values.numel() == 0:
        return
    if not bool(torch.isfinite(values.sum(dtype=accumulator_dtype(values.dtype)))):
        check_finite(name, values)


def remove_stale_spools(directory: Path) -> int:
    """Delete spool files a crashed server left behind; returns how many."""
    if not directory.is_dir():
        return 0
    stale = list(directory.glob(f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}"))
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d upload spool file(s) left by a previous server", len(stale))
    return len(stale)
