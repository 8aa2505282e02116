"""Virtual clients on a multi-GPU box: workers spread round-robin over the GPUs.

The placement logic runs anywhere (the GPUs are named, not used); the end-to-end
run needs CUDA and skips cleanly without it.
"""

from __future__ import annotations

import pytest
import torch

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.simulation import run_simulation
from fedtrain.simulation.backends import gpu_placement
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.worker import WorkerSetup

GPUS = ["cuda:0", "cuda:1"]


def _config(**extra) -> SimConfig:
    return from_dict(SimConfig, {"task": "fedtrain.examples:BreastCancerTask", **extra})


def test_workers_spread_round_robin_over_the_gpus() -> None:
    packed = _config(device="cuda", gpus_per_client=0.5, backend="process")
    assert gpu_placement(packed, GPUS) == (4, ("cuda:0", "cuda:1", "cuda:0", "cuda:1"))
    three = _config(device="cuda", workers=3, backend="process")
    assert gpu_placement(three, GPUS) == (3, ("cuda:0", "cuda:1", "cuda:0"))
    setup = WorkerSetup(task=None, config=three, specs=(), devices=gpu_placement(three, GPUS)[1])
    assert [setup.device_of(w) for w in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


def test_without_cuda_or_with_a_named_device_every_worker_uses_config_device() -> None:
    assert gpu_placement(_config(device="cuda", workers=2), []) == (2, ())
    assert gpu_placement(_config(device="cuda:1", workers=2), GPUS) == (2, ())
    assert gpu_placement(_config(workers=5), GPUS) == (5, ())
    setup = WorkerSetup(task=None, config=_config(device="cuda:1"), specs=())
    assert setup.device_of(7) == "cuda:1"


def test_more_than_one_gpu_per_virtual_client_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"gpus_per_client = 2\.0"):
        _config(gpus_per_client=2.0)


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_process_backend_trains_on_the_gpus_like_the_cpu(tmp_path) -> None:
    common = {"num_clients": 4, "rounds": 2, "seed": 3, "workers": 2, "eval_every": 2}
    on_gpu = run_simulation(
        _config(**common, backend="process", device="cuda", run_dir=str(tmp_path / "gpu"))
    )
    on_cpu = run_simulation(_config(**common, backend="inline", run_dir=str(tmp_path / "cpu")))
    for name in on_cpu.model:  # GPU kernels sum in other orders than the CPU's
        torch.testing.assert_close(on_gpu.model[name], on_cpu.model[name], rtol=1e-4, atol=1e-5)
