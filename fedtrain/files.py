"""Durable files: replaced atomically (write a temporary file beside, fsync, rename), so
a reader, or a restart after a crash, sees the old file or the new one, never half; and
JSON-lines files read while they may be growing.

No torch here: the CLI's light commands (`fedtrain ca`, `fedtrain status`, `fedtrain
report`) use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_path", "atomic_write", "read_jsonl"]


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file ([] if there is none). A last line without its
    newline that is not valid JSON is a record being appended right now (a live run)
    or cut short by a crash: it is left out, not an error."""
    if not path.exists():
        return []
    *lines, last = path.read_text(encoding="utf-8").split("\n")
    records = [json.loads(line) for line in lines if line.strip()]
    if last.strip():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(last))
    return records
