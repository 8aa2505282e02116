"""LoRA fine-tuning of a small generated GPT-2 across 3 sites: the figures of
simulations/RESULTS.md ("Fine-tuning a foundation model").

    PYTHONPATH=.:tests:tests/runtime python simulations/lora_finetune.py baselines /tmp/lora
    PYTHONPATH=.:tests:tests/runtime python simulations/lora_finetune.py deployment /tmp/lora

`baselines`: each site LoRA-fine-tunes alone on its own reports (local-only), and one
model LoRA-fine-tunes on everyone's reports pooled (centralized), for the same number
of epochs over its data as the federation trains; both report perplexity on every
site's held-out reports. `deployment`: the federation itself, as real `fedtrain
server` / `fedtrain client` processes on 127.0.0.1 over mutual TLS with secure
aggregation on; the final adapters are then evaluated on every site's held-out
reports, and the bytes each site uploaded per round come from the audit log. With
`--full` the same deployment fine-tunes every weight (no LoRA), for the bytes side by
side. Everything is generated and seeded: the base model is built once under ROOT/base
and every process loads it from there. CPU only, a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only contend

import torch

from fedtrain.finetune import GeneratedReportsTask
from fedtrain.task import TaskContext, federated_names, model_for

TASK = "fedtrain.finetune:GeneratedReportsTask"
SITES = ("cardiology", "neurology", "oncology")
ROUNDS = 20
CLIENT = {"epochs": 2, "batch_size": 8, "lr": 0.01}


def options(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "base": str(root / "base"),
        "sites": list(SITES),
        "train_per_site": 40,
        "test_per_site": 100,
        "lora_rank": 8,
        "lora_alpha": 16.0,
        **extra,
    }


def perplexities(task: GeneratedReportsTask, model: torch.nn.Module) -> dict[str, float]:
    """Perplexity of `model` on every site's held-out reports."""
    out = {}
    for i, site in enumerate(SITES):
        held_out = task.site_data(site, i).test
        assert held_out is not None
        out[site] = task.evaluate(model, held_out, {}, TaskContext()).metrics["perplexity"]
    return out


def fine_tune(task: GeneratedReportsTask, data: Any) -> torch.nn.Module:
    """LoRA from the same initial adapters as the federation, ROUNDS x epochs."""
    model = model_for(task, 0)
    for r in range(1, ROUNDS + 1):
        task.train(model, data, {**CLIENT, "round": r}, TaskContext(client_id="alone"))
    return model


def baselines(root: Path) -> dict[str, Any]:
    task = GeneratedReportsTask(**options(root))
    base = perplexities(task, model_for(task, 0))
    local = {}
    for i, site in enumerate(SITES):
        local[site] = perplexities(task, fine_tune(task, task.site_data(site, i).train))[site]
    central = perplexities(task, fine_tune(task, task.datasets()[0]))
    return {"base": base, "local_only": local, "centralized": central}


def deployment(root: Path, full: bool) -> dict[str, Any]:
    from runtime_support import Deployment

    from fedtrain.run_dir import load_state
    from fedtrain.runtime.server.audit import read_audit

    opts = options(root, full_finetune=True) if full else options(root)
    task = GeneratedReportsTask(**opts)
    model_for(task, 0)  # build the base once, before any process needs it
    rounds = 2 if full else ROUNDS
    where = root / ("full" if full else "lora")
    started = time.time()
    with Deployment(
        where,
        TASK,
        secure=True,
        rounds=rounds,
        task_options=opts,
        allowed_sites=list(SITES),
        strategy={"min_fit_clients": 3, "min_available_clients": 3},
        client=CLIENT,
        evaluate="off",
        secagg={"enabled": True, "clip": 1.0, "max_clients": 8, "max_weight": 1000.0},
    ) as dep:
        dep.start_server()
        for i, site in enumerate(SITES):
            dep.start_site(
                site,
                task_options=opts,
                require_secagg=True,
                data={"source": "task", "options": {"site": i}},
            )
        assert dep.wait_server(1800) == 0, dep.log("server")
    seconds = time.time() - started
    uploads = [r for r in read_audit(where / "run" / "audit.jsonl") if r["event"] == "upload"]
    model = model_for(task, 0)
    load_state(where / "run" / "model.pt").load_into(model, federated_names(task, model))
    return {
        "perplexity": perplexities(task, model),
        "upload_bytes_per_site_round": sorted({r["bytes"] for r in uploads}),
        "uploads": len(uploads),
        "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("baselines", "deployment"))
    parser.add_argument("root", type=Path)
    parser.add_argument("--full", action="store_true", help="full fine-tuning (bytes only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.root.mkdir(parents=True, exist_ok=True)
    result = baselines(args.root) if args.mode == "baselines" else deployment(args.root, args.full)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
