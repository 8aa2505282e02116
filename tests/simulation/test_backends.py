"""Inline and process backends give the same model, bit for bit, for the same seed."""

from __future__ import annotations

import pytest
import torch

from fedtrain.simulation import run_simulation

TIMING = {"seconds", "train_seconds", "clients_per_s"}

# Everything that makes the fold order matter: partial participation, unequal
# client sizes and epochs, dropouts, more workers than cores.
UNEVEN = {
    "partition": {"kind": "quantity", "alpha": 1.0},
    "heterogeneity": {"epochs_range": [1, 3], "dropout_rate": 0.2},
    "workers": 3,
}


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING} for record in history]


@pytest.mark.integration
def test_process_pool_matches_inline_bit_for_bit(make_config):
    inline = run_simulation(make_config("inline", backend="inline", **UNEVEN))
    pool = run_simulation(make_config("process", backend="process", **UNEVEN))
    assert pool.model.equal(inline.model)
    assert without_timing(pool.history) == without_timing(inline.history)
    assert [len(r["dropped"]) for r in inline.history] == [4, 4, 4]


@pytest.mark.integration
def test_strategies_that_need_every_update_fold_in_client_order(make_config):
    """Median gets each update (no partial sums); the result cannot depend on workers."""
    median = {"strategy": {"name": "fedmedian", "fraction_fit": 0.5, "min_fit_clients": 2}}
    inline = run_simulation(make_config("inline", backend="inline", workers=1, **median))
    pool = run_simulation(make_config("process", backend="process", workers=2, **median))
    assert pool.model.equal(inline.model)
    assert without_timing(pool.history) == without_timing(inline.history)


def test_worker_count_changes_only_the_float_summation_order(make_config):
    """Partial sums per worker reorder float additions: equal to ~1e-6, not bit for bit."""
    one = run_simulation(make_config("one", workers=1))
    three = run_simulation(make_config("three", workers=3))
    for name, tensor in one.model.items():
        torch.testing.assert_close(three.model[name], tensor, rtol=1e-5, atol=1e-6)


def test_run_directory_is_the_same_for_every_backend(make_config):
    config = make_config(backend="inline")
    result = run_simulation(config)
    lines = (config.run_dir + "/metrics.jsonl", config.run_dir + "/model.pt")
    assert all(__import__("pathlib").Path(p).exists() for p in lines)
    record = result.history[-1]
    assert record["selected"] == record["clients"] == 20 and record["aggregated"]
    assert record["bytes"] == 2 * 20 * result.model.nbytes
    assert record["clients_per_s"] > 0
