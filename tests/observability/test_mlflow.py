"""MLflow tracking: a simulation logs to a real local store, read back with MLflow's client."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.observability.mlflow_tracking import MlflowTracker, TrackingConfig
from fedtrain.simulation import SimConfig, run_simulation

SIM = {
    "task": "fedtrain.examples:BreastCancerTask",
    "rounds": 3,
    "num_clients": 4,
    "strategy": {
        "name": "dpfedavg",
        "min_fit_clients": 4,
        "min_available_clients": 4,
        "options": {"noise_multiplier": 0.1, "clip_norm": 5.0},
    },
    "client": {"epochs": 1, "batch_size": 64, "lr": 0.1},
}


def only_run(uri: str):
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedtrain")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_a_simulation_logs_params_metrics_per_round_and_artifacts(tmp_path: Path):
    run_dir = tmp_path / "run"
    config = from_dict(SimConfig, {**SIM, "run_dir": str(run_dir), "tracking": {"mlflow": True}})
    result = run_simulation(config)
    uri = f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}"
    client, run = only_run(uri)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["rounds"] == "3" and params["strategy.name"] == "dpfedavg"
    assert params["client.lr"] == "0.1" and params["strategy.options.noise_multiplier"] == "0.1"
    tags = run.data.tags
    assert tags["fedtrain.run_dir"] == str(run_dir.resolve())
    assert tags["fedtrain.driver"] == "simulation" and len(tags["fedtrain.task_fingerprint"]) == 16
    accuracy = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [m.step for m in accuracy] == [1, 2, 3]
    assert [m.value for m in accuracy] == [r["accuracy"] for r in result.history]
    epsilon = client.get_metric_history(run.info.run_id, "privacy/epsilon")
    assert [m.step for m in epsilon] == [1, 2, 3] and epsilon[0].value < epsilon[-1].value
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "metrics.jsonl", "model.safetensors", "model.json", "report"} <= files
    report = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert "report/index.html" in report and "report/accuracy.png" in report
    # artifacts live beside the store, not in the working directory
    assert run.info.artifact_uri.startswith((run_dir.resolve() / "mlflow").as_uri())


def test_a_second_simulation_in_the_same_run_dir_is_a_new_mlflow_run(tmp_path: Path):
    raw = {**SIM, "rounds": 1, "run_dir": str(tmp_path / "run"), "tracking": {"mlflow": True}}
    for _ in range(2):
        run_simulation(from_dict(SimConfig, raw))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fedtrain")
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_a_tracking_store_that_fails_mid_run_costs_a_warning_not_the_run(tmp_path, caplog):
    tracker = MlflowTracker(TrackingConfig(mlflow=True), tmp_path, params={}, tags={})

    def refuse(*args, **kwargs):
        raise ConnectionError("tracking server went away")

    tracker._client.log_batch = refuse  # type: ignore[method-assign]
    tracker({"round": 1, "accuracy": 0.5})
    tracker.on_audit("round_completed", {"round": 1, "contributors": ["a"]})
    assert "training goes on" in caplog.text and "went away" in caplog.text
    tracker.end()


def test_a_tracking_store_that_cannot_be_opened_is_a_config_error_naming_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'not-a-dir' / 'x' / 'mlflow.db'}"
    (tmp_path / "not-a-dir").write_text("a file where a folder should be")
    with pytest.raises(ConfigError, match=r"tracking: cannot open an MLflow run in sqlite"):
        MlflowTracker(TrackingConfig(mlflow_uri=uri), tmp_path / "run", params={}, tags={})
