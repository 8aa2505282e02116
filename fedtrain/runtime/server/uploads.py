"""One site's update on its way in: validated chunk by chunk and journaled as it arrives.

A plain update's chunks are checked the moment they arrive (placement, size,
finiteness) and kept in the upload's *journal*; once the update is whole and the
round accepts it (`RoundState.commit`), it is folded into the round's streaming sum
from the journal, under the round's lock, in one go. An upload that breaks off (a
dropped connection, a missing tensor, the round's deadline) or is refused was
therefore never part of the sum: it leaves no trace, not even float rounding, and the
round's sum is bit for bit what it would have been without it. Folding on arrival
instead would overlap the weighted add with the wire's time, but taking a broken
upload back out of a float sum by subtraction is not exact ((a + w x) - w x != a),
so a refused update would leave a rounding-level trace; the fold from the journal
costs one read of the update at commit (`benchmarks/RESULTS.md` has the figures).

The journal keeps an upload's chunks in memory (the received buffers themselves, no
copy) when the whole update fits in what is left of the server's `upload_memory_mb`
budget, shared by all uploads in flight, and in a temporary file otherwise. The
reservation is the whole update's size, made when the upload starts: an update that
could only partly fit would cost the same disk writes while also holding the memory,
and for a model larger than the budget (where the server's RAM is what limits it:
global model + accumulator already take 2x the model) journals go straight to disk.
Memory: at most that budget plus O(chunk) per upload. On disk the journal costs a
write at page-cache speed as long as the disk keeps up; when it does not (other
writers) the writer is throttled to the disk's speed, which is why memory comes first.

Every aggregator gets the update the same way, so those that must see a whole
update (median, trimmed mean, Krum, DP clipping, decoding) need nothing special.

A secure-aggregation round's masked vector (`MaskedUpload`) needs no journal: it is
uniformly random, so folding it into the modular sum as it arrives reveals nothing,
and a stream that breaks is subtracted back out (`SecAggServer.abort_masked_input`),
exactly, since the sum is modular integer arithmetic.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
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

#: One journaled chunk as the aggregate takes it: (tensor name, first element, values).
Piece = tuple[str, int, torch.Tensor]


class MemoryBudget:
    """Bytes of upload journals the server may hold in RAM, shared by concurrent uploads."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Reserve `size` bytes if they fit; False (nothing reserved) if they do not."""
        with self._lock:
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.used -= size


class _Received:
    """How much of an upload (checked by its `_validator`) has arrived."""

    _validator: ChunkValidator

    @property
    def bytes_received(self) -> int:
        return self._validator.bytes_received

    @property
    def expected_bytes(self) -> int:
        return self._validator.expected_bytes

    @property
    def whole(self) -> bool:
        """Every byte arrived (a plain update may still be refused at `finish`)."""
        return self.bytes_received == self.expected_bytes


class UpdateSpool(_Received):
    """One update's validated chunks, journaled in memory or on disk as they arrive.

    `add` checks a chunk and journals it; `fold_into` folds the complete update into
    an aggregator from the journal (`pieces` reads it back). The file is written and
    read positionally (`os.pwrite`/`os.preadv`). Use as a context manager: memory is
    given back and the file deleted on exit whatever happened.
    """

    def __init__(
        self,
        specs: tuple[TensorSpec, ...],
        directory: Path,
        max_chunk_bytes: int,
        memory: MemoryBudget | None = None,
    ) -> None:
        self._validator = ChunkValidator(specs)
        self.max_chunk_bytes = max_chunk_bytes
        self._directory = directory
        self._memory = memory
        size = sum(spec.nbytes for spec in specs)
        # The whole update's bytes of the budget, or none: the journal is in memory or on disk.
        self._in_memory = memory is not None and memory.take(size)
        self._held = size if self._in_memory else 0  # bytes of the budget to give back
        self._fd = -1
        self.path: Path | None = None  # the journal file, once a chunk had to go to disk
        # Per journaled chunk: (tensor name, byte offset in the tensor, size, the bytes
        # themselves if kept in memory, else their position in the file).
        self._index: list[tuple[str, int, int, memoryview | int]] = []
        self._written = 0
        self._largest = 0
        self._complete = False

    @property
    def complete(self) -> bool:
        return self._complete

    def add(self, chunk: Chunk) -> None:
        """Validate one chunk (placement, size, finiteness) and journal its bytes."""
        check_chunk_size(chunk, self.max_chunk_bytes)
        spec = self._validator.check(chunk)
        values = chunk_values(chunk)
        ensure_finite(spec.name, values)
        data = memoryview(chunk.data).cast("B")
        if self._in_memory:
            self._index.append((spec.name, chunk.offset, len(data), data))
        else:
            self._index.append((spec.name, chunk.offset, len(data), self._written))
            self._append_to_file(data)
            self._largest = max(self._largest, len(data))

    def _append_to_file(self, data: memoryview) -> None:
        if self._fd < 0:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._fd, name = tempfile.mkstemp(
                dir=self._directory, prefix=SPOOL_PREFIX, suffix=SPOOL_SUFFIX
            )
            self.path = Path(name)
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], self._written + done)
        self._written += len(data)

    def finish(self) -> None:
        """Raise unless every tensor arrived whole; after this the update may count."""
        self._validator.check_complete()
        self._complete = True

    def pieces(self) -> Iterator[Piece]:
        """The journaled chunks, read back in the update's own order (tensor by tensor,
        by offset), whatever order they arrived in: an update sent over parallel streams
        then folds exactly as one sent over one stream (a fold that reduces across
        chunks, e.g. a clipping norm, depends on the order).

        One buffer serves every piece: use each before asking for the next.
        """
        order = {name: i for i, name in enumerate(self._validator.specs)}
        buffer = bytearray(self._largest)
        for name, offset, size, kept in sorted(self._index, key=lambda e: (order[e[0]], e[1])):
            if isinstance(kept, int):
                view = memoryview(buffer)[:size]
                got = os.preadv(self._fd, [view], kept) if size else 0
                if got != size:
                    raise OSError(f"upload journal {self.path} is short: {got} of {size} bytes")
            else:
                view = kept
            dtype = torch_dtype(self._validator.specs[name].dtype)
            values = torch.frombuffer(view, dtype=dtype) if size else torch.empty(0, dtype=dtype)
            yield name, offset // dtype.itemsize, values

    def fold_into(self, aggregate: Aggregator, weight: float) -> None:
        """Add `weight * update` into `aggregate` from the journal (a complete update).

        Each piece goes through the aggregator's `add_chunk` (it may stage or transform
        chunks: clipping, decoding, staleness), which checks it against the model but
        not again for NaN/Inf: `add` did, before the update could reach any sum."""
        if not self._complete:
            raise TensorStreamError("an incomplete upload cannot be aggregated")
        with aggregate.finite_known():
            for name, start, values in self.pieces():
                aggregate.add_chunk(name, start, values, weight)
        aggregate.commit(weight)

    def close(self) -> None:
        if self._memory is not None and self._held:
            self._memory.give(self._held)
            self._held = 0
        self._index.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.path is not None:
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


class MaskedUpload(_Received):
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
