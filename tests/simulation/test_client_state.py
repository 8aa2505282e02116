"""Per-client state for stateful tasks: kept compactly, only for clients that have some."""

from __future__ import annotations

import pytest
import torch

from fedtrain.simulation import run_simulation
from fedtrain.simulation.client_state import ClientStateStore


def test_store_round_trips_and_hands_out_copies():
    store = ClientStateStore()
    store.put("a", {"c": torch.arange(4, dtype=torch.float32), "n": torch.tensor(3)})
    store.put("b", {"c": torch.ones(4), "n": torch.tensor(1)})
    state = store.get("a")
    assert torch.equal(state["c"], torch.arange(4, dtype=torch.float32))
    assert int(state["n"]) == 3
    state["c"].add_(100)  # training mutates its copy in place
    assert torch.equal(store.get("a")["c"], torch.arange(4, dtype=torch.float32))
    assert store.get("nobody") == {}
    assert len(store) == 2
    store.put("a", {})  # a client that clears its state frees its slot
    assert len(store) == 1 and store.get("a") == {}
    assert store.nbytes == 128  # one 64-byte-aligned buffer per tensor of the one client


def test_same_shaped_states_share_one_layout():
    store = ClientStateStore()
    for i in range(100):
        store.put(f"c{i}", {"v": torch.full((10,), float(i))})
    assert len(store._layouts) == 1
    assert float(store.get("c42")["v"][0]) == 42.0


@pytest.mark.parametrize(
    "backend", ["inline", pytest.param("process", marks=pytest.mark.integration)]
)
def test_stateful_task_sees_its_own_state_every_round(make_config, backend):
    """Even clients count their rounds in state, odd ones keep none (so count 1)."""
    config = make_config(
        backend,
        backend=backend,
        task="sim_tasks:CountingTask",
        task_options={"num_train": 1200},
        strategy={"fraction_fit": 1.0},
    )
    result = run_simulation(config)
    # iid: 30 examples each; example-weighted mean of (round for even, 1 for odd)
    assert [r["count"] for r in result.history] == [1.0, 1.5, 2.0]
