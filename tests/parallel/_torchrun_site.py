"""A site under torchrun's launch contract: rank 0 drives the group as a daemon would,
the other ranks follow. Rank 0 saves its round's result to argv[1]."""

from __future__ import annotations

import os
import sys

import torch
from _ddp_tasks import CONFIG, SEED, SITE, ToyTask

from fedtrain.parallel import WorkerGroup, follower_main, launched_by_torchrun
from fedtrain.task import model_for
from fedtrain.tensors import ModelState

TASK = "_ddp_tasks:ToyTask"

if __name__ == "__main__":
    assert launched_by_torchrun()
    if int(os.environ["RANK"]) != 0:
        sys.exit(follower_main(TASK, {"n": 96}, seed=SEED, client_id=SITE))
    start = ModelState.from_module(model_for(ToyTask(), 11))
    with WorkerGroup.from_env(TASK, {"n": 96}, seed=SEED, client_id=SITE) as group:
        rounds = [group.train_round(start, CONFIG) for _ in range(2)]
        world = group.world_size
    (local, result), (again, _) = rounds
    assert local.equal(again)
    torch.save(
        {"state": dict(local), "result": result, "world": world, "pid": os.getpid()}, sys.argv[1]
    )
