"""Durable files: replaced atomically (write a temporary file beside, fsync, rename), so
a reader, or a restart after a crash, sees the old file or the new one, never half.

No torch here: the CLI's light commands (`fedtrain ca`, `fedtrain status`) write
certificates and keys with it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_path", "atomic_write"]


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write (and fsync); renamed over `path` on
    success, removed on failure, so readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, write: Callable[[BinaryIO], Any], mode: int | None = None) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, fsync, then rename over it.

    The temporary file is created 0600 (`mkstemp`), so a secret is never readable by
    others, even briefly; `mode` sets the final permissions exactly (umask aside).
    """
    with atomic_path(path) as tmp:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
