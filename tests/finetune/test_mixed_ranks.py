"""Sites of different LoRA ranks in one federation: zero-padding to the federation's rank."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.finetune import GeneratedReportsTask
from fedtrain.strategy.aggregate import WeightedSum, apply_mean_delta, compute_delta
from fedtrain.task import TaskContext, federated_names, model_for, task_fingerprint
from fedtrain.tensors import ModelState

TINY = {"n_embd": 32, "n_layer": 1, "n_head": 2, "steps": 20}
RANK = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ranks") / "base"


def site(base_dir: Path, site_rank: int, **options: Any) -> GeneratedReportsTask:
    defaults = {"base_size": TINY, "train_per_site": 16, "test_per_site": 8, "lora_rank": RANK,
                "lora_alpha": 8.0, "target_modules": ["c_attn"]}  # fmt: skip
    return GeneratedReportsTask(str(base_dir), site_rank=site_rank, **{**defaults, **options})


def _random_adapters(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n in names:
            t = model.state_dict()[n]
            t.copy_(torch.randn(t.shape, generator=gen) * 0.1)


def test_a_lower_rank_site_computes_exactly_a_truncated_rank_r_lora(base_dir):
    low = site(base_dir, 2)
    model = model_for(low, 0)
    names = federated_names(low, model)
    _random_adapters(model, names)
    # The same adapters truncated to rank 2 in a true rank-2 LoRA with the same scaling
    # (alpha / r: 8 / 4 there, 4 / 2 here).
    truth_task = GeneratedReportsTask(
        str(base_dir), base_size=TINY, lora_rank=2, lora_alpha=4.0, target_modules=["c_attn"]
    )
    truth = model_for(truth_task, 0)
    state = model.state_dict()
    with torch.no_grad():
        for n, t in truth.state_dict().items():
            if ".lora_A." in n:
                t.copy_(state[n][:2])
            elif ".lora_B." in n:
                t.copy_(state[n][:, :2])
    ids = low.site_data("cardiology").train.tensors[0][:4]
    model.eval(), truth.eval()
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, truth(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = model_for(site(base_dir, RANK), 0)
    full.load_state_dict(model.state_dict())
    with torch.no_grad():  # ...and differs from the rank-4 adapters it holds
        assert not torch.allclose(full(input_ids=ids).logits, got, atol=1e-4)


def test_sites_of_different_ranks_share_a_fingerprint_and_one_wire_shape(base_dir):
    low, high = site(base_dir, 2), site(base_dir, RANK)
    assert task_fingerprint(low) == task_fingerprint(high)
    assert ModelState.from_module(model_for(low, 0)).specs == (
        ModelState.from_module(model_for(high, 0)).specs
    )
    with pytest.raises(ConfigError, match="between 1 and"):
        site(base_dir, RANK + 1)


def test_mixed_rank_updates_average_as_zero_padding_says_by_hand(base_dir):
    """Site a (rank 2, weight 16) and site b (rank 4, weight 48) train from one global
    model. Slots 0-1 of the mean are (16 d_a + 48 d_b) / 64; slots 2-3 are 48 d_b / 64:
    site a is no change there."""
    low, high = site(base_dir, 2), site(base_dir, RANK, train_per_site=48)
    model = model_for(high, 0)
    names = federated_names(high, model)
    _random_adapters(model, names)
    global_state = ModelState.from_module(model, names)
    deltas, weights = [], []
    for task, data_site in ((low, "cardiology"), (high, "neurology")):
        local = model_for(task, 0)
        global_state.load_into(local, names)
        data = task.site_data(data_site).train
        result = task.train(local, data, {"lr": 0.05, "batch_size": 8, "weight_decay": 0.1},
                            TaskContext())  # fmt: skip
        deltas.append(compute_delta(ModelState.from_module(local, names), global_state))
        weights.append(float(result.num_examples))
    d_a, d_b = deltas
    assert weights == [16.0, 48.0]
    for n in names:  # site a's update is zero beyond its rank (weight decay included)
        idle = d_a[n][2:] if ".lora_A." in n else d_a[n][:, 2:]
        busy = d_a[n][:2] if ".lora_A." in n else d_a[n][:, :2]
        assert torch.count_nonzero(idle) == 0 and (".lora_B." in n or busy.abs().sum() > 0)

    fold = WeightedSum(global_state.specs)
    for d, w in zip(deltas, weights, strict=True):
        for n in names:
            fold.add_chunk(n, 0, d[n].reshape(-1), w)
    mean = {n: fold.sums[n].reshape(global_state[n].shape) / sum(weights) for n in names}
    new = apply_mean_delta(global_state, mean)
    for n in names:
        by_hand = global_state[n].double().clone()
        low_slots = (slice(None, 2),) if ".lora_A." in n else (slice(None), slice(None, 2))
        high_slots = (slice(2, None),) if ".lora_A." in n else (slice(None), slice(2, None))
        by_hand[low_slots] += (16 * d_a[n][low_slots].double() + 48 * d_b[n][low_slots]) / 64
        by_hand[high_slots] += 48 * d_b[n][high_slots].double() / 64
        torch.testing.assert_close(new[n].double(), by_hand, rtol=1e-6, atol=1e-7)


def test_a_rank_2_and_a_rank_4_site_train_one_round_together(base_dir, tmp_path):
    """Real gRPC, in-process: both join (one fingerprint) and both updates count."""
    from runtime_support import inprocess_server

    from fedtrain.runtime.config import SiteConfig
    from fedtrain.runtime.site.daemon import SiteDaemon

    options = {
        "base": str(base_dir), "base_size": TINY, "train_per_site": 16, "test_per_site": 8,
        "lora_rank": RANK, "lora_alpha": 8.0, "target_modules": ["c_attn"],
    }  # fmt: skip
    server_task = GeneratedReportsTask(**options)
    server = inprocess_server(
        tmp_path, server_task, 2, rounds=1, evaluate="off", chunk_bytes=4096,
        client={"lr": 0.05, "batch_size": 8},
    )  # fmt: skip
    daemons = []
    try:
        for i, rank in enumerate((2, RANK)):
            raw = {
                "task": "fedtrain.finetune:GeneratedReportsTask",
                "task_options": {**options, "site_rank": rank},
                "name": f"rank-{rank}",
                "server": f"127.0.0.1:{server.port}",
                "data": {"source": "task", "options": {"site": i}},
                "reconnect": {"min_s": 0.1, "max_s": 0.5},
            }
            daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True)
            thread = threading.Thread(target=daemon.run, daemon=True)
            thread.start()
            daemons.append((daemon, thread))
        assert server.wait(120), "the round did not finish"
        assert server.coordinator.error is None
        assert server.coordinator.last_metrics["clients"] == 2
    finally:
        for daemon, thread in daemons:
            daemon.stop()
            thread.join(10)
        server.stop()
