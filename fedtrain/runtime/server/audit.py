"""`RUN_DIR/audit.jsonl`: who joined, left, was refused, trained, and which model came out.

Operators of a federation must be able to answer "which sites shaped model X?" and
"who tried to get in?" after the fact, so every admission decision and every round's
participants and resulting model digest are appended here, one JSON object per line,
flushed immediately.

Refusals come from peers, possibly hostile ones, and a misconfigured site retries
forever, so they must not be able to fill the disk: :meth:`AuditLog.refusal` writes
the first refusal of each (record, peer address, cause) in a window and counts the
identical ones that follow, then writes one more record with their `count`. Every
refusal record carries `count`; their sum is the number of refusals.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Called with (event, fields) after each record; e.g. the Prometheus counters.
AuditListener = Callable[[str, Mapping[str, Any]], None]

#: After the first refusal of a (record, peer address, cause), identical ones within
#: this many seconds are counted into one later record instead of written each.
REFUSAL_WINDOW_S = 60.0
#: Distinct (record, address, cause) keys per window; refusals beyond share one key,
#: so even a peer rotating through addresses adds at most this many records a window.
MAX_REFUSAL_KEYS = 1000
#: The peer of the record that sums up refusals past MAX_REFUSAL_KEYS.
MANY_PEERS = "(more addresses than audit.MAX_REFUSAL_KEYS)"

RefusalKey = tuple[str, str, str]


def peer_host(peer: str) -> str:
    """'ipv4:10.0.0.7:51234' -> 'ipv4:10.0.0.7': a retrying peer keeps its address,
    not its port."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() and host not in ("ipv4", "ipv6") else peer


@dataclass
class _Window:
    started: float
    repeats: int = 0
    first: float = 0.0
    last: float = 0.0
    fields: dict[str, Any] = field(default_factory=dict)


class RefusalThrottle:
    """Which refusals to write: the first of each key per window; the rest are counted
    and come back from :meth:`due` once their window has passed."""

    def __init__(
        self,
        window_s: float = REFUSAL_WINDOW_S,
        max_keys: int = MAX_REFUSAL_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self._windows: dict[RefusalKey, _Window] = {}

    def admit(self, key: RefusalKey, fields: dict[str, Any], wall: float) -> bool:
        """True: write this refusal now. False: it was counted for a later record."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None and len(self._windows) >= self.max_keys:
            key = (key[0], MANY_PEERS, "*")
            window = self._windows.get(key)
        if window is None or now - window.started >= self.window_s:
            self._windows[key] = _Window(started=now)  # due() has taken the old one's count
            return True
        if window.repeats == 0:
            window.first = wall
        window.repeats += 1
        window.last = wall
        window.fields = fields if key[1] != MANY_PEERS else {**fields, "peer": MANY_PEERS}
        return False

    def due(self, *, everything: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """(event, summary fields) of each window that has passed (all when
        `everything`) and counted repeats; those windows are forgotten."""
        now = self.clock()
        out = []
        for key, window in list(self._windows.items()):
            if everything or now - window.started >= self.window_s:
                del self._windows[key]
                if window.repeats:
                    summary = {
                        **window.fields,
                        "count": window.repeats,
                        "first": window.first,
                        "last": window.last,
                    }
                    out.append((key[0], summary))
        return out


class AuditLog:
    """Append-only JSON lines; thread-safe (the servicer and the coordinator both write)."""

    def __init__(self, path: Path, throttle: RefusalThrottle | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._listeners: list[AuditListener] = []
        self._throttle = throttle or RefusalThrottle()

    def subscribe(self, listener: AuditListener) -> None:
        """Also hand every record to `listener` (every admission decision and round
        outcome passes through here, so counting them needs no hooks elsewhere)."""
        self._listeners.append(listener)

    def record(self, event: str, **fields: Any) -> None:
        self._append(event, fields)
        self._notify(event, fields)

    def refusal(self, event: str, *, peer: str, cause: str, **fields: Any) -> bool:
        """Record that `peer` was refused for `cause` (one word), throttled (see the
        module docstring); True when this call wrote a record, so the caller logs it
        too and the log is throttled alike. Listeners hear of every refusal."""
        record = {"peer": peer, "cause": cause, **fields, "count": 1}
        with self._lock:
            due = self._throttle.due()
            write = self._throttle.admit((event, peer_host(peer), cause), record, time.time())
        for summary_event, summary in due:
            self._append(summary_event, summary)
        if write:
            self._append(event, record)
        self._notify(event, record)
        return write

    def flush_refusals(self, *, everything: bool = False) -> None:
        """Write the counts of identical refusals whose window has passed (all of them
        when `everything`); the server calls this every few seconds and at close."""
        with self._lock:
            due = self._throttle.due(everything=everything)
        for event, fields in due:
            self._append(event, fields)

    def _append(self, event: str, fields: Mapping[str, Any]) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields}, sort_keys=True)
        with self._lock:
            if self._file.closed:
                log.debug("audit log closed; dropping %s", line)
                return
            self._file.write(line + "\n")
            self._file.flush()

    def _notify(self, event: str, fields: Mapping[str, Any]) -> None:
        for listener in self._listeners:
            listener(event, fields)

    def close(self) -> None:
        self.flush_refusals(everything=True)
        with self._lock:
            self._file.close()


def read_audit(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records of an audit file, or only those of `event` (tests, `fedtrain report`)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if event is None or r["event"] == event]
