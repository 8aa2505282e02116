"""Per-client epochs, unequal client sizes and dropouts: seeded, and rounds survive them."""

from __future__ import annotations

import numpy as np
import pytest

from fedtrain.errors import ConfigError
from fedtrain.simulation import run_simulation
from fedtrain.simulation.config import HeterogeneityConfig
from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.plan import plan_round
from fedtrain.simulation.population import ClientPopulation
from fedtrain.strategy import FedAvg
from fedtrain.task import load_task, model_for
from fedtrain.tensors import ModelState


def population_for(config) -> ClientPopulation:
    task = load_task(config.task, config.task_options)
    return ClientPopulation.build(task, task.datasets()[0], config)


def test_each_client_keeps_its_own_epochs_every_round(make_config):
    config = make_config(heterogeneity={"epochs_range": [1, 4]})
    population = population_for(config)
    hetero = Heterogeneity(config.heterogeneity, len(population), config.seed)
    strategy = FedAvg(fraction_fit=0.5, client_config={"epochs": 1})
    rng = np.random.default_rng(0)
    seen: dict[str, set[int]] = {}
    for server_round in range(1, 6):
        plan = plan_round(server_round, strategy, population, hetero, rng, 2, True)
        for share in plan.shares:
            for client_id, cfg in share:
                seen.setdefault(client_id, set()).add(int(cfg["epochs"]))
    assert all(len(epochs) == 1 for epochs in seen.values())  # a device stays as fast
    assert {e for epochs in seen.values() for e in epochs} == {1, 2, 3, 4}


def test_dropouts_are_seeded_and_the_round_completes_without_them(make_config):
    config = make_config(heterogeneity={"dropout_rate": 0.25})
    first = run_simulation(config)
    again = run_simulation(make_config("again", heterogeneity={"dropout_rate": 0.25}))
    for record in first.history:
        assert (record["selected"], len(record["dropped"]), record["clients"]) == (20, 5, 15)
        assert set(record["dropped"]).isdisjoint(record["contributors"])
        assert record["aggregated"]
        assert record["bytes"] == (20 + 15) * first.model.nbytes  # no upload from a dropout
    assert first.model.equal(again.model)


def test_dropped_clients_are_chosen_clients_and_vary_by_round():
    hetero = Heterogeneity(HeterogeneityConfig(dropout_rate=0.5), 10, seed=1)
    chosen = [f"c{i}" for i in range(10)]
    rounds = [hetero.dropouts(r, chosen) for r in range(1, 6)]
    assert all(len(d) == 5 and d <= set(chosen) for d in rounds)
    assert len({frozenset(d) for d in rounds}) > 1
    assert hetero.dropouts(3, chosen) == rounds[2]


def test_a_round_with_too_few_reports_leaves_the_model_unchanged(make_config):
    config = make_config(
        rounds=2,
        heterogeneity={"dropout_rate": 0.25},
        strategy={"fraction_fit": 0.5, "min_fit_clients": 20, "min_available_clients": 20},
    )
    result = run_simulation(config)
    assert [r["aggregated"] for r in result.history] == [False, False]
    task = load_task(config.task, config.task_options)
    assert result.model.equal(ModelState.from_module(model_for(task, config.seed)))


def test_quantity_skew_gives_clients_unequal_sizes(make_config):
    population = population_for(make_config(partition={"kind": "quantity", "alpha": 0.5}))
    sizes = [population.size(c) for c in population.ids]
    assert sum(sizes) == 1200 and min(sizes) >= 1 and max(sizes) > 3 * min(sizes)


@pytest.mark.parametrize(
    "section", [{"epochs_range": [3, 1]}, {"epochs_range": [0, 2]}, {"dropout_rate": 1.0}]
)
def test_bad_heterogeneity_is_a_config_error(make_config, section):
    with pytest.raises(ConfigError, match="heterogeneity"):
        make_config(heterogeneity=section)
