"""`RUN_DIR/audit.jsonl`: who joined, left, was refused, trained, and which model came out.

Operators of a federation must be able to answer "which sites shaped model X?" after
the fact, so every admission decision and every round's participants and resulting
model digest are appended here, one JSON object per line, flushed immediately.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Called with (event, fields) after each record; e.g. the Prometheus counters.
AuditListener = Callable[[str, Mapping[str, Any]], None]


class AuditLog:
    """Append-only JSON lines; thread-safe (the servicer and the coordinator both write)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._listeners: list[AuditListener] = []

    def subscribe(self, listener: AuditListener) -> None:
        """Also hand every record to `listener` (every admission decision and round
        outcome passes through here, so counting them needs no hooks elsewhere)."""
        self._listeners.append(listener)

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields}, sort_keys=True)
        with self._lock:
            if self._file.closed:
                log.debug("audit log closed; dropping %s", line)
                return
            self._file.write(line + "\n")
            self._file.flush()
        for listener in self._listeners:
            listener(event, fields)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_audit(path: Path) -> list[dict[str, Any]]:
    """Every record of an audit file (for tests and `fedtrain report`)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
