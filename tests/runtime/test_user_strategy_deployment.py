"""A user's own strategy (examples/mylab, outside fedtrain) and a learning-rate schedule
in a real deployment: `fedtrain server` + two `fedtrain client` processes, the server
killed mid-run and resumed with `--resume`.

`mylab` is importable by the server process because pytest's `pythonpath` puts
examples/ on sys.path, which `Deployment` hands to its processes as PYTHONPATH.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from runtime_support import Deployment, wait_for

from fedtrain.run_dir import RunDir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

STRATEGY = {
    "name": "mylab.strategies:WarmupCosineFedAvgM",
    "min_fit_clients": 2,
    "min_available_clients": 2,
    "options": {"server_lr": 1.0, "warmup_rounds": 2, "total_rounds": 6, "momentum": 0.5},
}


def test_a_user_strategy_and_an_lr_schedule_run_are_checkpointed_and_resume(tmp_path: Path):
    with Deployment(
        tmp_path,
        "runtime_support:LrProbeTask",
        secure=False,
        strategy=STRATEGY,
        rounds=6,
        client={"epochs": 1, "batch_size": 16, "lr": 0.2},
        client_schedule={"lr": {"decay": "step", "gamma": 0.5, "step_size": 2}},
    ) as dep:
        dep.start_server()
        for name in ("a", "b"):
            dep.start_site(name, task_options={"delay_s": 0.3})
        wait_for(lambda: dep.checkpointed() >= 2, 60, "two rounds checkpointed")
        dep.procs.stop("server", signal.SIGKILL)
        killed_at = dep.checkpointed()
        assert 2 <= killed_at < 6
        _, _, strategy_state, _ = RunDir(dep.run_dir).load_checkpoint()
        assert strategy_state["steps"] == killed_at
        assert set(strategy_state["velocity"]) == {"weight", "bias"}  # momentum is saved
        dep.start_server(resume=True, name="server-resumed")
        assert dep.wait_server(90, name="server-resumed") == 0, dep.log("server-resumed")
        dep.close()

    metrics = {r["round"]: r for r in dep.metrics()}
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    # The strategy's clock continued from the checkpoint (a fresh one would restart at 1).
    assert [metrics[r]["server_steps"] for r in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    server_lrs = [1.0 * 1 / 2, 1.0, 0.8535534, 0.5, 0.1464466, 0.0]  # warmup, then cosine
    assert [metrics[r]["server_lr"] for r in range(1, 7)] == pytest.approx(server_lrs)
    # What the sites trained with: [client_schedule] (0.2, halved every 2 rounds), then
    # the strategy's round_config (x 1/2 in warmup step 1), before and after the resume.
    lrs = [0.2 * 1 / 2, 0.2, 0.1, 0.1, 0.05, 0.05]
    assert [metrics[r]["lr_used"] for r in range(1, 7)] == pytest.approx(lrs)
    assert "resuming run" in dep.log("server-resumed")
