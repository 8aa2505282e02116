"""The one round record (`fedtrain.round_record`) and the one evaluation cadence.

The runtime's drivers are checked against the same definition in
tests/runtime/test_deployment.py (a site killed mid-round) and
tests/runtime/test_fedbuff_server.py; the simulation's two drivers here."""

from __future__ import annotations

import pytest

from fedtrain.config import from_dict
from fedtrain.evaluation import evaluation_now
from fedtrain.round_record import (
    FIELDS,
    RECORD_VERSION,
    RoundRecord,
    check_record,
    finished,
    site_count,
    upgrade,
)
from fedtrain.simulation import SimConfig, run_simulation


def _record(**overrides) -> dict:
    fields = {
        "round": 3,
        "selected": 4,
        "contributors": ["b", "a"],
        "dropped": ["d"],
        "failed": ["c"],
        "aggregated": True,
    }
    return finished(RoundRecord(**{**fields, **overrides}).to_json(), 1.5)


def test_a_record_names_its_sites_sorted_and_counts_its_contributors():
    record = _record()
    assert record["record_version"] == RECORD_VERSION
    assert record["contributors"] == ["a", "b"] and record["clients"] == 2
    assert (record["dropped"], record["failed"], record["skipped"]) == (["d"], ["c"], [])
    assert record["loss"] is None and record["accuracy"] is None and record["seconds"] == 1.5
    assert set(FIELDS) <= set(record)


def test_fedbuff_keeps_its_fold_order_and_repeats():
    record = _record(contributors=["b", "a", "b"], ordered=True)
    assert record["contributors"] == ["b", "a", "b"] and record["clients"] == 3


def test_a_measurement_named_like_a_fixed_key_never_rewrites_the_record(caplog):
    """A site names its own metrics: `clients` or `round` from a site must not change
    what the record says, nor stop the round."""
    measured = {"round": 99.0, "clients": 1e9, "accuracy": 0.5, "bytes": 10, "eval_source": 1.0}
    record = RoundRecord(3, 1, ["a"], [], [], True, measurements=measured).to_json()
    assert (record["round"], record["clients"], record["accuracy"]) == (3, 1, None)
    assert (record["train_round"], record["train_clients"]) == (99.0, 1e9)
    assert record["train_accuracy"] == 0.5 and record["bytes"] == 10
    assert "eval_source" not in record  # a site cannot make the round look evaluated
    assert "measurement 'clients' names a key of the record" in caplog.text
    taken = {"loss": 0.1, "train_loss": 0.2}
    record = RoundRecord(3, 1, [], [], [], True, measurements=taken).to_json()
    assert record["train_loss"] == 0.2 and record["loss"] is None
    check_record(finished(record, 1.0))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dropped", 2, "'dropped' is int 2, should be list"),
        ("failed", [1], "'failed' must list names"),
        ("aggregated", 1, "'aggregated' is int"),
        ("selected", True, "'selected' is a bool"),
        ("clients", 5, "clients = 5 but 2 contributors"),
    ],
)
def test_a_drifted_record_is_refused_naming_key_and_round(key, value, message):
    record = {**_record(), key: value}
    with pytest.raises(ValueError, match="round 3") as info:
        check_record(record)
    assert message in str(info.value)


def test_a_record_missing_a_key_is_refused():
    record = _record()
    del record["skipped"]
    with pytest.raises(ValueError, match="'skipped' is missing"):
        check_record(record)


def test_old_simulation_lines_read_in_todays_meanings():
    old = {"round": 1, "clients": 20, "reported": 15, "dropped": 5, "rejected": 1}
    new = upgrade(old)
    assert (new["selected"], new["clients"], site_count(new["dropped"])) == (20, 15, 5)
    assert site_count(new["failed"]) == 1
    deployment = {"round": 1, "clients": 2, "selected": 3, "dropped": ["c"], "failed": []}
    assert upgrade(deployment) == deployment  # its meanings did not change
    assert upgrade(_record()) == _record() | {"seconds": 1.5}


@pytest.mark.parametrize(
    ("server_round", "where", "test_set", "expected"),
    [
        (2, "server", True, "server"),
        (3, "server", True, None),  # not due
        (5, "server", True, "server"),  # the last round is always evaluated
        (2, "server", False, None),  # nothing to evaluate on
        (2, "sites", False, "sites"),
        (5, "off", True, None),
    ],
)
def test_one_evaluation_cadence(server_round, where, test_set, expected):
    assert evaluation_now(server_round, 2, 5, where, test_set) == expected


def _sim(tmp_path, name: str, **overrides) -> SimConfig:
    raw = {
        "task": "fedtrain.examples:SyntheticTask",
        "task_options": {"num_train": 600, "num_test": 200},
        "rounds": 3,
        "num_clients": 8,
        "seed": 5,
        "run_dir": str(tmp_path / name),
        "strategy": {"fraction_fit": 1.0, "min_fit_clients": 2},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
        "heterogeneity": {"dropout_rate": 0.25},
        **overrides,
    }
    return from_dict(SimConfig, raw)


def test_a_simulated_dropout_is_named_as_in_a_deployment(tmp_path):
    history = run_simulation(_sim(tmp_path, "sync")).history
    for record in history:
        check_record(record)
        assert record["selected"] == 8 and len(record["dropped"]) == 2
        assert all(name.startswith("client-") for name in record["dropped"])
        assert set(record["dropped"]).isdisjoint(record["contributors"])
        assert record["clients"] + len(record["dropped"]) + len(record["failed"]) == 8


def test_the_asynchronous_simulation_writes_the_same_record(tmp_path):
    fedbuff = {"name": "fedbuff", "options": {"buffer_size": 3, "concurrency": 4}}
    config = _sim(tmp_path, "async", strategy=fedbuff, eval_every=2)
    history = run_simulation(config).history
    assert len(history) == 3
    for record in history:
        check_record(record)
        assert record["clients"] == 3 and record["aggregated"]
        stale = record["stale_dropped"]
        assert record["selected"] == 3 + stale + len(record["dropped"]) + len(record["failed"])
    assert any(record["dropped"] for record in history)
    assert [r["accuracy"] is not None for r in history] == [False, True, True]


def test_a_tasks_numpy_loss_is_a_number_like_any_other():
    import numpy as np

    record = _record()
    record["loss"], record["accuracy"] = np.float32(0.25), np.float64(0.75)
    check_record(record)
