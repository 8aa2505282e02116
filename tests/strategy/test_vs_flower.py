"""Differential tests: each strategy against Flower 1.42's implementation, same inputs.

Flower's legacy strategies take full client weights; fedtrain's take deltas from the
global model. Feeding Flower `global + delta` and comparing the new global models
checks both the math and fedtrain's delta formulation. float64 throughout, so any
difference beyond rounding is a real disagreement. The Message-API strategies
(`flwr.serverapp.strategy`, what Flower's current apps use) are checked too, on
float32 models as a Flower app sends them. Checks of the same behaviour that run
without Flower, against independent references, are in test_flower_forms.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
flwr = pytest.importorskip("flwr")
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.app.metadata import Metadata  # noqa: E402
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server import strategy as flower  # noqa: E402
from flwr.serverapp import strategy as flower_app  # noqa: E402

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
    # Flower corrects the bias with t = server_round + 1; fedtrain by default with
    # t = steps taken, which is Flower's formula one round earlier.
    run_both(
        "fedadam",
        {"server_lr": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
        lambda p: flower.FedAdam(initial_parameters=p, eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3),
        4,
        4,
        flower_round=lambda r: r - 1,
    )


def test_fedadam_with_flowers_bias_correction_reproduces_flower():
    run_both(
        "fedadam",
        {"server_lr": 0.05, "tau": 1e-9, "bias_correction": "flower"},
        lambda p: flower.FedAdam(initial_parameters=p, eta=0.05),  # legacy defaults: tau 1e-9
        4,
        4,
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


# -- the Message API (flwr.serverapp.strategy) ---------------------------------------------
def reply(arrays: dict[str, np.ndarray], metrics: dict[str, float]) -> Message:
    """A ClientApp's train reply as Flower's strategies receive it."""
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    content = RecordDict({"arrays": record, "metrics": MetricRecord(metrics)})
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=2,
        dst_node_id=1,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=3600.0,
        message_type="train",
    )
    return Message(content, metadata=metadata)


def round_inputs(rng, shapes, n_clients, outlier: bool = False):
    """(deltas, example counts, train metrics) of one round, optionally one outlier."""
    deltas = [
        {k: rng.normal(scale=0.1, size=s).astype(np.float32) for k, s in shapes.items()}
        for _ in range(n_clients)
    ]
    if outlier:
        deltas[int(rng.integers(n_clients))] = {
            k: np.full(s, 50.0, dtype=np.float32) for k, s in shapes.items()
        }
    counts = rng.integers(1, 100, size=n_clients).tolist()
    metrics = [
        {"train_loss": float(rng.uniform(0, 2)), "acc": float(rng.uniform())} for _ in counts
    ]
    return deltas, counts, metrics


def run_message_api(ours, theirs, rounds: int, seed: int, outlier: bool = False, rtol=2e-6):
    """fedtrain's strategy and a Message-API Flower strategy on the same float32 rounds:
    the same global arrays and the same aggregated train metrics."""
    rng = np.random.default_rng(seed)
    arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    state = ModelState({k: torch.from_numpy(v.copy()) for k, v in arrays.items()})
    for r in range(1, rounds + 1):
        deltas, counts, metrics = round_inputs(rng, SHAPES, int(rng.integers(4, 9)), outlier)
        agg = ours.begin_round(r, state)
        for d, n in zip(deltas, counts, strict=True):
            agg.add({k: torch.from_numpy(v) for k, v in d.items()}, float(n))
        state = ours.finalize_round(r, state, agg)
        our_metrics = ours.aggregate_metrics(list(zip(counts, metrics, strict=True)))

        theirs.current_arrays = dict(arrays)  # what configure_train records
        replies = [
            reply({k: arrays[k] + d[k] for k in SHAPES}, {**m, "num-examples": n})
            for d, n, m in zip(deltas, counts, metrics, strict=True)
        ]
        record, their_metrics = theirs.aggregate_train(r, replies)
        arrays = {k: np.asarray(a.numpy(), dtype=np.float32) for k, a in record.items()}
        for name, got in state.items():
            np.testing.assert_allclose(
                got.numpy(), arrays[name], rtol=rtol, atol=1e-6, err_msg=f"round {r} {name}"
            )
        assert our_metrics == pytest.approx(dict(their_metrics), rel=1e-9), f"round {r}"


def test_fedadam_flower_form_matches_the_message_api_fedadam():
    ours = build_strategy(
        "fedadam", min_fit_clients=1, min_available_clients=1, tau=1e-3, bias_correction="flower"
    )
    run_message_api(ours, flower_app.FedAdam(), rounds=4, seed=9)  # Message API: tau 1e-3


@pytest.mark.parametrize(("malicious", "keep"), [(0, 0), (1, 0), (1, 3), (2, 2)])
def test_krum_keeps_flowers_choice_and_its_metrics_come_from_the_kept_updates(malicious, keep):
    ours = build_strategy(
        "krum",
        min_fit_clients=1,
        min_available_clients=1,
        num_malicious=malicious,
        num_to_keep=keep,
    )
    theirs = (
        flower_app.MultiKrum(num_malicious_nodes=malicious, num_nodes_to_select=keep)
        if keep
        else flower_app.Krum(num_malicious_nodes=malicious)
    )
    run_message_api(ours, theirs, rounds=3, seed=10 + keep, outlier=True)


# -- the README's table of defaults that differ from Flower ---------------------------------
FLOWER_CLASS = {
    "fedavgm": "FedAvgM",
    "fedprox": "FedProx",
    "fedadam": "FedAdam",
    "fedadagrad": "FedAdagrad",
}


def test_the_migration_tables_flower_columns_are_flowers_defaults():
    import inspect

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from readme_tables import flower_default_rows, literal

    checked = 0
    for name, option, _, legacy, message_api in flower_default_rows():
        cls_name = FLOWER_CLASS[name.strip("`")]
        for module, cell in ((flower, legacy), (flower_app, message_api)):
            params = inspect.signature(getattr(module, cls_name).__init__).parameters
            param = params.get(option.strip("`"))
            if cell == "required":
                assert param is not None and param.default is inspect.Parameter.empty
            elif cell.startswith("none"):
                assert param is None, (name, option, module.__name__)
            elif (value := literal(cell)) is not None:
                assert param is not None and param.default == value, (name, option, module)
            else:
                continue
            checked += 1
    assert checked >= 10
