"""`fedtrain demo` as a user runs it: real processes over mutual TLS with secure aggregation,
nothing left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from runtime_support import assert_gone


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_demo_runs_a_real_federation_and_cleans_up(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedtrain.cli", "demo", "--rounds", "2", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final accuracy: 0." in out.stdout
    server_log = (tmp_path / "logs" / "server.log").read_text()
    assert "TLS, sites prove their certificates at join" in server_log and "run" in server_log
    # Secure aggregation is the demo's default: only masked updates reach the server.
    assert "secure aggregation on" in server_log
    assert "unmasked the sum of 4/4 sites" in server_log
    assert "masked update of" in server_log and "plain update of" not in server_log
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    for i in range(4):
        assert "joined run" in (tmp_path / "logs" / f"site-{i}.log").read_text()
    # Every server and site process the demo started is gone.
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert_gone(leftovers)
