"""Round progress: a live rich display in a terminal, plain log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)


def describe(record: Mapping[str, Any]) -> str:
    """One round's record as a short line: round, accuracy, loss, clients, seconds."""
    parts = [f"round {record['round']}"]
    for key, fmt in (("accuracy", "{:.4f}"), ("loss", "{:.4f}")):
        if record.get(key) is not None:
            parts.append(f"{key} {fmt.format(record[key])}")
    parts.append(f"clients {record.get('clients', 0)}")
    if record.get("clients_per_s") is not None:
        parts.append(f"{record['clients_per_s']:.0f} clients/s")
    parts.append(f"{record.get('seconds', 0.0):.2f}s")
    return " | ".join(parts)


class RoundProgress:
    """`with RoundProgress(total) as p: p.update(record)` for each finished round.

    `clients(round, done, total)` shows progress inside a round (simulation rounds of
    thousands of clients take a while); in a terminal only, log lines stay per round.
    """

    def __init__(self, total_rounds: int, title: str = "rounds", live: bool | None = None) -> None:
        self.total = total_rounds
        self.title = title
        self.live = sys.stderr.isatty() if live is None else live
        self._progress: Progress | None = None
        self._task: Any = None
        self._round_started: tuple[int, float] | None = None

    def __enter__(self) -> RoundProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, status="")
        return self

    def update(self, record: Mapping[str, Any], completed: int | None = None) -> None:
        line = describe(record)
        if self._progress is not None:
            done = record["round"] if completed is None else completed
            self._progress.update(self._task, completed=done, status=line)
        else:
            log.info(line)

    def clients(self, server_round: int, done: int, total: int) -> None:
        """Round `server_round` has `done` of its `total` clients trained."""
        now = time.monotonic()
        if self._round_started is None or self._round_started[0] != server_round:
            self._round_started = (server_round, now)
        if self._progress is None:
            return
        elapsed = now - self._round_started[1]
        rate = f", {done / elapsed:.0f} clients/s" if elapsed > 0 and done else ""
        status = f"round {server_round}: {done}/{total} clients{rate}"
        self._progress.update(self._task, status=status)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
