"""3 sites LoRA-fine-tune as real `fedtrain server` / `fedtrain client` processes over
mutual TLS with secure aggregation: only the adapters travel. (The figures of
simulations/RESULTS.md come from simulations/lora_finetune.py, the same setup longer.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_support import Deployment

from fedtrain.finetune import GeneratedReportsTask
from fedtrain.runtime.server.audit import read_audit
from fedtrain.task import federated_names, model_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SITES = ("cardiology", "neurology", "oncology")


def test_three_sites_upload_only_masked_adapters_each_round(tmp_path: Path) -> None:
    options = {
        "base": str(tmp_path / "base"),
        "base_size": {"n_embd": 32, "n_layer": 1, "n_head": 2, "steps": 20},
        "train_per_site": 24, "test_per_site": 16, "lora_rank": 4,
    }  # fmt: skip
    task = GeneratedReportsTask(**options)
    model = model_for(task, 0)  # the base, built once before any process needs it
    names = federated_names(task, model)
    assert names is not None
    adapters = sum(model.state_dict()[n].numel() for n in names)
    with Deployment(
        tmp_path / "dep",
        "fedtrain.finetune:GeneratedReportsTask",
        rounds=2,
        task_options=options,
        allowed_sites=list(SITES),
        strategy={"min_fit_clients": 3, "min_available_clients": 3},
        client={"lr": 0.02, "batch_size": 8},
        evaluate="off",
        secagg={"enabled": True, "clip": 1.0, "max_clients": 8, "max_weight": 1000.0},
    ) as dep:
        dep.start_server()
        for i, site in enumerate(SITES):
            dep.start_site(
                site, task_options=options, require_secagg=True,
                data={"source": "task", "options": {"site": i}},
            )  # fmt: skip
        assert dep.wait_server(300) == 0, dep.log("server")
    uploads = [
        r for r in read_audit(tmp_path / "dep" / "run" / "audit.jsonl") if r["event"] == "upload"
    ]
    assert len(uploads) == 6 and all(r["masked"] for r in uploads)
    # a masked value is a uint32, plus the masked weight: the base never travels
    assert {r["bytes"] for r in uploads} == {4 * adapters + 4}
