"""What the process and Ray backends share: a pool that starts on entry and always
closes on exit, also when starting fails halfway (no worker is left behind)."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

_Pool = TypeVar("_Pool", bound="WorkerPool")


class WorkerPool:
    """Subclasses implement `_start` (may fail after starting some workers) and `close`."""

    def __enter__(self: _Pool) -> _Pool:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
