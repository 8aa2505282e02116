"""`fedtrain demo` as a user runs it: real processes over mutual TLS with secure aggregation,
nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from runtime_support import assert_gone, wait_for

from fedtrain.runtime.demo import run_demo, sites_own_accuracy
from fedtrain.runtime.server.audit import read_audit


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
    assert "(federated, secure: 4 sites' held-out data)" in out.stdout
    # the server holds no data: the sites evaluated under masks, so no site is named
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_source"] == "sites" and last["eval_secure"] is True
    assert "site_metrics" not in last and "worst_site" not in last
    # ...and the demo, which runs every site, names the worst from the sites' own logs
    own = sites_own_accuracy(tmp_path / "logs", [f"site-{i}" for i in range(4)])
    worst = min(own, key=own.__getitem__)
    assert (
        len(own) == 4
        and f"worst site: {worst}, accuracy {own[worst]:.4f} (from its own log" in out.stdout
    )
    assert f"{own[worst]:.4f}" not in (tmp_path / "logs" / "server.log").read_text()
    server_log = (tmp_path / "logs" / "server.log").read_text()
    assert "TLS, sites prove their certificates at join" in server_log and "run" in server_log
    # Secure aggregation is the demo's default: only masked updates reach the server.
    assert "secure aggregation on" in server_log
    assert "unmasked the sum of 4/4 sites" in server_log
    assert "round 2's evaluation: unmasked the sum of 4/4 sites" in server_log
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


def _kill_when_round_starts(run_dir: Path, server_round: int, site: str) -> int:
    """SIGKILL `site`'s daemon as soon as the audit log says `server_round` started
    with it (it is then downloading or training); returns the pid it killed."""
    audit = run_dir / "run" / "audit.jsonl"
    toml = str(run_dir / f"{site}.toml")

    def started() -> bool:
        try:
            records = read_audit(audit)
        except ValueError:  # caught a line half written
            return False
        return any(r["event"] == "round_started" and r["round"] == server_round for r in records)

    wait_for(started, 200, f"round {server_round} to start")
    for p in psutil.process_iter(["cmdline"]):
        if toml in (p.info["cmdline"] or []):
            os.kill(p.pid, signal.SIGKILL)
            return int(p.pid)
    raise AssertionError(f"no running daemon for {site}")


@pytest.mark.slow  # long scenario (20-33 s): run with -m slow
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_demo_completes_its_rounds_when_a_site_is_killed_mid_round(tmp_path: Path) -> None:
    killer = ThreadPoolExecutor(1)
    killed = killer.submit(_kill_when_round_starts, tmp_path, 2, "site-2")
    result = run_demo(tmp_path, rounds=3, timeout_s=220)
    killed.result(1)
    killer.shutdown()
    assert [r["round"] for r in result.history] == [1, 2, 3]
    # It learned: chance is 0.1; three non-IID rounds with fresh training seeds (one
    # round short a site) end between 0.48 and 0.91 on this machine.
    assert result.final_accuracy is not None and result.final_accuracy > 0.3
    audit = read_audit(tmp_path / "run" / "audit.jsonl")
    started = [r for r in audit if r["event"] == "round_started" and r["round"] == 2]
    assert len(started) == 1 and "site-2" in started[0]["participants"]
    # Round 2 completed without the killed site, in its first attempt, unmasking once.
    assert not [r for r in audit if r["event"] == "round_failed"]
    unmasked = {
        r["round"]: r["included"]
        for r in audit
        if r["event"] == "secagg_unmasked" and not r.get("evaluation")
    }
    assert sorted(unmasked) == [1, 2, 3]
    assert unmasked[2] == ["site-0", "site-1", "site-3"]
    # The demo started site-2 again, and it was back for round 3.
    assert unmasked[3] == ["site-0", "site-1", "site-2", "site-3"]
    assert (tmp_path / "logs" / "site-2.log").read_text().count("joined run") == 2
