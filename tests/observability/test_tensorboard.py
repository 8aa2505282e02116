"""TensorBoard scalars: written per round by a real simulation, read back with TensorBoard."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.observability.tensorboard import SUBDIR, TensorBoardWriter, scalars
from fedtrain.run_dir import RunDir
from fedtrain.simulation import SimConfig, run_simulation


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_simulation_writes_every_round_metric(tmp_path):
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:BreastCancerTask",
            "rounds": 2,
            "num_clients": 2,
            "run_dir": str(tmp_path / "run"),
            "tensorboard": True,
            "client": {"lr": 0.1},
            "strategy": {
                "name": "dpfedavg",
                "options": {"noise_multiplier": 0.1, "clip_norm": 5.0},
            },
        },
    )
    run_simulation(config)
    records = RunDir(tmp_path / "run").read_metrics()
    written = read_scalars(tmp_path / "run" / SUBDIR)
    for tag, key in (
        ("eval/accuracy", "accuracy"),
        ("eval/loss", "loss"),
        ("transfer/bytes", "bytes"),
        ("time/seconds", "seconds"),
        ("privacy/epsilon", "epsilon"),
        ("train/train_loss", "train_loss"),
        ("round/clients", "clients"),
    ):
        expected = [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in records]
        assert written[tag] == expected, tag
    assert written["privacy/epsilon"][1][1] > written["privacy/epsilon"][0][1] > 0


def test_scalars_take_numbers_and_list_lengths():
    record = {
        "round": 3,
        "accuracy": None,  # not evaluated this round
        "dropped": ["a", "b"],
        "aggregated": True,
        "bytes_in": 10,
        "note": "text",
    }
    assert scalars(record) == {
        "round/dropped": 2.0,
        "round/aggregated": 1.0,
        "transfer/bytes_in": 10.0,
    }


def test_missing_tensorboard_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'fedtrain\[tensorboard\]'"):
        TensorBoardWriter(tmp_path)


def test_personalized_figures_are_evaluation_scalars_and_prometheus_gauges():
    from prometheus_client import generate_latest

    from fedtrain.observability.metrics import ServerMetrics
    from fedtrain.observability.status import ServerState

    record = {"round": 3, "accuracy": 0.7, "personalized_accuracy": 0.9, "personalized_loss": 0.2}
    assert scalars(record) == {
        "eval/accuracy": 0.7,
        "eval/personalized_accuracy": 0.9,
        "eval/personalized_loss": 0.2,
    }
    state = ServerState("run", "task", "waiting", 3, 1, 5, 3, 2, False, "", False)
    metrics = ServerMetrics(lambda: state, lambda: (0, 0))
    metrics.on_round(record)
    text = generate_latest(metrics.registry).decode()
    assert "fedtrain_eval_personalized_accuracy 0.9" in text
    assert "fedtrain_eval_personalized_loss 0.2" in text
