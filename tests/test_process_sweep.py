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

from benchmarks.procstats import processes_with_env

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
    marker = [(k, v) for k, v in os.environ.items() if k.startswith("FEDTRAIN_TEST_SESSION_")]
    Path(os.environ["PIDS_FILE"]).write_text(json.dumps({"pids": pids, "marker": marker[-1]}))
    if os.environ["ENDING"] == "leak":
        return  # passes, and leaves all of them running
    time.sleep(600)
"""


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ending", ["SIGINT", "SIGTERM", "leak"])
def test_an_interrupted_run_leaves_no_process(tmp_path: Path, ending: str) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    started_file = tmp_path / "started.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
        "PIDS_FILE": str(started_file),
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
    pids: list[int] = []
    marked: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not started_file.exists() or not started_file.read_text():
            assert inner.poll() is None or ending == "leak", inner.communicate()[0]
            assert time.monotonic() < deadline, "the inner run never started its processes"
            time.sleep(0.1)
        started = json.loads(started_file.read_text())
        pids, (key, value) = started["pids"], started["marker"]
        assert key.startswith(MARKER_PREFIX) and value == str(inner.pid)
        deadline = time.monotonic() + 30
        while len(marked := processes_with_env(key, value)) < 5:  # + the daemon's worker
            assert time.monotonic() < deadline, marked
            time.sleep(0.1)
        if ending != "leak":
            inner.send_signal(getattr(signal, ending))
        output, _ = inner.communicate(timeout=60)
        assert inner.returncode == (0 if ending == "leak" else 2), output
        if ending == "leak":
            assert "process_sweep: stopped what the tests left running" in output, output
        assert [pid for pid in pids if _alive(pid)] == [], output
        assert processes_with_env(key, value) == [], output  # the grandchild too
    finally:
        if inner.poll() is None:
            inner.kill()
        for proc in marked:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
