"""Update codecs in the simulation: encoded bytes reported, residuals kept per client."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedtrain.compression.settings import CompressionSettings
from fedtrain.config import from_dict, load_toml
from fedtrain.errors import ConfigError
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.simulation.worker import ClientRunner, WorkerSetup
from fedtrain.task import load_task
from fedtrain.tensors import ModelState

TIMING = {"seconds", "train_seconds", "clients_per_s"}
TOPK = {"compression": {"codec": "topk", "fraction": 0.1}}


def upload_bytes_per_client(history: list[dict]) -> set[float]:
    return {r["bytes_up"] / r["clients"] for r in history}


def test_codecs_report_the_encoded_upload_bytes(make_config):
    """Linear(20, 2): 42 float32 values, 168 bytes dense. top-k 10%: 4 of the weight's
    40 and 1 of the bias' 2 entries, 8 bytes each (int32 index + float32 value)."""
    dense = run_simulation(make_config("none"))
    fp16 = run_simulation(make_config("fp16", compression="fp16"))
    topk = run_simulation(make_config("topk", **TOPK))
    model_bytes = dense.model.nbytes
    assert model_bytes == 168
    assert upload_bytes_per_client(dense.history) == {168}
    assert upload_bytes_per_client(fp16.history) == {84}
    assert upload_bytes_per_client(topk.history) == {(4 + 1) * 8}
    for run in (dense, fp16, topk):
        for r in run.history:
            assert r["bytes_down"] == r["selected"] * model_bytes
            assert r["bytes"] == r["bytes_down"] + r["bytes_up"]
    assert abs(fp16.final_accuracy - dense.final_accuracy) <= 0.02
    assert topk.history[-1]["loss"] < topk.history[0]["loss"]  # slower, but it learns


def test_error_feedback_residual_is_kept_per_client(make_config):
    """What each client sent over three uploads plus what it still holds is exactly
    what it produced, although the runner interleaves clients (one codec per worker)."""
    config = make_config(**TOPK)
    runner = ClientRunner(WorkerSetup(load_task(config.task, config.task_options), config, specs()))
    produced = {c: torch.zeros(42) for c in ("a", "b")}
    sent = {c: torch.zeros(42) for c in ("a", "b")}
    for r in range(3):
        for client, scale in (("a", 1.0), ("b", -3.0)):
            delta = fake_delta(seed=10 * r + len(client), scale=scale)
            decoded, nbytes = runner.over_the_wire(client, delta)
            assert nbytes == 40
            produced[client] += flat(delta)
            sent[client] += flat(decoded)
    assert len(runner.codec_states) == 2
    for client in ("a", "b"):
        held = runner.codec_states.get(client)
        residual = torch.cat([held["weight"], held["bias"]])
        torch.testing.assert_close(sent[client] + residual, produced[client], atol=1e-6, rtol=0)


@pytest.mark.integration
def test_process_pool_matches_inline_with_topk(make_config):
    """Residuals live in the worker that trains the client, on every backend alike."""
    inline = run_simulation(make_config("inline", backend="inline", **TOPK))
    pool = run_simulation(make_config("process", backend="process", **TOPK))
    assert pool.model.equal(inline.model)
    for a, b in zip(pool.history, inline.history, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {
            k: v for k, v in b.items() if k not in TIMING
        }


def test_driver_side_folding_decodes_too(make_config):
    """Strategies that need every update (median) get the decoded, dense update."""
    median = {"strategy": {"name": "fedmedian", "fraction_fit": 0.5, "min_fit_clients": 2}}
    dense = run_simulation(make_config("dense", **median))
    int8 = run_simulation(make_config("int8", **median, compression="int8"))
    # int8: 42 uint8 codes + one float32 min and scale per tensor (2 tensors)
    assert upload_bytes_per_client(int8.history) == {42 + 2 * 8}
    assert abs(int8.final_accuracy - dense.final_accuracy) <= 0.02


def test_compression_config_is_checked_when_read(tmp_path):
    base = {"task": "fedtrain.examples:SyntheticTask", "run_dir": str(tmp_path)}
    assert from_dict(SimConfig, {**base, "compression": "bf16"}).compression.codec == "bf16"
    with pytest.raises(ConfigError, match=re.escape("compression.codec = 'zip'")):
        from_dict(SimConfig, {**base, "compression": "zip"})
    with pytest.raises(ConfigError, match=re.escape("compression.fraction must be in")):
        from_dict(SimConfig, {**base, "compression": {"codec": "topk", "fraction": 0}})
    with pytest.raises(ConfigError, match=re.escape("compression.block must be >= 1")):
        from_dict(SimConfig, {**base, "compression": {"codec": "int8", "block": 0}})
    with pytest.raises(ConfigError, match="cannot be combined with secure aggregation"):
        CompressionSettings(codec="int8").check_secagg(True)
    CompressionSettings(codec="int8").check_secagg(False)
    CompressionSettings().check_secagg(True)  # no codec: secure aggregation is fine


def specs():
    return fake_delta(0).specs


def fake_delta(seed: int, scale: float = 1.0) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState(
        {"weight": scale * torch.randn(2, 20, generator=g), "bias": torch.randn(2, generator=g)}
    )


def flat(state: ModelState) -> torch.Tensor:
    return torch.cat([state["weight"].reshape(-1), state["bias"]])


@pytest.mark.parametrize("name", ["digits_topk.toml", "digits_dp.toml"])
def test_example_configs_read(name):
    path = Path(__file__).resolve().parents[2] / "simulations" / name
    config = from_dict(SimConfig, load_toml(path))
    assert config.num_clients == 20 and config.partition.kind == "shards"
