"""Distributed DP: every site noises its own quantized update, so that the *sum* is private.

Under secure aggregation the server never sees an update, so it cannot clip or noise
one (that is central DP, the `dpfedavg` strategy). Instead each site, before masking:

1. clips its update to L2 norm `clip_norm` (its largest influence on the sum: the
   sensitivity) and takes part with weight 1, not its example count (a count would
   change the sensitivity, and is what secure aggregation hides anyway);
2. quantizes it onto secure aggregation's integer grid of step ``s``
   (`fedtrain.secagg.quantize`: stochastic rounding, so each coordinate moves by less
   than one grid step);
3. adds discrete Gaussian noise N_Z(0, sigma^2) to every integer, drawn from the CSPRNG
   (`fedtrain.privacy.noise.discrete_gaussian`). Integers plus integers stay on the
   grid the masks live on, so the noise survives masking and unmasking exactly.

Calibration, in plain words: the server only ever decodes the sum over the sites that
survived the round, and the noise in that sum is the sum of their noises, with
variance ``n * sigma^2`` for ``n`` survivors. Each site adds
``sigma^2 = (z * Delta)^2 / min_survivors``, where ``Delta = clip_norm / s + sqrt(d)``
is the sensitivity in grid steps (the clipped update, plus at most one step of
rounding in each of the ``d`` coordinates). As long as at least ``min_survivors``
sites survive (with fewer, the round must fail: `SecAggServer` is given that minimum),
the sum carries noise of standard deviation at least ``z * Delta``: it is the
Gaussian mechanism with noise multiplier ``z``, accounted with `PrivacyAccountant`.

Sums of discrete Gaussians are not exactly a discrete Gaussian; Kairouz, Liu & Steinke
(2021, "The Distributed Discrete Gaussian Mechanism") bound the difference by
``tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``, which vanishes for
the sigmas used here (hundreds of grid steps and more); `check` refuses a grid so
coarse that it would not.

Trust: the guarantee holds against the server and any outsider. Sites that collude
with the server know their own noise and can subtract it: the noise left is then
that of the honest survivors only, so size `min_survivors` to the honest sites you
can count on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedtrain.config import option
from fedtrain.errors import ConfigError, SecAggError
from fedtrain.privacy.accounting import PrivacyAccountant
from fedtrain.privacy.noise import discrete_gaussian
from fedtrain.secagg.messages import RoundParams
from fedtrain.secagg.quantize import MODULUS, Quantizer
from fedtrain.secagg.round_ids import describe

#: Weight every site declares under distributed DP (see the module docstring).
SITE_WEIGHT = 1.0
#: Standard deviations of the summed noise that must fit in the decodable range.
TAIL_SIGMAS = 10.0
#: Largest tolerated ``tau * d`` (Kairouz et al.'s deviation from a discrete Gaussian).
MAX_TAU_TERM = 1e-9


@dataclass(frozen=True)
class DistributedDP:
    """The per-site noise of distributed DP for one configuration (see the module doc)."""

    noise_multiplier: float
    clip_norm: float
    min_survivors: int
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ConfigError(
                f"secagg.privacy.noise_multiplier must be > 0, got {self.noise_multiplier}"
            )
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ConfigError(f"secagg.privacy.clip_norm must be > 0, got {self.clip_norm}")
        if self.min_survivors < 1:
            raise ConfigError(
                f"secagg.privacy.min_survivors must be >= 1, got {self.min_survivors}"
            )
        if not 0 < self.delta < 1:
            raise ConfigError(f"secagg.privacy.delta must be in (0, 1), got {self.delta}")

    # -- the site's side ------------------------------------------------------------------
    def clip(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` scaled to L2 norm <= clip_norm (a float32 copy); norm taken in float64."""
        out = np.array(vector, dtype=np.float32, copy=True).reshape(-1)
        norm = float(np.linalg.norm(out.astype(np.float64)))
        if norm > self.clip_norm:
            out *= np.float32(self.clip_norm / norm)
        return out

    def sensitivity(self, quantizer: Quantizer, length: int) -> float:
        """L2 sensitivity of one site's encoded update, in grid steps."""
        weight = quantizer.effective_weight(SITE_WEIGHT)
        return self.clip_norm * weight / quantizer.step + math.sqrt(length)

    def site_sigma(self, quantizer: Quantizer, length: int) -> float:
        """Std of the discrete Gaussian each site adds to each coordinate, in grid steps."""
        return (
            self.noise_multiplier
            * self.sensitivity(quantizer, length)
            / math.sqrt(self.min_survivors)
        )

    def add_noise(self, encoded: np.ndarray, quantizer: Quantizer) -> None:
        """The secure-aggregation client's hook: noise ``encoded`` in place, before masking.

        ``encoded`` is the quantizer's uint32 output with the weight last; the weight is
        left alone (it is 1 for every site, public anyway). Addition wraps modulo 2^32,
        as the masks do; `check` ensures the *sum* still decodes.
        """
        values = encoded[:-1]
        sigma = self.site_sigma(quantizer, values.size)
        noise = discrete_gaussian(values.size, sigma) % MODULUS  # two's complement in Z_2^32
        np.add(values, noise.astype(np.uint32), out=values)

    # -- configuration checks ---------------------------------------------------------------
    def check(self, quantizer: Quantizer, length: int) -> None:
        """Refuse a secure-aggregation grid that cannot carry this noise, with the numbers.

        * every site's weight 1 must be encodable;
        * the summed noise (TAIL_SIGMAS standard deviations) must stay inside what the
          server can decode, [0, 2^32), for any number of survivors from
          ``min_survivors`` to ``max_clients``;
        * the grid must be fine enough that sums of discrete Gaussians are discrete
          Gaussians for accounting purposes (Kairouz et al.'s tau).
        """
        if self.min_survivors > quantizer.max_clients:
            raise ConfigError(
                f"secagg.privacy.min_survivors = {self.min_survivors} exceeds "
                f"secagg.max_clients = {quantizer.max_clients}"
            )
        try:
            weight = quantizer.effective_weight(SITE_WEIGHT)
        except SecAggError as exc:
            raise ConfigError(f"secagg.privacy: sites declare weight 1, but {exc}") from None
        if weight <= 0:
            raise ConfigError(
                f"secagg.weight_resolution = {quantizer.weight_resolution} rounds the weight 1 "
                "of every site to 0 under distributed DP; set it to 1"
            )
        sigma = self.site_sigma(quantizer, length)
        half = quantizer.levels / 2.0
        # largest |encoded value - L/2| of one site's coordinate: its clipped value, plus
        # one step of rounding
        signal = min(half, min(self.clip_norm, quantizer.clip) * weight / quantizer.step + 1)
        low_room = (half - signal) * math.sqrt(self.min_survivors)
        needed = TAIL_SIGMAS * sigma
        n_max = quantizer.max_clients
        top = n_max * (half + signal) + TAIL_SIGMAS * sigma * math.sqrt(n_max)
        if low_room < needed or top >= MODULUS:
            wanted = self.clip_norm * (1 + TAIL_SIGMAS * self.noise_multiplier / self.min_survivors)
            raise ConfigError(
                f"secagg: the distributed-DP noise (std {sigma:.3g} grid steps per site) does "
                f"not fit the quantization range: the sum of {self.min_survivors}-"
                f"{n_max} sites could wrap around. Raise secagg.clip to at least "
                f"{wanted * 1.01:.3g} (now {quantizer.clip:g}; values are clipped to "
                f"clip_norm = {self.clip_norm:g} anyway) or lower secagg.bits"
            )
        tau = 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, n_max))
        if tau * length > MAX_TAU_TERM:
            raise ConfigError(
                f"secagg: the distributed-DP noise is {sigma:.3g} grid steps per site, too "
                "coarse a grid for sums of discrete Gaussians to be accounted as Gaussian "
                f"(tau * d = {tau * length:.2g}); raise secagg.bits or lower secagg.clip"
            )

    @classmethod
    def from_params(cls, params: RoundParams) -> DistributedDP | None:
        """What a round's parameters ask of a site (None: no DP), checked by the site."""
        if params.dp_noise_multiplier <= 0:
            return None
        try:
            dp = cls(params.dp_noise_multiplier, params.dp_clip_norm, params.dp_min_survivors)
            dp.check(params.quantizer(), params.vector_length)
        except ConfigError as exc:
            raise SecAggError(
                f"{describe(params.round_id)}: distributed-DP parameters refused: {exc}"
            ) from None
        return dp

    def protocol_fields(self) -> dict[str, float | int]:
        """The `SecAggConfig` fields that carry this mechanism to the sites."""
        return {
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_clip_norm": self.clip_norm,
            "dp_min_survivors": self.min_survivors,
        }

    # -- the server's side ------------------------------------------------------------------
    def accountant(self) -> PrivacyAccountant:
        """Epsilon of the aggregate: the Gaussian mechanism with multiplier z per round."""
        return PrivacyAccountant(self.noise_multiplier, self.delta)

    def sum_noise_std(self, quantizer: Quantizer, length: int, survivors: int) -> float:
        """Std of the noise in the decoded sum of ``survivors`` updates, in update units."""
        return self.site_sigma(quantizer, length) * math.sqrt(survivors) * quantizer.step


@dataclass
class DistributedDPSettings:
    """``[secagg.privacy]``: distributed DP under secure aggregation (off by default)."""

    noise_multiplier: float = option(
        0.0,
        "Distributed DP (with secure aggregation): noise multiplier z of the sum, i.e. its "
        "noise std / clip_norm when min_survivors sites survive. Each site adds discrete "
        "Gaussian noise of variance (z * clip_norm)^2 / min_survivors to its quantized "
        "update. 0: off.",
    )
    clip_norm: float = option(
        1.0,
        "Distributed DP: each site clips its whole update to this L2 norm and takes part "
        "with weight 1 (not its example count). Keep secagg.clip above it (the check says "
        "by how much).",
    )
    min_survivors: int = option(
        0,
        "Distributed DP: fewest sites whose noise the sum must hold; the server refuses to "
        "unmask a sum of fewer. Required with noise_multiplier; at most "
        "strategy.min_fit_clients, and only sites you trust count (see the README).",
    )
    delta: float = option(1e-5, "Distributed DP: the delta that epsilon is reported for.")

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ConfigError(
                f"secagg.privacy.noise_multiplier must be >= 0 (0: off), got "
                f"{self.noise_multiplier}"
            )
        if self.enabled:
            if self.min_survivors < 1:
                raise ConfigError(
                    "secagg.privacy.min_survivors must be set (>= 1) with noise_multiplier: "
                    "each site's noise is calibrated so that the sum of that many sites' "
                    "noise reaches the target"
                )
            self.build()

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier > 0

    def build(self) -> DistributedDP:
        return DistributedDP(
            noise_multiplier=self.noise_multiplier,
            clip_norm=self.clip_norm,
            min_survivors=self.min_survivors,
            delta=self.delta,
        )
