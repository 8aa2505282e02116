"""No worker outlives the process that owns its group, however that process ends."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _ddp_tasks import gone

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            pytest.fail(f"the group owner printed nothing within {timeout_s} s")
    return proc.stdout.readline()


@pytest.mark.parametrize(
    ("mode", "ending"),
    [("with", signal.SIGTERM), ("with", signal.SIGINT), ("leak", None)],
    ids=["SIGTERM", "SIGINT-in-with-block", "normal-exit-without-close"],
)
def test_owner_leaves_no_worker_behind(mode, ending):
    owner = subprocess.Popen(
        [sys.executable, str(HERE / "_owner.py"), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(read_line(owner, 120))
        workers = [psutil.Process(pid) for pid in pids]
        assert len(workers) == 2 and not gone(workers)
        if ending is None:
            owner.stdin.close()  # lets it return from main; atexit must stop the group
        else:
            owner.send_signal(ending)
        try:
            owner.wait(30)  # no hang at exit
        except subprocess.TimeoutExpired:
            owner.send_signal(signal.SIGUSR2)  # its threads' stacks go to the captured stderr
            time.sleep(2)
            pytest.fail(f"the group owner hung for 30 s after {ending or 'stdin closed'}")
        deadline = time.monotonic() + 10
        while not gone(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(workers), f"workers {pids} outlived their owner ({mode}, {ending})"
    finally:
        owner.kill()
        owner.wait()
