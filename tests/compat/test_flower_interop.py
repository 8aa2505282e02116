"""A real Flower NumPyClient runs unchanged as a fedtrain task, with native results."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr")
sys.path.insert(0, str(Path(__file__).parent))

from flower_client import BreastCancerClient, native_arrays

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.simulation import SimConfig, run_simulation


def simulate(tmp_path: Path, task: str, options: dict, partition: str = "iid", n: int = 4):
    config = from_dict(
        SimConfig,
        {
            "task": task,
            "task_options": options,
            "rounds": 3,
            "num_clients": n,
            "run_dir": str(tmp_path / task.split(":")[-1]),
            "partition": {"kind": partition},
            "strategy": {"min_fit_clients": n, "min_available_clients": n},
            "client": {"epochs": 2, "lr": 0.5, "batch_size": 10_000},
        },
    )
    return run_simulation(config)


@pytest.mark.parametrize("fn", ["flower_client:client_fn", "flower_client:legacy_client_fn"])
def test_flower_client_in_simulation_matches_native(tmp_path, fn):
    flower = simulate(
        tmp_path, "fedtrain.compat.flower:FlowerTask", {"client_fn": fn, "num_partitions": 4}
    )
    native = simulate(tmp_path, "flower_client:NativeEquivalent", {})
    flower_arrays = [flower.model[k].numpy() for k in ("p0", "p1")]
    for got, want in zip(flower_arrays, native_arrays(native.model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [r["clients"] for r in flower.history] == [4, 4, 4]
    assert flower.history[-1]["partition"] == 1.0  # the client's own fit metric came through


def test_a_numpy_clients_own_evaluate_gives_the_accuracy_without_a_test_set(tmp_path):
    result = simulate(
        tmp_path,
        "fedtrain.compat.flower:FlowerTask",
        {"client_fn": "flower_client:client_fn", "num_partitions": 4},
    )
    final = result.history[-1]
    assert final["eval_source"] == "sites" and final["accuracy"] > 0.85
    arrays = [result.model[k].numpy() for k in ("p0", "p1")]
    # what each partition's client.evaluate() says of the final model, client by client
    # (a virtual client holds one partition, not necessarily its own number)
    expected = []
    for i in range(4):
        loss, n, metrics = BreastCancerClient(i, 4).evaluate(arrays, {})
        expected.append((n, loss, metrics["accuracy"]))
    got = [(s["examples"], s["loss"], s["accuracy"]) for s in final["site_metrics"].values()]
    assert len(got) == 4
    for site, client in zip(sorted(got), sorted(expected), strict=True):
        assert site == pytest.approx(client, rel=1e-6)


def test_flower_task_needs_one_partition_per_client(tmp_path):
    with pytest.raises(ConfigError, match="exactly one Flower partition"):
        simulate(
            tmp_path,
            "fedtrain.compat.flower:FlowerTask",
            {"client_fn": "flower_client:client_fn", "num_partitions": 4},
            n=2,
        )
    with pytest.raises(ConfigError, match=r"task_options\.client_fn = .* has no .nope."):
        simulate(
            tmp_path,
            "fedtrain.compat.flower:FlowerTask",
            {"client_fn": "flower_client:nope", "num_partitions": 4},
        )


def test_a_numpy_client_given_its_model_keeps_the_names_and_evaluates(tmp_path):
    options = {
        "client_fn": "flower_client:client_fn",
        "num_partitions": 4,
        "model": "flower_client:linear_model",  # the arrays are Linear's state_dict, in order
        "evaluate": True,  # every partition's client evaluates the global model
    }
    flower = simulate(tmp_path, "fedtrain.compat.flower:FlowerTask", options)
    native = simulate(tmp_path, "flower_client:NativeEquivalent", {})
    assert list(flower.model) == ["weight", "bias"]
    for name in ("weight", "bias"):
        np.testing.assert_allclose(flower.model[name], native.model[name], rtol=1e-5, atol=1e-6)
    assert all(r["accuracy"] is not None for r in flower.history)
    assert flower.history[-1]["accuracy"] > 0.85
