"""Download codecs in the simulation: clients train from the model as a deployed site
decodes it, and the records count the bytes a deployment would send."""

from __future__ import annotations

import pytest
import torch

from fedtrain.simulation import run_simulation
from fedtrain.simulation.worker import ClientRunner

#: Linear(20, 2) of SyntheticTask: 42 values, 168 bytes as float32, 84 as fp16.
MODEL_BYTES = 168


@pytest.fixture
def trained_from(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The model every client (inline) was handed to train from."""
    seen: list[dict[str, torch.Tensor]] = []
    train_client = ClientRunner.train_client

    def spy(self, client_id, config, global_state):  # type: ignore[no-untyped-def]
        seen.append({n: t.clone() for n, t in global_state.items()})
        return train_client(self, client_id, config, global_state)

    monkeypatch.setattr(ClientRunner, "train_client", spy)
    return seen


def test_clients_train_from_the_fp16_model_and_half_the_bytes_go_down(make_config, trained_from):
    dense = run_simulation(make_config("dense", backend="inline"))
    trained_from.clear()
    fp16 = run_simulation(make_config("fp16", backend="inline", download="fp16"))
    assert trained_from and all(
        torch.equal(t, t.half().float()) for state in trained_from for t in state.values()
    )
    assert not all(torch.equal(t, t.half().float()) for t in fp16.model.values())  # exact G
    for r in fp16.history:
        assert r["bytes_down"] == r["selected"] * MODEL_BYTES // 2
    assert abs(fp16.final_accuracy - dense.final_accuracy) <= 0.02


def test_delta_downloads_send_changes_to_clients_that_hold_the_last_version(make_config):
    """Every client is chosen every round: the first download is the whole model, then
    only int8 changes (42 bytes + a min and a scale per tensor)."""
    config = make_config(
        "delta",
        backend="inline",
        num_clients=4,
        strategy={"fraction_fit": 1.0, "min_fit_clients": 4, "min_available_clients": 4},
        download={"codec": "int8", "delta": True},
    )
    run = run_simulation(config)
    assert [r["bytes_down"] for r in run.history] == [4 * MODEL_BYTES] + [4 * (42 + 16)] * 2
    assert run.history[-1]["loss"] < run.history[0]["loss"]
