"""The `ray` backend: same model as inline, and nothing left running afterwards.

Each test lets the backend start and stop its own local Ray instance, the path a
user without a cluster takes. Skipped when Ray is not installed (`fedtrain[ray]`).
"""

from __future__ import annotations

import os

import psutil
import pytest

from fedtrain.simulation import run_simulation

pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TIMING = {"seconds", "train_seconds", "clients_per_s"}


@pytest.fixture(autouse=True)
def offline_ray(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")


def ray_processes() -> list[psutil.Process]:
    """Ray's daemons and workers started from this process (children of it)."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if _is_ray(p)]


def _is_ray(proc: psutil.Process) -> bool:
    try:
        return "ray" in " ".join(proc.cmdline()).lower()
    except psutil.Error:
        return False


def same_run(a, b) -> bool:
    strip = lambda h: [{k: v for k, v in r.items() if k not in TIMING} for r in h]  # noqa: E731
    return a.model.equal(b.model) and strip(a.history) == strip(b.history)


@pytest.mark.parametrize(
    "overrides",
    [
        {  # partial sums in the actors; uneven clients, dropouts, 3 actors on 2 CPUs
            "partition": {"kind": "quantity", "alpha": 1.0},
            "heterogeneity": {"epochs_range": [1, 3], "dropout_rate": 0.2},
            "workers": 3,
        },
        {  # every update streamed back to the driver
            "strategy": {"name": "fedmedian", "fraction_fit": 0.5, "min_fit_clients": 2},
        },
    ],
    ids=["partial-sums", "every-update"],
)
def test_ray_matches_inline_and_stops_its_instance(make_config, overrides):
    seen: list[psutil.Process] = []
    inline = run_simulation(make_config("inline", backend="inline", **overrides))
    on_ray = run_simulation(
        make_config("ray", backend="ray", **overrides),
        on_round=lambda record: seen.extend(ray_processes()),
    )
    assert same_run(inline, on_ray)
    assert seen, "no Ray process was ever seen"
    _, alive = psutil.wait_procs(seen, timeout=10)
    assert not alive, [p.pid for p in alive]
