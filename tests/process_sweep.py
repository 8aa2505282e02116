"""pytest plugin: no process that a test session starts outlives the session, even
when the run is interrupted (Ctrl-C, or SIGTERM to pytest).

Tests start real processes: `Deployment` servers and sites, `ProcessGroup` children
(each in its own session, so a terminal's Ctrl-C never reaches them), the demo's
daemons, DDP workers, Ray. Each one inherits this session's marker, an environment
variable set before the first test, and so does everything they start in turn. When
the session ends, or pytest gets SIGINT or SIGTERM, every live process that carries the
marker is found by PID (psutil reads each process's environment) and stopped: SIGTERM,
then SIGKILL. A daemon whose parent was killed mid-test, or that never saw the
terminal's signal, is found all the same; processes of other sessions (other markers)
are never touched.

SIGTERM would otherwise end pytest at once, with no teardown at all: here it is
turned into an interruption (KeyboardInterrupt), after the sweep.

Loaded by tests/conftest.py; `python -m pytest -p process_sweep` loads it elsewhere.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import uuid
from types import FrameType
from typing import Any

import psutil

from benchmarks.procstats import processes_with_env

#: Prefix of the marker variable; the rest is this session's id, so a pytest run inside
#: a test (tests/test_process_sweep.py) marks its own processes and keeps the outer mark.
MARKER_PREFIX = "FEDTRAIN_TEST_SESSION_"
#: How long stopped processes get to exit before SIGKILL.
GRACE_S = 3.0

_marker = ""
_owner = 0  # the pytest process; a forked child inherits the handlers, not the job


def marker() -> str:
    """This session's marker variable ('' before the session is configured)."""
    return _marker


def pytest_configure(config: Any) -> None:
    global _marker, _owner
    _owner = os.getpid()
    _marker = f"{MARKER_PREFIX}{uuid.uuid4().hex[:12]}"
    os.environ[_marker] = str(_owner)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted)
    atexit.register(sweep)


def pytest_unconfigure(config: Any) -> None:
    if left := sweep():
        print(f"\nprocess_sweep: stopped what the tests left running: {left}", file=sys.stderr)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _owner:  # a forked child: behave as if we were never here
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    sweep()  # first, so nothing survives however the unwinding below goes
    raise KeyboardInterrupt


def sweep() -> str:
    """Stop every live process of this session (SIGTERM, then SIGKILL); says which
    (multiprocessing's resource tracker, which lives as long as pytest, goes unsaid)."""
    if not _marker or os.getpid() != _owner:
        return ""
    procs = processes_with_env(_marker, str(_owner))
    said = ", ".join(f"{p.pid} ({_name(p)})" for p in procs if not is_resource_tracker(p))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=GRACE_S)
    return said


def is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started once per test process by the first
    torch.multiprocessing user (tests/parallel) and kept for the process's lifetime."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:4])
    except psutil.Error:
        return "?"
