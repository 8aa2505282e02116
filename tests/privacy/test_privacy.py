"""DP building blocks: CSPRNG noise shapes, accounting, clipping, DP-FedAvg."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.privacy.accounting import PrivacyAccountant
from fedtrain.privacy.clipping import AdaptiveClip, clip_update, update_norm
from fedtrain.privacy.noise import discrete_gaussian, gaussian, uniform
from fedtrain.strategy import build_strategy
from fedtrain.tensors import ModelState


def test_uniform_is_open_interval_and_unseeded():
    u = uniform(100_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert not np.array_equal(uniform(8), uniform(8))


@pytest.mark.parametrize("std", [0.5, 3.0])
def test_gaussian_moments(std):
    z = gaussian(200_001, std)
    assert z.shape == (200_001,)
    assert abs(z.mean()) < 5 * std / math.sqrt(len(z))
    assert abs(z.std() / std - 1) < 0.01
    # tails: ~4.55% beyond 2 sigma
    assert abs(np.mean(np.abs(z) > 2 * std) - 0.0455) < 0.003


def test_discrete_gaussian_matches_its_pmf():
    sigma = 1.5
    samples = discrete_gaussian(200_000, sigma)
    assert samples.dtype == np.int64
    support = np.arange(-6, 7)
    pmf = np.exp(-(support**2) / (2 * sigma**2))
    pmf /= np.exp(-(np.arange(-40, 41) ** 2) / (2 * sigma**2)).sum()
    observed = np.array([(samples == k).sum() for k in support])
    expected = pmf * len(samples)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 40, chi2  # 12 degrees of freedom: p ~ 1e-4 at 40
    assert abs(discrete_gaussian(100_000, 20.0).std() / 20.0 - 1) < 0.02
    assert not discrete_gaussian(10, 0.0).any()


def test_accountant_grows_with_rounds_and_shrinks_with_noise():
    low, high = PrivacyAccountant(0.8, 1e-5), PrivacyAccountant(2.0, 1e-5)
    eps_low = [low.step(0.1) for _ in range(5)]
    eps_high = [high.step(0.1) for _ in range(5)]
    assert eps_low == sorted(eps_low) and len(set(eps_low)) == 5
    assert all(h < lo for h, lo in zip(eps_high, eps_low, strict=True))
    full = PrivacyAccountant(1.0, 1e-5)
    assert full.step(1.0) > PrivacyAccountant(1.0, 1e-5).step(0.01)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        PrivacyAccountant(0.0, 1e-5)
    with pytest.raises(ConfigError, match="delta"):
        PrivacyAccountant(1.0, 1.0)


def test_clipping_bounds_the_norm_and_leaves_small_updates_alone():
    big = {"a": torch.full((4,), 3.0), "b": torch.full((3,), 4.0)}
    clipped, norm = clip_update(big, 1.0)
    assert norm == pytest.approx(math.sqrt(36 + 48))
    assert update_norm(clipped) == pytest.approx(1.0, rel=1e-6)
    small = {"a": torch.full((4,), 0.1)}
    same, _ = clip_update(small, 1.0)
    assert torch.equal(same["a"], small["a"])


def test_adaptive_clip_moves_toward_the_target_quantile():
    clip = AdaptiveClip(initial=10.0, quantile=0.5, lr=0.5)
    norms = np.linspace(0.5, 1.5, 101)  # median 1.0
    for _ in range(100):
        clip.update(float(np.mean(norms <= clip.clip_norm)))
    assert 0.9 < clip.clip_norm < 1.1


def run_round(strategy, state, deltas):
    agg = strategy.begin_round(1, state)
    for d in deltas:
        agg.add(d, 123.0)  # example counts are ignored under DP
    return strategy.finalize_round(1, state, agg)


def test_dpfedavg_without_noise_is_the_mean_of_clipped_updates():
    s = build_strategy("dpfedavg", noise_multiplier=0.0, clip_norm=1.0)
    state = ModelState({"w": torch.zeros(3, dtype=torch.float64)})
    deltas = [
        {"w": torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)},  # norm 5 -> 1
        {"w": torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64)},
    ]
    out = run_round(s, state, deltas)
    expected = (np.array([0.6, 0.8, 0.0]) + np.array([0.1, 0, 0])) / 2
    np.testing.assert_allclose(out["w"].numpy(), expected, rtol=1e-12)


def test_dpfedavg_noise_has_the_calibrated_scale_and_epsilon_is_reported():
    s = build_strategy(
        "dpfedavg", noise_multiplier=2.0, clip_norm=0.5, min_fit_clients=4, min_available_clients=4
    )
    plan = s.configure_round(1, [f"c{i}" for i in range(8)], np.random.default_rng(0))
    assert len(plan) == 8
    state = ModelState({"w": torch.zeros(100_000)})
    out = run_round(s, state, [{"w": torch.zeros(100_000)}] * 8)
    # sum of zeros + N(0, (z C)^2), divided by the 8 selected clients
    assert float(out["w"].std()) == pytest.approx(2.0 * 0.5 / 8, rel=0.02)
    metrics = s.round_metrics()
    assert metrics["clip_norm"] == 0.5 and metrics["epsilon"] > 0


def test_dpfedavg_resumes_its_privacy_budget():
    a = build_strategy("dpfedavg", noise_multiplier=1.0)
    state = ModelState({"w": torch.zeros(4)})
    for _ in range(3):
        run_round(a, state, [{"w": torch.ones(4)}] * 2)
    b = build_strategy("dpfedavg", noise_multiplier=1.0)
    b.load_state_dict(a.state_dict())
    assert b.accountant.epsilon == pytest.approx(a.accountant.epsilon)
    assert b.accountant.rounds == 3
