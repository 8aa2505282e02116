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


def describe(
    record: Mapping[str, Any], total_rounds: int | None = None, eta_s: float | None = None
) -> str:
    """One round's record as a short line: round (of total), accuracy, loss, the
    personalized accuracy, clients, pace, seconds, and the time left when known."""
    total = f"/{total_rounds}" if total_rounds else ""
    parts = [f"round {record['round']}{total}"]
    for key in ("accuracy", "loss"):
        if record.get(key) is not None:
            parts.append(f"{key} {record[key]:.4f}")
    if record.get("personalized_accuracy") is not None:
        parts.append(f"personalized {record['personalized_accuracy']:.4f}")
    parts.append(f"{record.get('clients', 0)} clients")
    if record.get("clients_per_s"):
        parts.append(pace(record["clients_per_s"]))
    parts.append(f"{record.get('seconds', 0.0):.2f}s")
    if eta_s is not None:
        parts.append(f"ETA {duration(eta_s)}")
    return " | ".join(parts)


def pace(clients_per_s: float) -> str:
    """Clients per second, or seconds per client when that reads better: a round of ten
    clients that each train for a few seconds is '3.2 s/client', never '0 clients/s'."""
    if clients_per_s >= 10:
        return f"{clients_per_s:.0f} clients/s"
    if clients_per_s >= 1:
        return f"{clients_per_s:.1f} clients/s"
    return f"{1 / clients_per_s:.1f} s/client"


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a time left, to the precision anyone plans with."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


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
        #: When this display started, and the round before the first one it saw (a
        #: resumed server starts past round 0): the pace so far gives the ETA.
        self._started = time.monotonic()
        self._before: int | None = None

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

    def eta_s(self, server_round: int) -> float | None:
        """Seconds left after `server_round`, at the average pace of the rounds seen so
        far; None before the first round or after the last."""
        if self._before is None:
            self._before = server_round - 1
        done = server_round - self._before
        left = self.total - server_round
        if done <= 0 or left <= 0:
            return None
        return (time.monotonic() - self._started) / done * left

    def update(self, record: Mapping[str, Any], completed: int | None = None) -> None:
        line = describe(record, self.total, self.eta_s(record["round"]))
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
        rate = f", {pace(done / elapsed)}" if elapsed > 0 and done else ""
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
