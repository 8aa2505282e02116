"""Memory per rank of a site's model: whole (DDP) vs sharded (FSDP) across 2 gloo ranks.

    PYTHONPATH=. python -m benchmarks.fsdp_memory /tmp/fsdp-base

The generated GPT-2-style base (`fedtrain.finetune`), wider than the tests' (width
256, 4 layers) with LoRA rank 8, built once under the directory given. Each rank
reports the bytes of parameters and buffers it holds after one training round of
2 x 8 reports; with `fsdp` it holds 1/2 of every weight. (Each rank still builds the
whole model before sharding it: a meta-device build is not done yet.)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fedtrain.finetune import GeneratedReportsTask
from fedtrain.parallel.sharding import local_bytes, shard_module
from fedtrain.task import TaskContext, model_for

SIZE = {"n_embd": 256, "n_layer": 4, "n_head": 4, "steps": 10}


def _rank(rank: int, base: str, sharding: str, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    task = GeneratedReportsTask(base, base_size=SIZE, train_per_site=16, lora_rank=8)
    module = model_for(task, 0)
    model: torch.nn.Module = module
    if sharding == "fsdp":
        shard_module(module, torch.device("cpu"), 2)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
    context = TaskContext(rank=rank, world_size=2)
    task.train(model, task.site_data("x", 0).train, {"batch_size": 8}, context)
    out[f"{sharding} rank {rank}"] = local_bytes(module)
    dist.destroy_process_group()


def main(base: str) -> None:
    model_for(GeneratedReportsTask(base, base_size=SIZE, lora_rank=8), 0)  # build the base once
    with mp.Manager() as manager:
        out = manager.dict()
        for i, sharding in enumerate(("ddp", "fsdp")):
            mp.spawn(_rank, args=(base, sharding, 29700 + i, out), nprocs=2)
        print(json.dumps(dict(out), indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
