"""Sites that train on files configured in site.toml alone, in a real deployment.

`fedtrain server` and two `fedtrain client` processes on 127.0.0.1: hospital-a reads
a Hive-partitioned Parquet folder (as Spark writes it) and holds out a fifth of it,
hospital-b a CSV export with text labels and a held-out CSV. The task is the bundled
breast-cancer model; no line of data code. The server logs to a local MLflow store,
read back with MLflow's client.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pcsv = pytest.importorskip("pyarrow.csv")
mlflow_tracking = pytest.importorskip("mlflow.tracking")

from runtime_support import Deployment  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fedtrain.examples import BreastCancerTask  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

FEATURES = [f"f{i}" for i in range(30)]
CLASSES = ["benign", "malignant"]


def write_files(root: Path) -> tuple[dict, dict]:
    """The breast-cancer training set split between two hospitals' files."""
    x, y = BreastCancerTask().datasets()[0].tensors
    x, y = x.numpy(), y.numpy()
    half = len(y) // 2
    columns = {name: x[:half, i] for i, name in enumerate(FEATURES)}
    ward = np.arange(half) % 3 + 1
    lake = root / "lake"
    table = pa.table({**columns, "diagnosis": y[:half], "ward": ward})
    pq.write_to_dataset(table, lake, partition_cols=["ward"])
    (lake / "_SUCCESS").touch()
    text = np.array(CLASSES)[y[half:]]
    b = {name: x[half:, i] for i, name in enumerate(FEATURES)}
    cut = half + (len(y) - half) * 4 // 5
    pcsv.write_csv(
        pa.table({**{k: v[: cut - half] for k, v in b.items()}, "label": text[: cut - half]}),
        root / "b.csv",
    )
    pcsv.write_csv(
        pa.table({**{k: v[cut - half :] for k, v in b.items()}, "label": text[cut - half :]}),
        root / "b-eval.csv",
    )
    site_a = {
        "source": "parquet",
        "path": "${HOSPITAL_A_DATA}",  # from the environment, as in a pod
        "features": FEATURES,
        "label": "diagnosis",
        "eval_fraction": 0.2,
    }
    site_b = {
        "source": "csv",
        "path": str(root / "b.csv"),
        "label": "label",
        "classes": CLASSES,
        "eval_path": str(root / "b-eval.csv"),
    }
    return site_a, site_b


def test_sites_train_from_a_partitioned_parquet_folder_and_a_csv_and_the_server_logs_to_mlflow(
    tmp_path: Path, monkeypatch
):
    site_a, site_b = write_files(tmp_path / "data")
    monkeypatch.setenv("HOSPITAL_A_DATA", str(tmp_path / "data" / "lake"))
    with Deployment(
        tmp_path,
        "fedtrain.examples:BreastCancerTask",
        secure=False,
        rounds=3,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        client={"epochs": 2, "batch_size": 32, "lr": 0.1},
        evaluate="sites",  # the sites' held-out rows (eval_fraction, eval_path) evaluate
        tracking={"mlflow": True},
    ) as dep:
        dep.env["HOSPITAL_A_DATA"] = str(tmp_path / "data" / "lake")
        dep.start_server()
        dep.start_site("hospital-a", data=site_a)
        dep.start_site("hospital-b", data=site_b)
        assert dep.wait_server(150) == 0, dep.log("server")
        logs = {name: dep.log(name) for name in ("hospital-a", "hospital-b")}
        dep.close()
    assert "from 3 parquet file(s)" in logs["hospital-a"], logs["hospital-a"][-2000:]
    assert "from 1 csv file(s)" in logs["hospital-b"], logs["hospital-b"][-2000:]
    assert "held-out set (" in logs["hospital-a"] and "held-out set (" in logs["hospital-b"]
    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert all(r["clients"] == 2 for r in metrics)
    sites = metrics[-1]["site_metrics"]
    assert sorted(sites) == ["hospital-a", "hospital-b"]
    assert all(0.8 < s["accuracy"] <= 1.0 for s in sites.values())  # their held-out rows
    exported = load_file(dep.run_dir / "model.safetensors")
    assert sorted(exported) == ["bias", "weight"]
    card = json.loads((dep.run_dir / "model.json").read_text())

    client = mlflow_tracking.MlflowClient(
        tracking_uri=f"sqlite:///{dep.run_dir.resolve() / 'mlflow' / 'mlflow.db'}"
    )
    (run,) = client.search_runs([client.get_experiment_by_name("fedtrain").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["fedtrain.run_id"] == card["run_id"]
    assert run.data.tags["fedtrain.task_fingerprint"] == card["task_fingerprint"]
    assert run.data.params["strategy.min_fit_clients"] == "2"
    history = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [m.step for m in history] == [1, 2, 3]
    for site in ("hospital-a", "hospital-b"):
        part = client.get_metric_history(run.info.run_id, f"site/{site}/contributed")
        assert [(m.step, m.value) for m in part] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"model.safetensors", "model.json", "audit.jsonl", "metrics.jsonl", "report"} <= files
    assert torch.equal(
        exported["weight"], torch.load(dep.run_dir / "model.pt", weights_only=True)["weight"]
    )
