"""The process pool leaves nothing behind: after a run, a failing client, Ctrl-C,
or a worker killed under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fedtrain.errors import SimulationError
from fedtrain.simulation import run_simulation

pytestmark = pytest.mark.integration


def worker_processes(pid: int | None = None) -> list[psutil.Process]:
    """Spawned pool workers under `pid` (default: this test process)."""
    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if "spawn_main" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_all_gone(procs: list[psutil.Process]) -> None:
    assert procs, "the test never saw a worker process"
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, f"leftover workers: {[p.pid for p in alive]}"


def test_workers_exit_after_a_run(make_config):
    seen: list[psutil.Process] = []
    config = make_config(backend="process", rounds=2)
    run_simulation(config, on_round=lambda record: seen.extend(worker_processes()))
    assert len({p.pid for p in seen}) == 2
    assert_all_gone(seen)


def test_a_client_that_raises_fails_the_run_with_its_traceback(make_config):
    seen: list[psutil.Process] = []
    config = make_config(
        backend="process",
        task="sim_tasks:FailingTask",
        task_options={"num_train": 1200, "fail_on": "client-05", "fail_round": 2},
        strategy={"fraction_fit": 1.0},
    )
    with pytest.raises(SimulationError) as info:
        run_simulation(config, on_round=lambda record: seen.extend(worker_processes()))
    message = str(info.value)
    assert "client-05" in message and "round 2" in message and "boom at client-05" in message
    assert "Traceback" in message
    assert_all_gone(seen)


def test_interrupt_in_the_middle_of_a_round_stops_every_worker(make_config):
    seen: list[psutil.Process] = []

    def interrupt(server_round: int, done: int, total: int) -> None:
        seen.extend(worker_processes())
        raise KeyboardInterrupt

    config = make_config(
        backend="process",
        task="sim_tasks:SlowTask",
        task_options={"num_train": 1200, "seconds": 0.1},
    )
    with pytest.raises(KeyboardInterrupt):
        run_simulation(config, on_progress=interrupt)
    assert_all_gone(seen)


def test_a_killed_worker_is_reported_and_the_rest_are_stopped(make_config):
    seen: list[psutil.Process] = []

    def kill_one(record: dict) -> None:
        workers = worker_processes()
        seen.extend(workers)
        if record["round"] == 1:
            os.kill(workers[0].pid, signal.SIGKILL)

    with pytest.raises(SimulationError, match="died in round 2 with exit code -9"):
        run_simulation(make_config(backend="process"), on_round=kill_one)
    assert_all_gone(seen)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_workers_do_not_outlive_a_killed_driver(tmp_path, sig):
    """`kill` unwinds the CLI and stops the pool; after SIGKILL the workers notice their
    parent is gone and exit on their own, even mid-round."""
    sim = tmp_path / "sim.toml"
    run = tmp_path / "run"
    sim.write_text(
        'task = "fedtrain.examples:SyntheticTask"\nrounds = 10000\nnum_clients = 200\n'
        f'backend = "process"\nworkers = 2\nrun_dir = "{run}"\n'
        "[task_options]\nnum_train = 4000\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-m", "fedtrain.cli", "simulate", "--config", str(sim)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = worker_processes(driver.pid)
        assert len(workers) == 2
        driver.send_signal(sig)
        assert driver.wait(timeout=30) == (128 + sig if sig == signal.SIGTERM else -sig)
        assert_all_gone(workers)
    finally:
        driver.kill()
        driver.wait()
