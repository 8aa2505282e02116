"""Final models as safetensors with the task's names and a card; `fedtrain export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedtrain.cli import main
from fedtrain.compat.flower import FlowerTask
from fedtrain.config import from_dict
from fedtrain.errors import ConfigError, TaskError
from fedtrain.export import exported_state
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

SIM = {
    "task": "fedtrain.examples:BreastCancerTask",
    "rounds": 2,
    "num_clients": 3,
    "strategy": {"min_fit_clients": 3, "min_available_clients": 3},
    "client": {"epochs": 1, "batch_size": 64, "lr": 0.1},
}


def simulate(run_dir: Path) -> None:
    run_simulation(from_dict(SimConfig, {**SIM, "run_dir": str(run_dir)}))


def test_a_simulation_ends_with_safetensors_under_the_task_names_and_a_card(tmp_path: Path):
    simulate(tmp_path / "run")
    tensors = load_file(tmp_path / "run" / "model.safetensors")
    legacy = torch.load(tmp_path / "run" / "model.pt", weights_only=True)  # still works
    assert sorted(tensors) == ["bias", "weight"] == sorted(legacy)
    assert all(torch.equal(tensors[k], legacy[k]) for k in legacy)
    card = json.loads((tmp_path / "run" / "model.json").read_text())
    from fedtrain.examples import BreastCancerTask

    assert card["task"] == SIM["task"] and card["round"] == 2
    assert card["task_fingerprint"] == task_fingerprint(BreastCancerTask())
    assert 0.8 < card["metrics"]["accuracy"] <= 1 and len(card["run_id"]) == 12
    assert card["tensors"]["weight"] == {"dtype": "float32", "shape": [2, 30]}
    with safe_open(tmp_path / "run" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["fedtrain"])["run_id"] == card["run_id"]


def test_fedtrain_export_rewrites_a_run_dir_that_has_only_model_pt(tmp_path: Path, capsys):
    run = tmp_path / "run"
    simulate(run)
    card = json.loads((run / "model.json").read_text())
    (run / "model.safetensors").unlink()
    (run / "model.json").unlink()
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    again = json.loads((tmp_path / "out" / "model.json").read_text())
    assert again["round"] == 2 and again["metrics"] == card["metrics"]
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["bias", "weight"]


def test_export_of_a_directory_without_a_model_says_so(tmp_path: Path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"task": SIM["task"]}))
    assert main(["export", str(tmp_path)]) == 2
    assert "neither model.pt nor a checkpoint" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a fedtrain run directory"):
        from fedtrain.export import export_run

        export_run(tmp_path / "nothing-here")


def _two_arrays(context):
    import numpy as np

    class Client:
        def get_parameters(self, config):
            return [np.ones((2, 3), np.float32), np.zeros(2, np.float32)]

        fit = evaluate = None

    client = Client()
    client.fit = client.evaluate = lambda *a: None
    return client


def test_a_flower_apps_export_carries_its_parameter_names():
    names = ["fc.weight", "fc.bias"]
    task = FlowerTask(_two_arrays, num_partitions=1, parameter_names=names)
    state = ModelState.from_module(task.model())
    tensors, renamed = exported_state(task, state)
    assert sorted(tensors) == sorted(names) and renamed == {"p0": "fc.weight", "p1": "fc.bias"}
    assert tensors["fc.weight"].shape == (2, 3)
    module = sys.modules[__name__]
    module.NAMES = lambda: names  # "module:function" returning the names
    by_ref = FlowerTask(_two_arrays, 1, parameter_names=f"{__name__}:NAMES")
    assert exported_state(by_ref, state)[0].keys() == tensors.keys()
    too_many = FlowerTask(_two_arrays, 1, parameter_names=[*names, "extra"])
    with pytest.raises(TaskError, match=r"names \['p2'\], which the model does not have"):
        exported_state(too_many, state)


def test_tied_weights_are_exported_as_separate_tensors():
    shared = torch.arange(6.0).reshape(2, 3)
    state = ModelState({"embed.weight": shared, "head.weight": shared})
    tensors, _ = exported_state(FlowerTask(_two_arrays, 1), state)
    assert tensors["embed.weight"].data_ptr() != tensors["head.weight"].data_ptr()
    assert torch.equal(tensors["embed.weight"], tensors["head.weight"])


def test_export_of_an_unfinished_server_run_takes_its_checkpoint_and_run_id(tmp_path: Path):
    from fedtrain.examples import BreastCancerTask
    from fedtrain.run_dir import RunDir
    from fedtrain.task import model_for

    run = RunDir(tmp_path / "run")
    run.write_config({"task": SIM["task"], "task_options": {}})
    state = ModelState.from_module(model_for(BreastCancerTask(), 0))
    run.save_checkpoint(4, state, {}, extra={"run_id": "abc123def456"})
    run.log_metrics({"round": 4, "accuracy": 0.75, "dropped": ["x"]})
    assert main(["export", str(run.path)]) == 0
    card = json.loads((run.path / "model.json").read_text())
    assert (card["round"], card["run_id"], card["metrics"]) == (
        4,
        "abc123def456",
        {"round": 4.0, "accuracy": 0.75},
    )
    assert torch.equal(load_file(run.path / "model.safetensors")["weight"], state["weight"])
    assert not run.model_path.exists()  # an export never marks a run complete
