"""Fixed-point encoding: the no-wrap budget, and decoding within the documented bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrain.errors import SecAggError
from fedtrain.secagg import Quantizer, SecAggConfig, max_bits_for


def test_max_bits_is_the_largest_that_cannot_wrap() -> None:
    for n in (1, 2, 3, 100, 1000, 4096, 100_000):
        bits = max_bits_for(n)
        assert n * ((1 << bits) - 1) < 1 << 32
        assert bits == 32 or n * ((1 << (bits + 1)) - 1) >= 1 << 32


def test_overflowing_config_is_refused_with_the_numbers() -> None:
    with pytest.raises(SecAggError, match=r"200 \* \(2\^25 - 1\)") as err:
        Quantizer(clip=1.0, bits=25, max_clients=200, max_weight=10.0)
    assert "2^32" in str(err.value)
    with pytest.raises(SecAggError, match="wrap"):
        SecAggConfig(max_clients=1000, bits=23)
    # The largest safe setting is accepted.
    SecAggConfig(max_clients=1000, bits=max_bits_for(1000))


def test_weight_budget_is_checked() -> None:
    with pytest.raises(SecAggError, match="weights can wrap"):
        Quantizer(clip=1.0, bits=8, max_clients=100, max_weight=1e8)
    q = Quantizer(clip=1.0, bits=8, max_clients=100, max_weight=50.0)
    with pytest.raises(SecAggError, match="exceeds max_weight"):
        q.encode(np.zeros(3), 51.0, np.random.default_rng(0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_updates_are_refused(bad: float) -> None:
    q = SecAggConfig().quantizer()
    with pytest.raises(SecAggError, match="NaN or Inf"):
        q.encode(np.array([0.0, bad]), 1.0, np.random.default_rng(0))


def test_encoding_layout_and_clipping() -> None:
    q = Quantizer(clip=0.5, bits=16, max_clients=10, max_weight=4.0)
    x = np.array([-10.0, -0.5, 0.0, 0.5, 10.0], dtype=np.float32)
    enc = q.encode(x, 4.0, np.random.default_rng(1))
    assert enc.dtype == np.uint32 and enc.shape == (6,)
    assert enc[-1] == 4  # weight, exact
    assert enc[0] == 0 and enc[1] == 0  # -clip * max_weight -> 0
    assert enc[3] == q.levels and enc[4] == q.levels  # +clip * max_weight -> L
    assert abs(int(enc[2]) - q.levels / 2) <= 0.5


def test_stochastic_rounding_is_unbiased() -> None:
    q = Quantizer(clip=1.0, bits=4, max_clients=10, max_weight=1.0)
    x = np.full(200_000, 0.123)
    enc = q.encode(x, 1.0, np.random.default_rng(2))
    values, _ = q.decode_sum(enc, 1)
    assert abs(values.mean() - 0.123) < 0.01 * q.step
    assert np.all(np.abs(values - 0.123) < q.step)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 20),
    m=st.integers(1, 50),
    bits=st.integers(2, 24),
    seed=st.integers(0, 2**32 - 1),
)
def test_decoded_sum_and_mean_within_bound(n: int, m: int, bits: int, seed: int) -> None:
    bits = min(bits, max_bits_for(20))
    q = Quantizer(clip=2.0, bits=bits, max_clients=20, max_weight=1000.0)
    rng = np.random.default_rng(seed)
    xs = rng.normal(0.0, 2.0, size=(n, m))
    ws = rng.integers(0, 1001, size=n).astype(float)
    ws[0] = max(ws[0], 1.0)
    total = np.zeros(m + 1, dtype=np.uint32)
    for x, w in zip(xs, ws, strict=True):
        total += q.encode(x, w, rng)
    values, weight = q.decode_sum(total, n)
    expected = (np.clip(xs, -2.0, 2.0) * ws[:, None]).sum(axis=0)
    assert weight == ws.sum()
    assert np.all(np.abs(values - expected) < n * q.step)
    mean = q.decode_mean(total, n)
    bound = q.mean_error_bound(n, weight)
    assert np.all(np.abs(mean - expected / ws.sum()) < bound)


def test_fractional_weights_round_to_the_resolution() -> None:
    q = Quantizer(clip=1.0, bits=16, max_clients=10, max_weight=10.0, weight_resolution=0.25)
    assert q.effective_weight(2.3) == 2.25
    assert q.encode(np.zeros(2), 2.3, np.random.default_rng(0))[-1] == 9


def test_zero_total_weight_has_no_mean() -> None:
    q = SecAggConfig().quantizer()
    total = q.encode(np.zeros(4), 0.0, np.random.default_rng(0))
    with pytest.raises(SecAggError, match="total weight"):
        q.decode_mean(total, 1)


def test_decode_refuses_more_contributors_than_budgeted() -> None:
    q = Quantizer(clip=1.0, bits=8, max_clients=10, max_weight=10.0)
    with pytest.raises(SecAggError, match="max_clients"):
        q.decode_sum(np.zeros(3, dtype=np.uint32), 11)


def test_config_refuses_bad_graph_parameters() -> None:
    with pytest.raises(SecAggError, match="insecure"):
        SecAggConfig(k=12, t=6)
    with pytest.raises(SecAggError, match="exceeds"):
        SecAggConfig(k=4, t=9)
    with pytest.raises(SecAggError, match="t but not k"):
        SecAggConfig(t=5)
    with pytest.raises(SecAggError, match="max_clients=3"):
        SecAggConfig(max_clients=3).round_params(1, [1, 2, 3, 4], 10)
