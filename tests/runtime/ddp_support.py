"""Tasks and helpers for sites that train on a DDP worker group.

Like runtime_support, this folder is on the PYTHONPATH of the processes the tests
start, so the server, the site daemons and their spawned workers all import
`ddp_support:CrashingTask` by name (the fingerprint includes the class name).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable

import psutil
from runtime_support import TinyTask
from torch import nn
from torch.utils.data import Dataset

from fedtrain.strategy import RoundConfig
from fedtrain.task import TaskContext, TrainResult

#: The worker group's log line once every rank is ready (fedtrain.parallel.group).
_READY = re.compile(r"DDP group ready: ranks \[[^\]]*\] are pids \[([^\]]*)\]")


class CrashingTask(TinyTask):
    """TinyTask whose rank `crash_rank` dies abruptly (`os._exit(3)`, no traceback, no
    goodbye: a segfault or an OOM kill looks the same) in round `crash_round`."""

    def __init__(self, crash_rank: int = 1, crash_round: int = 2) -> None:
        super().__init__()
        self.crash_rank, self.crash_round = crash_rank, crash_round

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        if context.rank == self.crash_rank and config.get("round") == self.crash_round:
            os._exit(3)
        return super().train(model, data, config, context)


def worker_generations(site_log: str) -> list[list[int]]:
    """The worker PIDs of each generation of a site's group, in start order."""
    return [[int(pid) for pid in m.group(1).split(",")] for m in _READY.finditer(site_log)]


def alive(pids: Iterable[int]) -> list[int]:
    """Those of `pids` still running (a zombie awaiting its reaper counts as gone)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def assert_all_gone(pids: Iterable[int], timeout_s: float = 10.0) -> None:
    """Every PID exits within `timeout_s` (workers notice their daemon's end by polling)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"worker processes left behind: {alive(pids)}"
