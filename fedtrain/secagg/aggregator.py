"""Streaming modular sum: fold masked vectors (or chunks of them) in as they arrive.

The server never holds N masked vectors: each one is added in place into a single
uint32 accumulator (numpy uint32 arithmetic wraps, which *is* arithmetic mod 2^32),
so memory is O(model) whatever the number of sites.
"""

from __future__ import annotations

import numpy as np

from fedtrain.errors import SecAggError


class ModularSumAggregator:
    """A uint32 accumulator of fixed length; ``add``/``subtract`` work mod 2^32."""

    def __init__(self, length: int) -> None:
        if length < 1:
            raise SecAggError(f"aggregator length must be >= 1, got {length}")
        self._sum = np.zeros(length, dtype=np.uint32)

    @property
    def length(self) -> int:
        return self._sum.shape[0]

    @property
    def array(self) -> np.ndarray:
        """The accumulator itself (not a copy): unmasking works on it in place."""
        return self._sum

    def _slice(self, chunk: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
        chunk = np.asarray(chunk)
        if chunk.dtype != np.uint32 or chunk.ndim != 1:
            raise SecAggError(
                f"masked data must be a 1-D uint32 array, got {chunk.dtype} {chunk.shape}"
            )
        end = offset + chunk.shape[0]
        if offset < 0 or end > self.length:
            raise SecAggError(
                f"chunk [{offset}, {end}) is outside the masked vector of length {self.length}"
            )
        return self._sum[offset:end], chunk

    def add(self, chunk: np.ndarray, offset: int = 0) -> None:
        """Fold ``chunk`` into elements ``[offset, offset + len(chunk))``."""
        target, chunk = self._slice(chunk, offset)
        np.add(target, chunk, out=target)

    def subtract(self, chunk: np.ndarray, offset: int = 0) -> None:
        """Undo :meth:`add` of the same chunk (e.g. a stream that broke midway)."""
        target, chunk = self._slice(chunk, offset)
        np.subtract(target, chunk, out=target)
