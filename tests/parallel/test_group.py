"""A local DDP worker group on CPU (gloo, 2 processes): same model as one process with
twice the batch, workers kept across rounds, failures fail only their round."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch
from _ddp_tasks import (
    CONFIG,
    SEED,
    SITE,
    ToyTask,
    assert_same_model,
    first_half,
    global_state,
    gone,
    one_process_twice_the_batch,
)

from fedtrain.errors import WorkerGroupError
from fedtrain.parallel import WorkerGroup
from fedtrain.task import mix_seed, model_for
from fedtrain.tensors import ModelState

pytestmark = pytest.mark.integration

TASK = "_ddp_tasks:ToyTask"


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(TASK, {"n": 96}, nproc=2, seed=SEED, client_id=SITE) as g:
        yield g


def test_ddp_round_equals_one_process_with_twice_the_batch(group):
    """96 examples, 2 ranks x batch 8: each step's 16 examples are the same 16 that
    TorchTask's unchanged single-process loop takes with batch 16 (see iterate_batches)."""
    start = global_state()
    local, result = group.train_round(start, CONFIG, timeout_s=60)
    expected_state, expected = one_process_twice_the_batch()
    assert_same_model(local, expected_state)
    assert result.num_examples == 96  # the site's total, not one rank's shard
    assert result.metrics["train_loss"] == pytest.approx(expected.metrics["train_loss"], rel=1e-5)
    assert not local.equal(start)


def test_workers_live_across_rounds_and_rounds_are_repeatable(group):
    pids = group.pids
    a, _ = group.train_round(global_state(), CONFIG, timeout_s=60)
    b, _ = group.train_round(global_state(), CONFIG, timeout_s=60)
    assert group.pids == pids
    assert a.equal(b)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ({"crash_rank": 1}, "rank 1 exited with code 3"),
        ({"raise_rank": 0}, "rank 0 raised RuntimeError: injected failure on rank 0"),
        ({"hang_rank": 1}, "did not finish the round within 2 s (hung)"),
    ],
    ids=["crash", "raise", "hang"],
)
def test_a_failing_rank_fails_only_its_round(group, fault, says):
    old = [psutil.Process(pid) for pid in group.pids]
    with pytest.raises(WorkerGroupError, match="being restarted") as info:
        group.train_round(global_state(), {**CONFIG, **fault}, timeout_s=2)
    assert says in str(info.value)
    assert info.value.restarting and info.value.failures
    assert gone(old)  # the failed generation is dead before the error is raised

    local, result = group.train_round(global_state(), CONFIG, timeout_s=60)
    assert result.num_examples == 96 and not local.equal(global_state())
    assert set(group.pids).isdisjoint(p.pid for p in old)


def test_close_from_another_thread_cuts_a_round_short(group):
    """Daemon shutdown: close() interrupts a running round, and nothing restarts."""
    procs = [psutil.Process(pid) for pid in group.pids]
    outcome: list[BaseException] = []

    def hanging_round() -> None:
        try:
            group.train_round(global_state(), {**CONFIG, "hang_rank": 1}, timeout_s=60)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=hanging_round)
    thread.start()
    time.sleep(1.0)
    group.close()
    thread.join(10)
    assert isinstance(outcome[0], WorkerGroupError) and "cut short" in str(outcome[0])
    assert not outcome[0].restarting
    assert gone(procs) and group.pids == []
    with pytest.raises(WorkerGroupError, match="closed"):
        group.train_round(global_state(), CONFIG)
    group.close()  # idempotent


def test_uneven_shards_pad_like_distributed_sampler():
    """23 examples (a data factory takes half of 46), 2 ranks x batch 4: the shuffle
    is padded to 24 and each step takes the next 8 of the padded order."""
    task = ToyTask(n=46)
    data = first_half(task)
    config = {"batch_size": 4, "lr": 0.3, "round": 1}
    with WorkerGroup(TASK, {"n": 46}, data=first_half, nproc=2, seed=SEED, client_id=SITE) as g:
        local, result = g.train_round(global_state(), config, timeout_s=60)
        procs = [psutil.Process(pid) for pid in g.pids]
    assert gone(procs)  # the with block's end stopped every worker
    assert result.num_examples == 23

    model = model_for(task, 0)
    global_state().load_into(model)
    opt = task.optimizer(model, config)
    perm = torch.randperm(23, generator=torch.Generator().manual_seed(mix_seed(SEED, 1, SITE)))
    padded = torch.cat([perm, perm[:1]])
    x, y = data.dataset.tensors[0][data.indices], data.dataset.tensors[1][data.indices]
    for rows in padded.split(8):
        opt.zero_grad()
        task.loss(model(x[rows]), y[rows]).backward()
        opt.step()
    assert_same_model(local, ModelState.from_module(model))
