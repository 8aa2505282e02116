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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["JsonLines", "atomic_path", "atomic_write", "read_jsonl"]


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


@dataclass
class JsonLines:
    """What a JSON-lines file holds, and how its end looks."""

    records: list[dict[str, Any]]
    #: The file does not end with a newline: its last record is being appended right
    #: now (a live run) or was cut short by a crash.
    unterminated: bool = False
    #: That last line was not valid JSON, so it is not among `records`.
    dropped: bool = False


def read_jsonl(path: Path) -> JsonLines:
    """Every record of a JSON-lines file (none if there is no file). A last line that is
    not complete JSON is left out, not an error: a reader of a live run, or a restart
    after a crash, takes the whole records."""
    if not path.exists():
        return JsonLines([])
    *lines, last = path.read_text(encoding="utf-8").split("\n")
    records = [json.loads(line) for line in lines if line.strip()]
    if not last.strip():
        return JsonLines(records, unterminated=bool(last))
    try:
        records.append(json.loads(last))  # complete, only its newline is missing
    except json.JSONDecodeError:
        return JsonLines(records, unterminated=True, dropped=True)
    return JsonLines(records, unterminated=True)
