"""Real Flower clients train at the sites of a real deployment (`fedtrain server` +
`fedtrain client` processes): a NumPyClient ends with the model its native fedtrain
equivalent gets, and a Message-API ClientApp (examples/flower-digits) runs unchanged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # flower_client
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # Deployment

from flower_client import NativeEquivalent
from runtime_support import Deployment

from fedtrain.config import load_toml
from fedtrain.errors import ConfigError
from fedtrain.task import TaskContext

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]

SITES = ("hospital-a", "hospital-b")
RUN = {
    "rounds": 3,
    "strategy": {"min_fit_clients": 2, "min_available_clients": 2},
    "client": {"epochs": 2, "lr": 0.5, "batch_size": 10_000},  # full batch, as the client
}
FLOWER = {
    "client_fn": "flower_client:client_fn",
    "num_partitions": 2,
}


def deploy(root: Path, task: str, data: list[dict], **server) -> tuple[dict, list[dict]]:
    """Run a 2-site insecure deployment to the end; the final model and metrics.jsonl."""
    with Deployment(root, task, secure=False, **{**RUN, **server}) as dep:
        dep.start_server()
        for name, site_data in zip(SITES, data, strict=True):
            dep.start_site(name, data=site_data, task_options=server.get("task_options", {}))
        assert dep.wait_server(120) == 0, dep.log("server")
        dep.close()
    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert all(r["clients"] == 2 for r in metrics)
    return torch.load(dep.run_dir / "model.pt", weights_only=True), metrics


def test_flower_client_in_a_deployment_matches_native(tmp_path) -> None:
    flower, flower_metrics = deploy(
        tmp_path / "flower",
        "fedtrain.compat.flower:FlowerTask",
        [{"source": "task", "options": {"partition-id": i}} for i in range(2)],
        task_options=FLOWER,
    )
    native, native_metrics = deploy(
        tmp_path / "native",
        "flower_client:NativeEquivalent",
        [{"partition": i, "num_partitions": 2} for i in range(2)],
    )
    assert sorted(flower) == ["p0", "p1"]
    np.testing.assert_allclose(flower["p0"], native["weight"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flower["p1"], native["bias"], rtol=1e-5, atol=1e-6)

    task = NativeEquivalent()
    model = task.model()
    model.load_state_dict({"weight": flower["p0"], "bias": flower["p1"]})
    context = TaskContext(device=torch.device("cpu"), client_id="test", seed=0)
    flower_acc = task.evaluate(model, task.datasets()[1], {}, context).metrics["accuracy"]
    native_acc = native_metrics[-1]["accuracy"]
    assert flower_acc == pytest.approx(native_acc, abs=1e-9)
    assert flower_acc > 0.85
    # the server has no test set: each site's NumPyClient.evaluate() gave the accuracy
    final = flower_metrics[-1]
    assert final["eval_source"] == "sites" and sorted(final["site_metrics"]) == list(SITES)
    assert final["accuracy"] > 0.85


def test_a_site_must_name_its_flower_partition() -> None:
    from fedtrain.compat.flower import FlowerTask

    task = FlowerTask("flower_client:client_fn", num_partitions=2)
    with pytest.raises(ConfigError, match="partition-id"):
        task.site_data("hospital-a")
    with pytest.raises(ConfigError, match=r"must be in \[0, 2\)"):
        task.site_data("hospital-a", **{"partition-id": 2})
    mine = task.site_data("hospital-b", **{"partition-id": 1})
    for data in (mine.train, mine.test):  # the client's evaluate() is its held-out set
        assert [data[i] for i in range(len(data))] == [1]
    client = task.client(1)
    assert client is task.client(1)  # built once


@pytest.mark.slow  # long scenario (17 s): the example's own files; -m slow
def test_the_example_client_app_deployment_runs_from_its_config_files(tmp_path) -> None:
    """examples/flower-digits' server.toml and site-*.toml (the app unchanged, each site one
    Flower partition, lr halved every 2 rounds), on a free port: the final model keeps
    Net's names and training converges."""
    from flowerdigits.task import Net

    example = ROOT / "examples" / "flower-digits"
    server = load_toml(example / "server.toml")
    for key in ("address", "run_dir"):  # the Deployment picks a free port and a tmp dir
        del server[key]
    task = server.pop("task")
    absolute = str(example / "pyproject.toml")  # the processes' working directory varies
    server["task_options"]["app_config"] = absolute
    server["rounds"] = 3
    with Deployment(tmp_path, task, secure=False, **server) as dep:
        dep.start_server()
        for i in range(2):
            site = load_toml(example / f"site-{i}.toml")
            assert (
                site["task"] == task
                and site["task_options"]["clientapp"] == (server["task_options"]["clientapp"])
            )
            site["task_options"]["app_config"] = absolute
            dep.start_site(f"site-{i}", data=site["data"], task_options=site["task_options"])
        assert dep.wait_server(150) == 0, dep.log("server")
        dep.close()
    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert all(r["clients"] == 2 and r["train_loss"] > 0 for r in metrics)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    model = torch.load(dep.run_dir / "model.pt", weights_only=True)
    assert list(model) == list(Net().state_dict())
    Net().load_state_dict(model)
