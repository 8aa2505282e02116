"""10,000 registered clients, 100 per round: memory must not grow from round to round.

The model is sized so that a leak would show: one kept update per client per round
(a 10 KB model, 100 clients) would add ~1 MB of RSS a round, ~20 MB over the run.
RSS is that of the whole process tree (driver and workers), read after every round;
allocators still settle for a while (measured: workers +250 KB over the first 40
rounds, the driver one 3 MB arena step), hence medians of windows and a 6 MB margin.
"""

from __future__ import annotations

import statistics

import psutil
import pytest

from fedtrain.simulation import run_simulation

WARM_UP_ROUNDS = 3
ROUNDS = 25
WINDOW = 5
TOLERANCE_BYTES = 6 * 1024 * 1024  # a leak of one update per client: ~20 MB


def tree_rss() -> int:
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["fedavg", "fedmedian"])
def test_ten_thousand_clients_run_without_memory_growth(make_config, strategy):
    rss: list[int] = []
    config = make_config(
        backend="process",
        num_clients=10_000,
        rounds=ROUNDS,
        task_options={"num_train": 40_000, "num_test": 500, "num_features": 250, "num_classes": 10},
        strategy={"name": strategy, "fraction_fit": 0.01, "min_fit_clients": 2},
    )
    result = run_simulation(config, on_round=lambda record: rss.append(tree_rss()))
    assert [r["clients"] for r in result.history] == [100] * ROUNDS
    early = statistics.median(rss[WARM_UP_ROUNDS : WARM_UP_ROUNDS + WINDOW])
    late = statistics.median(rss[-WINDOW:])
    trace = " ".join(f"{(r - rss[0]) / 2**20:.2f}" for r in rss)
    assert late - early < TOLERANCE_BYTES, f"MB above round 1, per round: {trace}"
