"""Round progress: a live rich display in a terminal, plain log lines elsewhere."""

from __future__ import annotations

import logging
import sys
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
    parts.append(f"{record.get('seconds', 0.0):.2f}s")
    return " | ".join(parts)


class RoundProgress:
    """`with RoundProgress(total) as p: p.update(record)` for each finished round."""

    def __init__(self, total_rounds: int, title: str = "rounds", live: bool | None = None) -> None:
        self.total = total_rounds
        self.title = title
        self.live = sys.stderr.isatty() if live is None else live
        self._progress: Progress | None = None
        self._task: Any = None

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
