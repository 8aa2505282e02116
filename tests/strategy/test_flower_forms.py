"""Flower-parity behaviour checked without Flower: FedAdam's `bias_correction = "flower"`
and Krum's metrics against independent float64 references, and the README's table
of defaults that differ from Flower against the code (test_vs_flower.py compares the
same behaviour with Flower 1.42 itself, when it is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # readme_tables
from readme_tables import flower_default_rows, literal

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.examples import SyntheticTask
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.strategy import build_strategy
from fedtrain.task import TaskContext, TrainResult
from fedtrain.tensors import ModelState


def fold_round(strategy, state: ModelState, r: int, deltas, counts) -> ModelState:
    agg = strategy.begin_round(r, state)
    for d, n in zip(deltas, counts, strict=True):
        agg.add({"w": torch.tensor(d)}, float(n))
    return strategy.finalize_round(r, state, agg)


def test_fedadam_flower_form_follows_flowers_formula():
    """Flower 1.42 (fedadam.py): eta_norm = eta sqrt(1 - b2^(t)) / (1 - b1^(t)), t = round + 1."""
    eta, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    rng = np.random.default_rng(4)
    ours = build_strategy(
        "fedadam", server_lr=eta, tau=tau, bias_correction="flower", min_fit_clients=1
    )
    x = rng.normal(size=6)
    state = ModelState({"w": torch.tensor(x)})
    m, v = np.zeros(6), np.zeros(6)
    for r in (1, 2, 4, 5):  # round 3 failed: Flower's t follows the round, not the steps
        deltas = [rng.normal(scale=0.1, size=6) for _ in range(3)]
        counts = [3, 1, 7]
        state = fold_round(ours, state, r, deltas, counts)
        delta = sum(n * d for n, d in zip(counts, deltas, strict=True)) / sum(counts)
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta**2
        t = r + 1.0
        x = x + eta * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + tau)
        np.testing.assert_allclose(state["w"].numpy(), x, rtol=1e-12, err_msg=f"round {r}")


@pytest.mark.parametrize(("form", "first_step"), [("adam", 0.1), ("flower", 0.07425)])
def test_the_first_fedadam_step_is_server_lr_or_flowers_smaller_one(form, first_step):
    strategy = build_strategy("fedadam", bias_correction=form, min_fit_clients=1)
    state = ModelState({"w": torch.zeros(3, dtype=torch.float64)})
    out = fold_round(strategy, state, 1, [np.ones(3)], [1])
    np.testing.assert_allclose(out["w"].numpy(), first_step, atol=5e-5)


def test_an_unknown_bias_correction_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"strategy\.bias_correction = .kingma."):
        build_strategy("fedadam", bias_correction="kingma")


def krum_reference(deltas, counts, metrics, f: int, keep: int) -> tuple[np.ndarray, dict]:
    """Blanchard et al.: score = sum of squared distances to the n - f - 2 nearest;
    keep the best (or `keep` best), example-weighted; metrics of the kept only."""
    n = len(deltas)
    scores = []
    for i in range(n):
        dist = sorted(float(np.sum((deltas[i] - deltas[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(dist[: max(1, n - f - 2)]))
    kept = sorted(range(n), key=lambda i: (scores[i], i))[: keep or 1]
    total = sum(counts[i] for i in kept)
    model = sum(counts[i] * deltas[i] for i in kept) / total
    names = metrics[0].keys()
    return model, {k: sum(counts[i] * metrics[i][k] for i in kept) / total for k in names}


@pytest.mark.parametrize(("f", "keep"), [(0, 0), (1, 0), (1, 3), (2, 2)])
def test_krum_metrics_are_those_of_the_updates_it_keeps(f, keep):
    rng = np.random.default_rng(f * 10 + keep)
    deltas = [rng.normal(scale=0.1, size=5) for _ in range(7)]
    deltas[3] = np.full(5, 40.0)  # the outlier Krum leaves out
    counts = rng.integers(1, 50, size=7).tolist()
    metrics = [{"train_loss": float(rng.uniform(0, 2))} for _ in counts]
    metrics[3] = {"train_loss": 1e6}
    strategy = build_strategy("krum", num_malicious=f, num_to_keep=keep, min_fit_clients=1)
    state = fold_round(
        strategy, ModelState({"w": torch.zeros(5, dtype=torch.float64)}), 1, deltas, counts
    )
    want_model, want_metrics = krum_reference(deltas, counts, metrics, f, keep)
    np.testing.assert_allclose(state["w"].numpy(), want_model, rtol=1e-12)
    got = strategy.aggregate_metrics(list(zip(counts, metrics, strict=True)))
    assert got == pytest.approx(want_metrics, rel=1e-12)
    assert got["train_loss"] < 2  # the outlier's loss is not in the round's metrics


class OutlierTask(SyntheticTask):
    """Client 3 sends a wild update and reports a wild training loss."""

    def train(
        self, model: nn.Module, data: Dataset, config: dict, context: TaskContext
    ) -> TrainResult:
        result = super().train(model, data, config, context)
        if context.client_id != "client-3":
            return result
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        return TrainResult(result.num_examples, {"train_loss": 1e6})


def test_a_krum_simulation_reports_the_kept_clients_training_loss(tmp_path):
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:SyntheticTask",
            "rounds": 2,
            "num_clients": 6,
            "run_dir": str(tmp_path / "run"),
            "strategy": {
                "name": "krum",
                "min_fit_clients": 6,
                "min_available_clients": 6,
                "options": {"num_malicious": 1, "num_to_keep": 3},
            },
        },
    )
    task = OutlierTask(num_train=600, num_test=100)
    history = run_simulation(config, task=task).history
    assert all(r["clients"] == 6 for r in history)
    assert all(0 < r["train_loss"] < 5 for r in history)  # client-3's 1e6 left out


# -- the README's migration table ---------------------------------------------------------
def test_the_migration_tables_fedtrain_defaults_are_the_codes():
    rows = flower_default_rows()
    assert {(r[0], r[1]) for r in rows} >= {
        ("`fedavgm`", "`server_momentum`"),
        ("`fedprox`", "`proximal_mu`"),
        ("`fedadam`", "`tau`"),
        ("`fedadam`", "`bias_correction`"),
        ("`fedadagrad`", "`beta_1`"),
        ("`fedadagrad`", "`tau`"),
    }
    for name, option, ours, *_ in rows:
        strategy = build_strategy(name.strip("`"))
        assert getattr(strategy, option.strip("`")) == literal(ours), (name, option)
