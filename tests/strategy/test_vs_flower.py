"""Differential tests: each strategy against Flower 1.42's implementation, same inputs.

Flower's legacy strategies take full client weights; fedtrain's take deltas from the
global model. Feeding Flower `global + delta` and comparing the new global models
checks both the math and fedtrain's delta formulation. float64 throughout, so any
difference beyond rounding is a real disagreement.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
flwr = pytest.importorskip("flwr")
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server import strategy as flower  # noqa: E402

from fedtrain.strategy import build_strategy  # noqa: E402
from fedtrain.tensors import ModelState  # noqa: E402

SHAPES = {"conv.weight": (4, 3), "conv.bias": (4,), "head": (2, 2, 2)}


def fit_res(arrays: list[np.ndarray], n: int) -> tuple[None, FitRes]:
    return None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {})


def run_both(
    ours_name: str, ours_opts: dict, theirs, rounds: int, seed: int, flower_round=lambda r: r
) -> None:
    rng = np.random.default_rng(seed)
    g = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    ours = build_strategy(ours_name, min_fit_clients=1, min_available_clients=1, **ours_opts)
    global_state = ModelState({k: torch.tensor(v) for k, v in g.items()})
    flower_strategy = theirs(ndarrays_to_parameters(list(g.values())))
    flower_weights = list(g.values())
    for r in range(1, rounds + 1):
        n_clients = int(rng.integers(3, 9))
        deltas = [
            {k: rng.normal(scale=0.1, size=s) for k, s in SHAPES.items()} for _ in range(n_clients)
        ]
        counts = rng.integers(1, 100, size=n_clients).tolist()
        agg = ours.begin_round(r, global_state)
        for d, n in zip(deltas, counts, strict=True):
            agg.add({k: torch.tensor(v) for k, v in d.items()}, float(n))
        global_state = ours.finalize_round(r, global_state, agg)
        results = [
            fit_res([w + d[k] for w, k in zip(flower_weights, SHAPES, strict=True)], n)
            for d, n in zip(deltas, counts, strict=True)
        ]
        params, _ = flower_strategy.aggregate_fit(flower_round(r), results, [])
        flower_weights = parameters_to_ndarrays(params)
        for (name, ours_t), theirs_a in zip(global_state.items(), flower_weights, strict=True):
            np.testing.assert_allclose(
                ours_t.numpy(),
                theirs_a,
                rtol=1e-9,
                atol=1e-12,
                err_msg=f"{ours_name} round {r} tensor {name}",
            )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedavg(seed):
    run_both("fedavg", {}, lambda p: flower.FedAvg(initial_parameters=p), 3, seed)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedavgm(momentum):
    run_both(
        "fedavgm",
        {"server_lr": 0.7, "server_momentum": momentum},
        lambda p: flower.FedAvgM(
            initial_parameters=p, server_learning_rate=0.7, server_momentum=momentum
        ),
        4,
        3,
    )


def test_fedadam():
    # Flower corrects the bias with t = server_round + 1; fedtrain with t = steps taken.
    run_both(
        "fedadam",
        {"server_lr": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
        lambda p: flower.FedAdam(initial_parameters=p, eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3),
        4,
        4,
        flower_round=lambda r: r - 1,
    )


def test_fedyogi():
    run_both(
        "fedyogi",
        {"server_lr": 0.02, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
        lambda p: flower.FedYogi(initial_parameters=p, eta=0.02, beta_1=0.9, beta_2=0.99, tau=1e-3),
        4,
        5,
    )


def test_fedadagrad():
    # Flower's FedAdagrad has no server momentum (beta_1 = 0); Reddi et al.'s does.
    run_both(
        "fedadagrad",
        {"server_lr": 0.1, "beta_1": 0.0, "tau": 1e-3},
        lambda p: flower.FedAdagrad(initial_parameters=p, eta=0.1, tau=1e-3),
        4,
        6,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_fedmedian(seed):
    run_both("fedmedian", {}, lambda p: flower.FedMedian(initial_parameters=p), 3, seed)


@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_fedtrimmedavg(beta):
    run_both(
        "fedtrimmedavg",
        {"beta": beta},
        lambda p: flower.FedTrimmedAvg(initial_parameters=p, beta=beta),
        3,
        7,
    )


@pytest.mark.parametrize(("malicious", "keep"), [(0, 0), (1, 0), (1, 2)])
def test_krum(malicious, keep):
    run_both(
        "krum",
        {"num_malicious": malicious, "num_to_keep": keep},
        lambda p: flower.Krum(
            initial_parameters=p, num_malicious_clients=malicious, num_clients_to_keep=keep
        ),
        3,
        8,
    )
