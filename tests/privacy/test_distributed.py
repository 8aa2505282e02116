"""Distributed DP through the real SecAgg+ round: calibrated noise, clipping, accounting."""

from __future__ import annotations

import math
import re

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError, SecAggError
from fedtrain.privacy.accounting import ORDERS
from fedtrain.privacy.clipping import clip_update, update_norm
from fedtrain.privacy.distributed import SITE_WEIGHT, DistributedDP
from fedtrain.secagg import SecAggConfig
from fedtrain.secagg.settings import SecAggSettings
from fedtrain.secagg.updates import secure_weighted_sum
from fedtrain.tensors import ModelState

D = 20_000  # coordinates: the sample variance is within ~1% (one std) of the truth
SPECS = ModelState({"w": torch.zeros(D), "steps": torch.tensor(0)}).specs


def config(dp: DistributedDP, clip: float = 4.0) -> SecAggConfig:
    """The secure-aggregation config that carries `dp` to the sites."""
    return SecAggConfig(clip=clip, max_clients=10, max_weight=1.0, **dp.protocol_fields())


def private_sum(deltas, dp: DistributedDP, cfg: SecAggConfig, **kwargs) -> torch.Tensor:
    """What a server decodes when every site clips, weighs 1 and noises (sum of `w`)."""
    clipped = [clip_update(d, dp.clip_norm)[0] for d in deltas]
    total = secure_weighted_sum(
        clipped, [SITE_WEIGHT] * len(deltas), SPECS, cfg, noise=dp.add_noise, **kwargs
    )
    assert total.total_weight == total.count  # weight 1 each: counts, never example counts
    return total.take_sums()["w"].double()


def zeros(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.zeros(D), "steps": torch.tensor(5)} for _ in range(n)]


@pytest.mark.parametrize(("sites", "dropped"), [(4, set()), (5, set()), (5, {3})])
def test_sum_noise_has_the_calibrated_variance(sites, dropped):
    """Each site adds sigma^2 = (z Delta)^2 / m, so n survivors' sum has n/m times the
    target variance (z Delta)^2: exactly the target at n = m, more with more survivors."""
    dp = DistributedDP(noise_multiplier=0.8, clip_norm=0.5, min_survivors=4)
    cfg = config(dp)
    noise = private_sum(zeros(sites), dp, cfg, dropouts={2: dropped}, rng=7)
    survivors = sites - len(dropped)
    q = cfg.quantizer()
    target = dp.noise_multiplier * dp.sensitivity(q, D) * q.step  # z * Delta, update units
    assert target == pytest.approx(0.8 * (0.5 + q.step * math.sqrt(D)))
    expected = target * math.sqrt(survivors / 4)
    assert dp.sum_noise_std(q, D, survivors) == pytest.approx(expected)
    std = float(noise.std())
    # sample std of 20,000 draws: relative standard error 1/sqrt(2 * 20,000) = 0.5%
    assert abs(std / expected - 1) < 0.03, (std, expected)
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(D)
    assert noise.abs().max() < 6 * expected  # a discrete Gaussian's tails, no wrap-around


def test_noise_comes_from_the_csprng_not_the_seed():
    """The seed drives stochastic rounding only; two runs with one seed differ."""
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=0.5, min_survivors=2)
    a = private_sum(zeros(2), dp, config(dp), rng=1)
    b = private_sum(zeros(2), dp, config(dp), rng=1)
    assert not torch.equal(a, b)


def test_each_site_is_clipped_before_it_is_noised():
    """Sites far beyond clip_norm add up to the sum of their clipped updates (+ noise)."""
    dp = DistributedDP(noise_multiplier=0.05, clip_norm=0.5, min_survivors=3)
    gen = torch.Generator().manual_seed(0)
    deltas = [{"w": torch.randn(D, generator=gen) * s, "steps": torch.tensor(1)} for s in (1, 3, 9)]
    assert min(update_norm(d) for d in deltas) > 100 * dp.clip_norm
    noised = private_sum(deltas, dp, config(dp), rng=0)
    clipped = sum(clip_update(d, dp.clip_norm)[0]["w"].double() for d in deltas)
    q = config(dp).quantizer()
    error = noised - clipped
    assert float(error.std()) == pytest.approx(dp.sum_noise_std(q, D, 3), rel=0.03)
    assert float(clipped.norm()) <= 3 * dp.clip_norm + 1e-6


def test_fewer_survivors_than_the_minimum_are_never_unmasked():
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=0.5, min_survivors=4)
    with pytest.raises(SecAggError, match="fewer than the 4 sites whose noise"):
        private_sum(zeros(5), dp, config(dp), dropouts={2: {1, 2}}, rng=0)


@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_epsilon_is_the_gaussian_mechanisms_with_multiplier_z(rate):
    """The aggregate is the Gaussian mechanism with noise multiplier z (see the variance
    test); its epsilon is dp-accounting's for that mechanism, composed per round."""
    dp = DistributedDP(noise_multiplier=1.3, clip_norm=1.0, min_survivors=5, delta=1e-5)
    accountant = dp.accountant()
    reference = rdp_privacy_accountant.RdpAccountant(orders=ORDERS)
    for _ in range(20):
        epsilon = accountant.step(rate)
        reference.compose(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.3))
        )
        assert epsilon == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    # an independent, tighter accountant agrees to within RDP's slack
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.3)), 20)
    assert pld.get_epsilon(1e-5) <= accountant.epsilon <= 1.3 * pld.get_epsilon(1e-5)


def test_grid_without_room_for_the_noise_is_refused_with_the_fix():
    """clip_norm = secagg.clip leaves no headroom: the noisy sum could wrap around."""
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=4.0, min_survivors=2)
    with pytest.raises(ConfigError, match=r"Raise secagg.clip to at least 24\.2"):
        dp.check(config(dp, clip=4.0).quantizer(), D)
    dp.check(config(dp, clip=24.3).quantizer(), D)  # the suggested value is enough


def test_secagg_privacy_table():
    base = {"enabled": True, "clip": 4.0, "max_clients": 10, "max_weight": 1.0}
    privacy = {"noise_multiplier": 1.0, "clip_norm": 0.5, "min_survivors": 3}
    settings = from_dict(SecAggSettings, {**base, "privacy": privacy})
    params = settings.protocol().round_params(1, [1, 2, 3], D)
    assert (params.dp_noise_multiplier, params.dp_clip_norm, params.dp_min_survivors) == (
        1.0,
        0.5,
        3,
    )
    site = DistributedDP.from_params(params)  # what a site rebuilds from SetupRequest
    assert site == DistributedDP(1.0, 0.5, 3, delta=site.delta)
    assert DistributedDP.from_params(SecAggConfig().round_params(1, [1, 2], 5)) is None
    with pytest.raises(ConfigError, match="min_survivors must be set"):
        from_dict(SecAggSettings, {**base, "privacy": {"noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match=re.escape("distributed DP needs it")):
        from_dict(SecAggSettings, {**base, "enabled": False, "privacy": privacy})
    with pytest.raises(ConfigError, match="does not fit the quantization range"):
        from_dict(SecAggSettings, {**base, "clip": 0.5, "privacy": privacy})
    with pytest.raises(ConfigError, match="sites declare weight 1"):
        half = {"max_weight": 0.5, "weight_resolution": 0.5}
        from_dict(SecAggSettings, {**base, **half, "privacy": privacy})


def test_noise_wraps_modulo_2_32_like_the_masks():
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=0.5, min_survivors=2)
    q = config(dp).quantizer()
    encoded = np.zeros(1001, dtype=np.uint32)
    encoded[-1] = 1
    dp.add_noise(encoded, q)
    signed = encoded[:-1].astype(np.int64)
    signed[signed >= 2**31] -= 2**32  # read back as two's complement
    assert encoded[-1] == 1  # the weight is never noised
    assert (signed < 0).any() and (signed > 0).any()
    assert abs(float(signed.std()) / dp.site_sigma(q, 1000) - 1) < 0.15


def test_a_restarted_server_replays_the_rounds_into_its_accountant():
    before = DistributedDP(1.0, 0.5, 2).accountant()
    for rate in (1.0, 0.5, 0.5):
        before.step(rate)
    after = DistributedDP(1.0, 0.5, 2).accountant()
    after.replay(before.sampling_rates)
    assert after.epsilon == before.epsilon and after.rounds == 3
    with pytest.raises(ConfigError, match="fresh accountant"):
        after.replay([1.0])


def test_a_driver_cannot_forget_the_noise_the_config_asks_for():
    with pytest.raises(SecAggError, match="no noise was given"):
        secure_weighted_sum(zeros(2), [1.0, 1.0], SPECS, config(DistributedDP(1.0, 0.5, 2)))
