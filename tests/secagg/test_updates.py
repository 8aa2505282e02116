"""Model updates <-> secagg vectors, the unmasked sum as a strategy's WeightedSum, and the
`[secagg]` config table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError, SecAggError
from fedtrain.secagg import SecAggConfig
from fedtrain.secagg.settings import SecAggSettings, require_sum_only
from fedtrain.secagg.updates import UpdateLayout, secure_weighted_sum
from fedtrain.strategy import FedAvg, FedMedian, WeightedSum
from fedtrain.strategy.aggregate import apply_mean_delta
from fedtrain.tensors import ModelState


def _model(seed: int = 0) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    return ModelState(
        {
            "conv.weight": torch.randn(4, 3, generator=gen),
            "bn.num_batches_tracked": torch.tensor(7),
            "head.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
            "head.bias": torch.randn(2, generator=gen).double(),
            "mask": torch.tensor([True, False]),
        }
    )


def _delta(seed: int) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    return ModelState(
        {
            name: (torch.randn(t.shape, generator=gen) / 4).to(t.dtype)
            if t.is_floating_point()
            else torch.ones_like(t)
            for name, t in _model().items()
        }
    )


def test_layout_takes_float_tensors_in_model_order_and_leaves_integers_home() -> None:
    model = _model()
    layout = UpdateLayout.of(model.specs)
    assert layout.length == 12 + 5 + 2
    assert layout.excluded == ("bn.num_batches_tracked", "mask")
    delta = _delta(1)
    vector = layout.flatten(delta)
    assert vector.dtype == np.float32 and vector.shape == (19,)
    back = layout.unflatten(vector)
    assert back["conv.weight"].equal(delta["conv.weight"])
    assert back["head.weight"].dtype == torch.bfloat16
    assert back["head.weight"].equal(delta["head.weight"])  # bf16 -> f32 -> bf16 is exact
    assert torch.allclose(back["head.bias"], delta["head.bias"], atol=1e-7)
    assert back["bn.num_batches_tracked"].item() == 0 and not back["mask"].any()


def test_flatten_delta_is_local_minus_global_without_rounding_narrow_floats() -> None:
    base = _model(0)
    local = ModelState({k: (v + 1 if v.is_floating_point() else v) for k, v in base.items()})
    vector = UpdateLayout.of(base.specs).flatten_delta(local, base)
    expected = np.concatenate(
        [
            (local[n].double() - base[n].double()).reshape(-1).numpy()
            for n in ("conv.weight", "head.weight", "head.bias")
        ]
    )
    np.testing.assert_allclose(vector, expected, atol=1e-6)
    with pytest.raises(SecAggError, match=r"'conv\.weight': expected 12 values"):
        UpdateLayout.of(base.specs).flatten({"conv.weight": torch.zeros(3)})


def test_a_model_of_integers_only_cannot_be_aggregated_securely() -> None:
    with pytest.raises(SecAggError, match="no floating-point values"):
        UpdateLayout.of(ModelState({"steps": torch.arange(3)}).specs)


def test_secure_weighted_sum_matches_the_plain_weighted_sum_within_the_bound() -> None:
    model = _model()
    deltas = [_delta(s) for s in range(1, 5)]
    weights = [30.0, 5.0, 12.0, 53.0]
    config = SecAggConfig(clip=1.0, max_clients=8, max_weight=100.0)
    secure = secure_weighted_sum(deltas, weights, model.specs, config, rng=0)
    plain = WeightedSum(model.specs)
    for d, w in zip(deltas, weights, strict=True):
        plain.add(d, w)
    assert secure.count == 4 and secure.total_weight == plain.total_weight == 100.0
    bound = config.quantizer().mean_error_bound(4, 100.0)
    got, want = secure.mean(), plain.mean()
    for name in ("conv.weight", "head.weight", "head.bias"):
        # Narrow floats: the plain path sums bf16 deltas, the secure one their float32 values.
        assert (got[name].double() - want[name].double()).abs().max() <= bound + 1e-6, name
    assert not got["bn.num_batches_tracked"].any()  # the server keeps its own counter
    new = apply_mean_delta(model, secure.mean())
    assert new["bn.num_batches_tracked"].item() == 7 and new["mask"].tolist() == [True, False]


def test_a_dropped_site_is_left_out_of_the_secure_sum() -> None:
    model = _model()
    deltas = [_delta(s) for s in range(1, 4)]
    config = SecAggConfig(clip=1.0, max_clients=8, max_weight=100.0)
    secure = secure_weighted_sum(deltas, [10, 20, 30], model.specs, config, dropouts={2: [3]})
    plain = WeightedSum(model.specs)
    plain.add(deltas[0], 10)
    plain.add(deltas[1], 20)
    assert secure.count == 2 and secure.total_weight == 30
    bound = config.quantizer().mean_error_bound(2, 30.0)
    diff = secure.mean()["conv.weight"] - plain.mean()["conv.weight"]
    assert diff.abs().max() <= bound + 1e-6


def test_secagg_table_defaults_shorthand_and_errors_name_the_key() -> None:
    assert not SecAggSettings().enabled
    assert from_dict(SecAggSettings, {"clip": 2}).protocol().clip == 2.0
    settings = SecAggSettings(bits=0, k=0, t=0)
    assert settings.protocol().bits is None and settings.protocol().k is None
    assert SecAggSettings.from_scalar(True, "secagg") == {"enabled": True}
    with pytest.raises(ConfigError, match="secagg = 'yes' should be true, false or a table"):
        SecAggSettings.from_scalar("yes", "secagg")
    with pytest.raises(ConfigError, match=r"secagg: sum of 100 updates at 31 bits"):
        SecAggSettings(bits=31)
    with pytest.raises(ConfigError, match=r"secagg.k must be >= 0"):
        SecAggSettings(k=-1)
    with pytest.raises(ConfigError, match=r"secagg: threshold t=2 is insecure"):
        SecAggSettings(k=4, t=2)


def test_strategies_that_need_every_update_are_refused() -> None:
    require_sum_only(FedAvg)
    with pytest.raises(ConfigError, match=r"'fedmedian' cannot run with secure aggregation"):
        require_sum_only(FedMedian(min_fit_clients=2))
