"""The CUDA/NCCL path: runs on a GPU machine, skips cleanly without one."""

from __future__ import annotations

import pytest
import torch
from _ddp_tasks import CONFIG, SEED, SITE, global_state, one_process_twice_the_batch

from fedtrain.parallel import WorkerGroup
from fedtrain.tensors import ModelState

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def assert_close(a: ModelState, b: ModelState) -> None:
    for name in a:  # GPU kernels sum in other orders than the CPU's
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_one_gpu_group_trains_like_the_cpu_loop():
    """A world of one (no DDP wrapper, no process group) on cuda:0."""
    with WorkerGroup("_ddp_tasks:ToyTask", {"n": 96}, devices=["cuda:0"], seed=SEED,
                     client_id=SITE) as group:  # fmt: skip
        local, result = group.train_round(global_state(), {**CONFIG, "batch_size": 16}, 120)
    expected, _ = one_process_twice_the_batch()
    assert result.num_examples == 96
    assert_close(local, expected)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (NCCL wants one rank per GPU)")
def test_two_gpu_ddp_round_equals_one_process_with_twice_the_batch():
    with WorkerGroup("_ddp_tasks:ToyTask", {"n": 96}, devices=["cuda:0", "cuda:1"], seed=SEED,
                     client_id=SITE) as group:  # fmt: skip
        local, result = group.train_round(global_state(), CONFIG, 120)
        again, _ = group.train_round(global_state(), CONFIG, 120)
    expected, _ = one_process_twice_the_batch()
    assert result.num_examples == 96
    assert_close(local, expected)
    assert_close(again, local)
