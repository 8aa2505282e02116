"""Personalization in a simulation: each client also reports a fine-tuned copy's figures.

With `personalize_epochs` every client chosen to evaluate fine-tunes a copy of the
global model on its own training split and reports both; on label-skewed clients
the personalized model fits its own held-out data better than the global one. The
copy never reaches the global model: the same run without personalization trains
the same model, bit for bit.
"""

from __future__ import annotations

import pytest

from fedtrain.simulation import run_simulation

LABEL_SKEW = {
    "task_options": {"num_train": 800, "num_test": 0},
    "num_clients": 6,
    "rounds": 2,
    "eval_fraction": 0.25,
    "backend": "inline",
    "partition": {"kind": "labels", "labels_per_client": 1},
    "strategy": {"min_fit_clients": 2},
}


def weighted(sites: dict, key: str) -> float:
    n = sum(s["examples"] for s in sites.values())
    return sum(s["examples"] * s[key] for s in sites.values()) / n


def test_each_client_reports_its_personalized_figures_beside_the_global_ones(make_config):
    result = run_simulation(make_config(personalize_epochs=2, **LABEL_SKEW))
    for record in result.history:
        sites = record["site_metrics"]
        assert len(sites) == 6
        assert all({"personalized_loss", "personalized_accuracy"} <= set(s) for s in sites.values())
        for key in ("personalized_accuracy", "personalized_loss"):
            assert record[key] == pytest.approx(weighted(sites, key), abs=1e-12)
        assert record["personalized_examples"] == record["eval_examples"]
        # one label per client: the fine-tuned copy fits the client's own data better
        assert record["personalized_accuracy"] > record["accuracy"]
        assert record["personalized_loss"] < record["loss"]
        assert "eval_personalized_accuracy" not in record


def test_personalization_never_changes_the_global_model(make_config):
    personalized = run_simulation(make_config("with", personalize_epochs=2, **LABEL_SKEW))
    plain = run_simulation(make_config("without", **LABEL_SKEW))
    assert personalized.model.digest() == plain.model.digest()
    for mine, theirs in zip(personalized.history, plain.history, strict=True):
        assert (mine["accuracy"], mine["loss"]) == (theirs["accuracy"], theirs["loss"])
        assert "personalized_accuracy" not in theirs
        assert {k: {**v} for k, v in theirs["site_metrics"].items()} == {
            k: {m: x for m, x in v.items() if not m.startswith("personalized_")}
            for k, v in mine["site_metrics"].items()
        }


def test_under_secure_aggregation_the_personalized_totals_are_masked_too(make_config, monkeypatch):
    from fedtrain.simulation import secure as secure_module

    calls = []
    real = secure_module.secure_evaluation

    def spy(results, config, **options):
        out = real(results, config, **options)
        calls.append((list(results), out[1]))
        return out

    monkeypatch.setattr(secure_module, "secure_evaluation", spy)
    config = make_config(personalize_epochs=1, secagg={"enabled": True, "clip": 1.0}, **LABEL_SKEW)
    result = run_simulation(config)
    assert len(calls) == 2
    for record, (results, unmasked) in zip(result.history, calls, strict=True):
        assert "site_metrics" not in record
        n = sum(r.num_examples for r in results)
        assert record["personalized_examples"] == record["eval_examples"] == n
        bound = unmasked.quantizer.mean_error_bound(6, n)
        for key in ("personalized_accuracy", "personalized_loss"):
            plain = sum(r.num_examples * r.metrics[key] for r in results) / n
            assert abs(record[key] - plain) <= bound
        assert record["personalized_accuracy"] > record["accuracy"]
