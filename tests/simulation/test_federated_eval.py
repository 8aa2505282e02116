"""Federated evaluation in a simulation: no test set, the clients evaluate.

The same strategy hooks and record keys as a deployment: the chosen clients evaluate
each round's model on their held-out share (`eval_fraction`), the record's accuracy
is the strategy's aggregate of theirs, and every client's figures are in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtrain.simulation import run_simulation

NO_TEST_SET = {"num_train": 800, "num_test": 0}


def weighted(sites: dict, key: str) -> float:
    n = sum(s["examples"] for s in sites.values())
    return sum(s["examples"] * s[key] for s in sites.values()) / n


def test_without_a_test_set_the_clients_held_out_shares_give_the_accuracy(make_config):
    config = make_config(
        task_options=NO_TEST_SET,
        num_clients=8,
        eval_fraction=0.25,
        backend="inline",
        partition={"kind": "quantity", "alpha": 1.0},
        strategy={"fraction_fit": 0.5, "min_fit_clients": 2, "fraction_evaluate": 0.5},
    )
    result = run_simulation(config)
    assert result.final_accuracy is not None and result.final_accuracy > 0.6
    text = (Path(config.run_dir) / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert lines == json.loads(json.dumps(result.history))
    for record in result.history:
        sites = record["site_metrics"]
        assert record["eval_source"] == "sites" and record["eval_sites"] == 4 == len(sites)
        assert record["accuracy"] == pytest.approx(weighted(sites, "accuracy"), abs=1e-12)
        assert record["loss"] == pytest.approx(weighted(sites, "loss"), abs=1e-12)
        assert record["eval_examples"] == sum(s["examples"] for s in sites.values())
        worst = min(sites, key=lambda c: sites[c]["accuracy"])
        assert (record["worst_site"], record["worst_accuracy"]) == (
            worst,
            sites[worst]["accuracy"],
        )


@pytest.mark.integration
def test_the_process_backend_evaluates_the_same_clients_to_the_same_figures(make_config):
    common = {
        "task_options": NO_TEST_SET,
        "num_clients": 6,
        "rounds": 2,
        "eval_fraction": 0.3,
        "workers": 2,
    }
    inline = run_simulation(make_config("inline", backend="inline", **common))
    pooled = run_simulation(make_config("process", backend="process", **common))
    keys = ("accuracy", "loss", "site_metrics", "eval_examples")
    assert [{k: r[k] for k in keys} for r in pooled.history] == [
        {k: r[k] for k in keys} for r in inline.history
    ]


def test_a_user_strategy_aggregates_the_evaluation_its_own_way(make_config):
    config = make_config(
        task_options=NO_TEST_SET,
        num_clients=5,
        rounds=1,
        eval_fraction=0.3,
        backend="inline",
        partition={"kind": "quantity", "alpha": 1.0},
        strategy={"name": "sim_tasks:MedianEvalFedAvg", "min_fit_clients": 2},
    )
    (record,) = run_simulation(config).history
    accuracies = [s["accuracy"] for s in record["site_metrics"].values()]
    assert record["accuracy"] == float(np.median(accuracies))


def test_with_neither_a_test_set_nor_held_out_shares_the_log_says_how_to_evaluate(
    make_config, caplog
):
    config = make_config(task_options=NO_TEST_SET, rounds=1, backend="inline")
    (record,) = run_simulation(config).history
    assert record["accuracy"] is None and "site_metrics" not in record
    assert "set eval_fraction in sim.toml" in caplog.text


def _spy_secure_evaluation(monkeypatch) -> list:
    """Record what each secure evaluation summed (the clients' own evaluations, which
    the driver never puts in the record) and what it unmasked."""
    import fedtrain.simulation.secure as secure_module

    calls: list = []
    real = secure_module.secure_evaluation

    def spy(results, config, **options):
        out = real(results, config, **options)
        calls.append((list(results), out[1], options.get("dropouts")))
        return out

    monkeypatch.setattr(secure_module, "secure_evaluation", spy)
    return calls


def test_under_secure_aggregation_only_the_federations_totals_are_recorded(
    make_config, monkeypatch
):
    calls = _spy_secure_evaluation(monkeypatch)
    config = make_config(
        task_options=NO_TEST_SET,
        num_clients=6,
        rounds=2,
        eval_fraction=0.25,
        backend="inline",
        partition={"kind": "quantity", "alpha": 1.0},
        strategy={"min_fit_clients": 2},
        secagg={"enabled": True, "clip": 1.0},
    )
    result = run_simulation(config)
    assert len(calls) == 2
    for record, (results, unmasked, _) in zip(result.history, calls, strict=True):
        assert record["eval_secure"] is True and record["eval_source"] == "sites"
        assert "site_metrics" not in record and "worst_site" not in record
        n = sum(r.num_examples for r in results)
        assert (record["eval_sites"], record["eval_examples"]) == (6, n)
        bound = unmasked.quantizer.mean_error_bound(6, n)
        plain_accuracy = sum(r.num_examples * r.metrics["accuracy"] for r in results) / n
        plain_loss = sum(r.num_examples * r.loss for r in results) / n
        assert abs(record["accuracy"] - plain_accuracy) <= bound
        assert abs(record["loss"] - plain_loss) <= bound
        assert record["accuracy"] != plain_accuracy  # it went through the quantizer
    assert result.final_accuracy is not None and result.final_accuracy > 0.5


def test_clients_that_drop_out_of_a_secure_evaluation_are_left_out_of_its_totals(
    make_config, monkeypatch
):
    calls = _spy_secure_evaluation(monkeypatch)
    config = make_config(
        task_options=NO_TEST_SET,
        num_clients=8,
        rounds=1,
        eval_fraction=0.25,
        backend="inline",
        strategy={"min_fit_clients": 2},
        secagg={"enabled": True, "stage_dropouts": [0.0, 0.0, 0.25, 0.0, 0.0]},
    )
    (record,) = run_simulation(config).history
    ((results, unmasked, dropouts),) = calls
    gone = dropouts[2]
    assert len(gone) == 2 and record["eval_secagg_dropped_masked_input"] == 2
    kept = [r for i, r in enumerate(results, start=1) if i not in gone]
    n = sum(r.num_examples for r in kept)
    assert record["eval_sites"] == 6 and record["eval_examples"] == n
    assert len(record["eval_missing"]) == 2
    plain = sum(r.num_examples * r.metrics["accuracy"] for r in kept) / n
    assert abs(record["accuracy"] - plain) <= unmasked.quantizer.mean_error_bound(6, n)


def test_cross_site_validation_evaluates_the_final_model_at_every_client(make_config, tmp_path):
    from fedtrain.evaluation import CROSS_SITE_FILE
    from fedtrain.observability import report

    config = make_config(
        task_options=NO_TEST_SET,
        num_clients=4,
        rounds=2,
        eval_fraction=0.25,
        backend="inline",
        partition={"kind": "quantity", "alpha": 1.0},
        strategy={"min_fit_clients": 2, "fraction_evaluate": 0.5},
        cross_site_validation=True,
    )
    result = run_simulation(config)
    matrix = json.loads((Path(config.run_dir) / CROSS_SITE_FILE).read_text())
    assert matrix["round"] == 2 and list(matrix["models"]) == ["global"]
    row = matrix["models"]["global"]
    assert row["model_version"] == result.model.digest() and row["missing"] == []
    assert sorted(row["sites"]) == [f"client-{i}" for i in range(4)]
    # the last round's evaluation asked half the clients: the same model, the same figures
    last = result.history[-1]["site_metrics"]
    assert len(last) == 2
    for client, figures in last.items():
        assert row["sites"][client] == figures
    assert report.CROSS_SITE_FILE == CROSS_SITE_FILE
    page = report.write_report(config.run_dir)
    assert (page.parent / "cross_site.png").stat().st_size > 0
    assert "cross_site.png" in page.read_text()


def test_cross_site_validation_is_refused_under_secure_aggregation(make_config):
    from fedtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="cross_site_validation = true cannot run with secure"):
        make_config(cross_site_validation=True, secagg=True, strategy={"min_fit_clients": 2})
