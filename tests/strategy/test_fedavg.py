"""FedAvg against an independent float64 reference, and the strategy's planning rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.strategy import FedAvg, WeightedSum, build_strategy, compute_delta
from fedtrain.tensors import ModelState


def reference_fedavg(global_np: dict, deltas: list[dict], weights: list[float]) -> dict:
    """Textbook weighted mean in float64 numpy, written without fedtrain's helpers."""
    total = sum(weights)
    return {
        name: g + sum(w * d[name] for d, w in zip(deltas, weights, strict=True)) / total
        for name, g in global_np.items()
    }


@settings(max_examples=40, deadline=None)
@given(
    n_clients=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_fedavg_matches_float64_reference(n_clients, seed, dtype):
    rng = np.random.default_rng(seed)
    shapes = {"w": (3, 5), "b": (5,), "s": ()}
    global_np = {k: rng.normal(size=s) for k, s in shapes.items()}
    deltas = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(n_clients)]
    weights = rng.integers(1, 1000, size=n_clients).astype(float).tolist()

    global_state = ModelState({k: torch.tensor(v, dtype=dtype) for k, v in global_np.items()})
    strategy = FedAvg(min_fit_clients=1, min_available_clients=1)
    agg = strategy.begin_round(1, global_state)
    for d, w in zip(deltas, weights, strict=True):
        agg.add({k: torch.tensor(v, dtype=dtype) for k, v in d.items()}, w)
    new = strategy.finalize_round(1, global_state, agg)

    # the reference sees the same (dtype-rounded) inputs
    as_dtype = lambda a: torch.tensor(a, dtype=dtype).double().numpy()  # noqa: E731
    ref = reference_fedavg(
        {k: as_dtype(v) for k, v in global_np.items()},
        [{k: as_dtype(v) for k, v in d.items()} for d in deltas],
        weights,
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for k in shapes:
        assert new[k].dtype == dtype
        np.testing.assert_allclose(new[k].double().numpy(), ref[k], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_models_accumulate_in_float32_and_write_back_their_dtype(dtype):
    global_state = ModelState({"w": torch.zeros(1000, dtype=dtype)})
    agg = WeightedSum(global_state.specs)
    assert agg._sums["w"].dtype == torch.float32
    # 1000 tiny updates: a narrow accumulator would lose them all to rounding
    for _ in range(1000):
        agg.add({"w": torch.full((1000,), 1e-3, dtype=dtype)}, 1.0)
    new = FedAvg().finalize_round(1, global_state, agg)
    assert new["w"].dtype == dtype
    expected = torch.tensor(1e-3, dtype=dtype).float()
    torch.testing.assert_close(new["w"].float(), expected.expand(1000), rtol=1e-2, atol=0)


def test_integer_buffers_average_and_round():
    global_state = ModelState({"n": torch.tensor(10, dtype=torch.int64)})
    agg = WeightedSum(global_state.specs)
    agg.add({"n": torch.tensor(3)}, 1.0)
    agg.add({"n": torch.tensor(4)}, 1.0)
    assert FedAvg().finalize_round(1, global_state, agg)["n"].item() == 14  # 10 + round(3.5)


def test_compute_delta_is_local_minus_global():
    g = ModelState({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)})
    local = ModelState({"w": torch.tensor([1.5, 1.0]), "n": torch.tensor(7)})
    d = compute_delta(local, g)
    assert d["w"].tolist() == [0.5, -1.0] and d["n"].item() == 2


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"w": torch.tensor([float("nan"), 0.0])}, "NaN/Inf"),
        ({"w": torch.tensor([float("inf"), 0.0])}, "NaN/Inf"),
        ({"w": torch.zeros(3)}, r"model has float32 \(2,\)"),
        ({"w": torch.zeros(2, dtype=torch.float64)}, "model has float32"),
        ({"v": torch.zeros(2)}, "missing"),
    ],
)
def test_bad_updates_are_rejected_without_touching_the_sum(update, message):
    agg = WeightedSum(ModelState({"w": torch.zeros(2)}).specs)
    agg.add({"w": torch.ones(2)}, 2.0)
    with pytest.raises(UpdateRejected, match=message):
        agg.add(update, 1.0)
    assert agg.count == 1 and agg.total_weight == 2.0
    assert agg.mean()["w"].tolist() == [1.0, 1.0]


def test_chunked_folding_equals_whole_update():
    rng = torch.Generator().manual_seed(0)
    state = ModelState({"w": torch.zeros(100)})
    deltas = [torch.randn(100, generator=rng) for _ in range(3)]
    whole, chunked = WeightedSum(state.specs), WeightedSum(state.specs)
    for i, d in enumerate(deltas):
        whole.add({"w": d}, i + 1.0)
        for start in range(0, 100, 30):
            chunked.add_chunk("w", start, d[start : start + 30], i + 1.0)
        chunked.commit(i + 1.0)
    torch.testing.assert_close(whole.mean()["w"], chunked.mean()["w"], rtol=0, atol=0)


def test_sampling_respects_fraction_minimum_and_seed():
    s = FedAvg(fraction_fit=0.3, min_fit_clients=2, min_available_clients=3)
    ids = [f"c{i}" for i in range(10)]
    plan = s.configure_round(1, ids, np.random.default_rng(0))
    assert len(plan) == 3 and set(plan) <= set(ids)
    assert plan == s.configure_round(1, ids, np.random.default_rng(0))
    assert all(cfg["round"] == 1 for cfg in plan.values())
    assert s.configure_round(1, ids[:2], np.random.default_rng(0)) == {}  # below min_available
    assert (
        len(
            FedAvg(fraction_fit=0.01, min_fit_clients=2).configure_round(
                1, ids, np.random.default_rng(1)
            )
        )
        == 2
    )


def test_metrics_are_example_weighted():
    s = FedAvg()
    out = s.aggregate_metrics([(10, {"acc": 1.0}), (30, {"acc": 0.0, "loss": 2.0})])
    assert out == {"acc": 0.25, "loss": 2.0}


def test_strategy_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="fraction_fit"):
        FedAvg(fraction_fit=0.0)
    with pytest.raises(ConfigError, match="min_available_clients"):
        FedAvg(min_fit_clients=3, min_available_clients=2)
    with pytest.raises(ConfigError, match="unknown"):
        build_strategy("fedmagic")


def test_state_dict_roundtrip():
    s = FedAvg()
    s.load_state_dict(s.state_dict())
    with pytest.raises(ConfigError):
        s.load_state_dict({"momentum": 1})
