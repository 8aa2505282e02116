"""A Keras model runs through the Flower NumPyClient interop in a simulation and in a
real deployment, and its export loads back into Keras by weight name. Needs TensorFlow
(the `keras` extra): skipped without it, as in CI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr")
pytest.importorskip("tensorflow")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # Deployment
sys.path.insert(0, str(ROOT / "simulations"))  # keras_eval

import tomllib  # noqa: E402
from keras_eval import evaluate  # noqa: E402
from runtime_support import Deployment  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fedtrain.config import from_dict  # noqa: E402
from fedtrain.examples.keras_flower import parameter_names  # noqa: E402
from fedtrain.simulation import SimConfig, run_simulation  # noqa: E402

pytestmark = pytest.mark.timeout(300)
CONFIG = tomllib.loads((ROOT / "simulations" / "keras_breast_cancer.toml").read_text())


def test_a_keras_model_trains_in_a_simulation_and_exports_under_keras_names(tmp_path):
    raw = {**CONFIG, "rounds": 4, "run_dir": str(tmp_path / "run")}
    result = run_simulation(from_dict(SimConfig, raw))
    assert [r["round"] for r in result.history] == [1, 2, 3, 4]
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert sorted(load_file(tmp_path / "run" / "model.safetensors")) == sorted(parameter_names())
    assert evaluate(tmp_path / "run") > 0.9


@pytest.mark.integration
def test_a_keras_model_trains_at_the_sites_of_a_deployment(tmp_path):
    options = {**CONFIG["task_options"], "num_partitions": 2}
    with Deployment(
        tmp_path,
        CONFIG["task"],
        secure=False,
        rounds=3,
        task_options=options,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        client=CONFIG["client"],
    ) as dep:
        dep.start_server()
        for i, name in enumerate(("hospital-a", "hospital-b")):
            dep.start_site(
                name,
                task_options=options,
                data={"source": "task", "options": {"partition-id": i}},
            )
        assert dep.wait_server(240) == 0, dep.log("server")
        dep.close()
    metrics = dep.metrics()
    assert [r["clients"] for r in metrics] == [2, 2, 2]
    assert sorted(load_file(dep.run_dir / "model.safetensors")) == sorted(parameter_names())
    assert evaluate(dep.run_dir) > 0.9
