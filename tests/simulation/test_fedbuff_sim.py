"""FedBuff in simulation: a seeded virtual clock, versions every K arrivals, staleness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_backends import without_timing

from fedtrain.config import from_dict, load_toml
from fedtrain.errors import ConfigError, SimulationError
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.simulation.config import HeterogeneityConfig
from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.population import ClientPopulation
from fedtrain.strategy import FedBuff
from fedtrain.task import load_task


def fedbuff(**options) -> dict:
    return {"strategy": {"name": "fedbuff", "options": {"buffer_size": 3, **options}}}


ASYNC = {
    "rounds": 6,
    "num_clients": 12,
    "eval_every": 2,
    "heterogeneity": {"speed_range": [1.0, 20.0]},
    **fedbuff(concurrency=6),
}


def durations(config) -> list[float]:
    """Each client's job duration on the virtual clock, as the engine computes it."""
    task = load_task(config.task, config.task_options)
    population = ClientPopulation.build(task, task.datasets()[0], config)
    hetero = Heterogeneity(config.heterogeneity, len(population), config.seed)
    return [
        hetero.job_duration(i, population.size(c), config.client)
        for i, c in enumerate(population.ids)
    ]


def test_one_record_per_version_with_k_updates_each(make_config):
    config = make_config(**ASYNC)
    result = run_simulation(config)
    history = result.history
    assert [r["round"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert all(r["clients"] == 3 and r["aggregated"] for r in history)
    assert [r["client_updates"] for r in history] == [3, 6, 9, 12, 15, 18]
    times = [r["sim_time"] for r in history]
    assert times == sorted(times) and times[0] > 0
    evaluated = [r["round"] for r in history if r["accuracy"] is not None]
    assert evaluated == [2, 4, 6]
    assert history[-1]["accuracy"] > 0.6
    assert history[0]["staleness_max"] == 0  # nothing is stale before the first version
    assert max(r["staleness_max"] for r in history) >= 1
    for r in history:
        assert 0 < r["staleness_weight_mean"] <= 1.0
        counted = r["clients"] + r["stale_dropped"] + len(r["failed"]) + len(r["dropped"])
        assert r["selected"] == counted
        assert r["bytes"] > 0 and "train_loss" in r
    again = run_simulation(make_config("again", **ASYNC))
    assert again.model.equal(result.model)
    assert without_timing(again.history) == without_timing(history)


def test_versions_advance_at_the_fast_clients_pace(make_config):
    """Every client trains at once; the slowest is 20x slower than the fastest at most,
    yet versions keep coming: several exist before the slowest client reports once."""
    config = make_config(
        **{**ASYNC, **fedbuff(concurrency=0), "partition": {"kind": "iid"}, "rounds": 8}
    )
    slowest = max(durations(config))
    history = run_simulation(config).history
    before = [r for r in history if r["sim_time"] < slowest]
    assert len(before) >= 5
    # the slow clients' updates arrive stale and are weighted down
    assert max(r["staleness_max"] for r in history) >= 3
    assert min(r["staleness_weight_mean"] for r in history) < 1.0


def test_max_staleness_drops_late_updates(make_config):
    history = run_simulation(make_config(**{**ASYNC, **fedbuff(concurrency=6, max_staleness=0)}))
    history = history.history
    assert all(r["staleness_max"] == 0 and r["staleness_weight_mean"] == 1.0 for r in history)
    assert sum(r["stale_dropped"] for r in history) > 0


def test_dropped_jobs_are_counted_and_replaced(make_config):
    config = make_config(
        **{**ASYNC, "heterogeneity": {"speed_range": [1.0, 4.0], "dropout_rate": 0.3}}
    )
    history = run_simulation(config).history
    assert len(history) == 6
    assert sum(len(r["dropped"]) for r in history) > 0


def test_updates_that_never_count_stop_the_run_with_a_reason(make_config):
    config = make_config(
        task="sim_tasks:NanTask",
        task_options={"num_train": 200, "num_test": 50},
        num_clients=4,
        **fedbuff(buffer_size=2, concurrency=2),
    )
    with pytest.raises(SimulationError, match="without making version 1"):
        run_simulation(config)


@pytest.mark.integration
def test_process_pool_matches_inline_bit_for_bit(make_config):
    uneven = {**ASYNC, "partition": {"kind": "quantity", "alpha": 1.0}, "workers": 2}
    inline = run_simulation(make_config("inline", backend="inline", **uneven))
    pool = run_simulation(make_config("process", backend="process", **uneven))
    assert pool.model.equal(inline.model)
    assert without_timing(pool.history) == without_timing(inline.history)


def test_speeds_are_seeded_log_uniform_and_scale_job_time():
    config = HeterogeneityConfig(speed_range=[2.0, 50.0])
    hetero = Heterogeneity(config, 2000, seed=4)
    assert hetero.slowdown is not None
    assert np.array_equal(hetero.slowdown, Heterogeneity(config, 2000, seed=4).slowdown)
    assert hetero.slowdown.min() >= 2.0 and hetero.slowdown.max() <= 50.0
    # log-uniform: the median sits near the geometric mean (10), not the arithmetic (26)
    assert 8.0 < float(np.median(hetero.slowdown)) < 12.5
    s = float(hetero.slowdown[7])
    assert hetero.job_duration(7, 30, {"epochs": 2}) == pytest.approx(s * 60)
    plain = Heterogeneity(HeterogeneityConfig(), 3, seed=4)
    assert plain.job_duration(1, 30, {}) == 30.0


@pytest.mark.parametrize("bad", [[0.0, 2.0], [3.0, 2.0], [1.0]])
def test_bad_speed_range_is_refused(bad):
    with pytest.raises(ConfigError, match=r"heterogeneity\.speed_range"):
        HeterogeneityConfig(speed_range=bad)


def test_the_example_config_builds_fedbuff():
    path = Path(__file__).resolve().parents[2] / "simulations" / "digits_fedbuff.toml"
    config = from_dict(SimConfig, load_toml(path))
    strategy = config.build_strategy()
    assert isinstance(strategy, FedBuff) and strategy.asynchronous
    assert (strategy.buffer_size, strategy.concurrency) == (10, 20)
    assert config.heterogeneity.speed_range == [1.0, 10.0]


def test_without_a_test_set_the_clients_evaluate_every_eval_every_versions(make_config):
    common = {
        **ASYNC,
        "task_options": {"num_train": 1200, "num_test": 0},
        "eval_fraction": 0.25,
        "strategy": {**ASYNC["strategy"], "fraction_evaluate": 0.5},
    }
    result = run_simulation(make_config("evaluated", **common))
    history = result.history
    evaluated = [r for r in history if r["accuracy"] is not None]
    assert [r["round"] for r in evaluated] == [2, 4, 6]
    for record in evaluated:
        sites = record["site_metrics"]
        assert record["eval_source"] == "sites" and len(sites) == 6 == record["eval_sites"]
        n = sum(s["examples"] for s in sites.values())
        mean = sum(s["examples"] * s["accuracy"] for s in sites.values()) / n
        assert record["accuracy"] == pytest.approx(mean, abs=1e-12)
    assert evaluated[-1]["accuracy"] > 0.6
    # evaluating between jobs never changes who trains, when, or what the model becomes
    unevaluated = run_simulation(make_config("off", **{**common, "evaluate": "off"}))
    assert [r["round"] for r in unevaluated.history if r["accuracy"] is not None] == []
    keys = ("sim_time", "client_updates", "staleness_max")
    assert [[r[k] for k in keys] for r in history] == [
        [r[k] for k in keys] for r in unevaluated.history
    ]
    assert result.model.digest() == unevaluated.model.digest()
