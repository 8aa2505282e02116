"""Progress inside a round, and `fedtrain simulate` on the process backend."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from fedtrain.observability import progress as progress_module
from fedtrain.observability.progress import RoundProgress, describe, duration, pace
from fedtrain.simulation import run_simulation


def test_progress_reaches_every_training_client_each_round(make_config):
    calls: list[tuple[int, int, int]] = []
    config = make_config(heterogeneity={"dropout_rate": 0.25})
    run_simulation(config, on_progress=lambda *call: calls.append(call))
    last = {r: (done, total) for r, done, total in calls}
    assert last == {1: (15, 15), 2: (15, 15), 3: (15, 15)}
    assert all(0 <= done <= total for _, done, total in calls)


def test_round_progress_shows_clients_and_rate():
    with RoundProgress(2, "sim", live=True) as progress:
        progress.clients(1, 0, 100)
        progress.clients(1, 50, 100)
        progress.update({"round": 1, "clients": 100, "clients_per_s": 1234.5, "seconds": 0.1})
    line = describe({"round": 1, "clients": 100, "clients_per_s": 1234.5, "seconds": 0.1})
    assert "1234 clients/s" in line or "1235 clients/s" in line


def test_a_slow_pace_reads_as_seconds_per_client_never_zero_clients_per_second():
    line = describe({"round": 2, "clients": 10, "clients_per_s": 0.3125, "seconds": 32.0})
    assert "3.2 s/client" in line and "clients/s" not in line
    assert pace(2.5) == "2.5 clients/s" and pace(0.05) == "20.0 s/client"


def test_the_round_line_puts_the_personalized_accuracy_beside_the_global_one():
    line = describe({"round": 4, "accuracy": 0.71, "personalized_accuracy": 0.93, "clients": 3})
    assert line.startswith("round 4 | accuracy 0.7100 | personalized 0.9300 | 3 clients")


def test_the_round_line_says_how_far_along_and_how_long_is_left(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.INFO, logger="fedtrain.observability.progress")
    display = RoundProgress(10, "server", live=False)
    for server_round in (1, 2):
        clock[0] += 10.0  # 10 s a round
        display.update({"round": server_round, "clients": 4, "seconds": 10.0})
    assert caplog.messages[-1] == "round 2/10 | 4 clients | 10.00s | ETA 1m20s"
    clock[0] += 1000.0
    display.update({"round": 10, "clients": 4, "seconds": 10.0})
    assert caplog.messages[-1] == "round 10/10 | 4 clients | 10.00s"  # done: no ETA

    resumed = RoundProgress(10, "server", live=False)  # a server resumed after round 5
    clock[0] += 20.0
    resumed.update({"round": 6, "clients": 4, "seconds": 20.0})
    assert caplog.messages[-1].endswith("| ETA 1m20s")  # 4 rounds left at 20 s each
    assert duration(7322) == "2h02m" and duration(59.6) == "1m00s"


@pytest.mark.integration
def test_simulate_command_on_the_process_backend(tmp_path):
    sim = tmp_path / "sim.toml"
    sim.write_text(
        'task = "fedtrain.examples:SyntheticTask"\n'
        "rounds = 2\nnum_clients = 50\n"
        "[task_options]\nnum_train = 1000\n"
        "[strategy]\nfraction_fit = 0.5\n"
    )
    run = tmp_path / "run"
    command = ["simulate", "--config", str(sim), "--backend", "process", "--workers", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "fedtrain.cli", *command, "--run-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "final accuracy:" in out.stdout
    assert "clients/s" in out.stderr  # the per-round log line
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = [(r["round"], r["selected"], r["clients"]) for r in records]
    assert summary == [(1, 25, 25), (2, 25, 25)]
    assert json.loads((run / "config.json").read_text())["backend"] == "process"
    assert (run / "model.pt").stat().st_size > 0
