"""An interrupted test run leaves no process behind (tests/process_sweep.py).

A pytest run of its own, in a subprocess, starts processes the way the integration
tests do (a `ProcessGroup`'s children in their own sessions, as a Deployment's server
and sites are; a plain child; a grandchild in a session of its own, as a site's DDP
worker is) and then hangs mid-test; it is interrupted as a user would (Ctrl-C, or
SIGTERM from a job runner), and nothing it started may survive it. Sleeping Pythons
stand in for the daemons: the sweep finds processes by the session's mark, not by
what they run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from process_sweep import MARKER_PREFIX

HERE = Path(__file__).resolve().parent

INNER = """
import json, os, subprocess, sys, time
from pathlib import Path

from fedtrain.runtime.lifecycle import ProcessGroup

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
# A daemon that starts a worker in a session of its own and then sleeps.
PARENT = [sys.executable, "-c", (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
    "start_new_session=True); time.sleep(600)"
)]


def test_starts_a_federation_and_hangs_or_leaks():
    group = ProcessGroup()
    group.start("server", SLEEP)  # own sessions: a terminal's Ctrl-C never reaches them
    group.start("site-a", PARENT)
    group.start("site-b", SLEEP)
    plain = subprocess.Popen(SLEEP)
    pids = [p.pid for p in group.procs.values()] + [plain.pid]
    Path(os.environ["PIDS_FILE"]).write_text(json.dumps(pids))
    if os.environ["ENDING"] == "leak":
        return  # passes, and leaves all of them running
    time.sleep(600)
"""


def _marked_by(owner: int) -> list[int]:
    """Live processes marked by the session whose pytest process is `owner`."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if any(k.startswith(MARKER_PREFIX) and v == str(owner) for k, v in env.items()):
            found.append(proc.pid)
    return found


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ending", ["SIGINT", "SIGTERM", "leak"])
def test_an_interrupted_run_leaves_no_process(tmp_path: Path, ending: str) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids.json"
    root = HERE.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(root)]),
        "PIDS_FILE": str(pids_file),
        "ENDING": ending,
    }
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "process_sweep", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists() or not pids_file.read_text():
            assert inner.poll() is None or ending == "leak", inner.communicate()[0]
            assert time.monotonic() < deadline, "the inner run never started its processes"
            time.sleep(0.1)
        started = json.loads(pids_file.read_text())
        wait_for_grandchild = time.monotonic() + 30
        while len(_marked_by(inner.pid)) < 5 and time.monotonic() < wait_for_grandchild:
            time.sleep(0.1)  # the daemon's worker starts a moment later
        if ending != "leak":
            inner.send_signal(getattr(signal, ending))
        output, _ = inner.communicate(timeout=60)
        assert inner.returncode == (0 if ending == "leak" else 2), output
        if ending == "leak":
            assert "process_sweep: stopped what the tests left running" in output, output
        left = [pid for pid in started if psutil.pid_exists(pid) and not _zombie(pid)]
        assert left == [], output
        assert _marked_by(inner.pid) == [], output  # the grandchild too
    finally:
        if inner.poll() is None:
            inner.kill()
        for pid in started + _marked_by(inner.pid):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
