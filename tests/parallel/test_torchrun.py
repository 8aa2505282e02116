"""The torchrun launch contract with 2 CPU processes on 127.0.0.1: rank 0 drives the
group as the daemon would, rank 1 runs follower_main, and the round equals the local
group's (one process with twice the batch)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ddp_tasks import assert_same_model, one_process_twice_the_batch

from fedtrain.errors import ConfigError
from fedtrain.parallel import launched_by_torchrun
from fedtrain.parallel.launch import env_rank
from fedtrain.tensors import ModelState

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env_contract_is_read_with_clear_errors():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert launched_by_torchrun(env) and env_rank(env) == (1, 2, 1)
    assert not launched_by_torchrun({"RANK": "0"})
    with pytest.raises(ConfigError, match="WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset"):
        env_rank({"RANK": "0"})
    with pytest.raises(ConfigError, match="outside WORLD_SIZE=2"):
        env_rank({**env, "RANK": "2"})


@pytest.mark.integration
def test_two_cpu_processes_under_torchrun(tmp_path):
    out = tmp_path / "rank0.pt"
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(HERE / "_torchrun_site.py"), str(out),
    ]  # fmt: skip
    done = subprocess.run(launch, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(out, weights_only=False)
    expected_state, expected = one_process_twice_the_batch()
    assert saved["world"] == 2
    assert saved["result"].num_examples == 96
    assert saved["result"].metrics["train_loss"] == pytest.approx(
        expected.metrics["train_loss"], rel=1e-5
    )
    assert_same_model(ModelState(saved["state"]), expected_state)
