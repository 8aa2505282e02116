"""A Flower Message-API ClientApp runs unchanged as a fedtrain task, in simulation.

`flowerdigits` (examples/flower-digits, on sys.path through pytest's `pythonpath`) is
written the way Flower's quickstart-pytorch is; `probe_app` reports what it was sent.
The deployment side is in test_flower_deployment.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # flower_client

from flowerdigits.task import Net

from fedtrain.config import from_dict, load_toml
from fedtrain.errors import ConfigError, TaskError
from fedtrain.simulation import SimConfig, run_simulation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower-digits" / "sim.toml"
APP = "fedtrain.compat.flower_app:FlowerClientApp"


def test_the_quickstart_style_app_runs_from_the_example_config(tmp_path, monkeypatch):
    """Exactly the README's command: the example sim.toml, run from the repository root."""
    monkeypatch.chdir(ROOT)  # app_config is a path from the working directory
    raw = load_toml(EXAMPLE)
    raw["run_dir"] = str(tmp_path / "run")
    result = run_simulation(from_dict(SimConfig, raw))
    history = result.history
    assert [r["round"] for r in history] == [1, 2, 3, 4, 5]
    assert all(r["clients"] == 4 and r["train_loss"] > 0 for r in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["accuracy"] > 0.7  # every partition's @app.evaluate(), weighted
    assert history[-1]["loss"] < history[0]["loss"]
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert list(saved) == list(Net().state_dict())  # the app's own names: conv1.weight, ...
    Net().load_state_dict(saved)


def simulate(tmp_path, options: dict, rounds: int = 3, **extra) -> list[dict]:
    config = {
        "task": APP,
        "task_options": {"num_partitions": 2, **options},
        "rounds": rounds,
        "num_clients": 2,
        "run_dir": str(tmp_path / "run"),
        "strategy": {"min_fit_clients": 2, "min_available_clients": 2},
        "client": {"lr": 0.4, "epochs": 1},
        **extra,
    }
    return run_simulation(from_dict(SimConfig, config)).history


PROBE = {
    "clientapp": "flower_client:probe_app",
    "model": "flower_client:linear_model",
    "run_config": {"batch-size": 16},
}


def test_the_round_config_record_follows_the_schedule_and_the_context_persists(tmp_path):
    history = simulate(
        tmp_path,
        PROBE,
        rounds=4,
        client_schedule={"lr": {"decay": "exponential", "gamma": 0.5}},
    )
    assert [r["lr_seen"] for r in history] == pytest.approx([0.4, 0.2, 0.1, 0.05])
    assert [r["server_round"] for r in history] == [1, 2, 3, 4]
    assert [r["calls"] for r in history] == [1, 2, 3, 4]  # Context.state across rounds
    assert all(r["batch_seen"] == 16 for r in history)  # context.run_config


def test_run_config_comes_from_the_apps_pyproject_and_task_options_override_it(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("[tool.flwr.app.config]\nbatch-size = 8\nlocal-epochs = 3\n")
    options = {**PROBE, "app_config": str(pyproject), "run_config": {}}
    assert simulate(tmp_path, options, rounds=1)[0]["batch_seen"] == 8
    options["run_config"] = {"batch-size": 4}
    assert simulate(tmp_path, options, rounds=1)[0]["batch_seen"] == 4


def test_a_run_config_key_nobody_set_is_a_clear_error_naming_the_option(tmp_path):
    """The canonical quickstart's failure: the app reads run_config["local-epochs"]."""
    options = {
        "clientapp": "flowerdigits.client_app:app",
        "model": "flowerdigits.task:Net",
        "run_config": {"batch-size": 32},
    }
    with pytest.raises(ConfigError, match=r"run_config\['local-epochs'\].*task_options") as info:
        simulate(tmp_path, options, rounds=1)
    assert isinstance(info.value, KeyError)  # an app that catches KeyError still can
    assert "[tool.flwr.app.config]" in str(info.value)


def test_a_round_config_key_nobody_set_names_the_client_table(tmp_path):
    with pytest.raises(ConfigError, match=r"reads 'lr' from the round's config.*\[client\]"):
        simulate(tmp_path, PROBE, rounds=1, client={"epochs": 1})


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"clientapp": "flower_client:client_fn"}, ConfigError, "not a flwr.clientapp.ClientApp"),
        ({"clientapp": "flower_client:nope"}, ConfigError, r"task_options\.clientapp.*has no"),
        ({"model": "flower_client:client_fn"}, ConfigError, r"task_options\.model"),
        ({"clientapp": "flower_client:broken_app"}, TaskError, "'num-examples' = None"),
    ],
)
def test_bad_apps_and_replies_say_what_is_wrong(tmp_path, options, error, message):
    with pytest.raises(error, match=message):
        simulate(tmp_path, {**PROBE, **options}, rounds=1)


def test_the_app_runs_on_the_process_backend_with_its_context_kept_per_worker(tmp_path):
    """Workers get the task as references and options (the ClientApp is imported there);
    a partition always trains on the same worker, so its Context.state persists."""
    history = simulate(tmp_path, PROBE, rounds=2, backend="process", workers=2)
    assert [r["calls"] for r in history] == [1, 2]
    assert [r["lr_seen"] for r in history] == [0.4, 0.4]
