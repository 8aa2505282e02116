"""Privacy accounting with Google's `dp-accounting` (RDP), never by hand.

Each round of client-level DP-FedAvg is a Gaussian mechanism with noise multiplier z
on the sum of clipped updates, applied to a Poisson sample of clients with rate q
(q = 1 when every site takes part, as in most cross-silo deployments).
"""

from __future__ import annotations

import logging

from fedtrain.errors import ConfigError

log = logging.getLogger(__name__)

# Integer Renyi orders: exact for the subsampled Gaussian, no numerical warnings.
ORDERS = [*range(2, 65), 80, 96, 128, 192, 256, 512, 1024]


class PrivacyAccountant:
    """Tracks epsilon for a fixed delta as rounds are composed."""

    def __init__(self, noise_multiplier: float, delta: float) -> None:
        try:
            import dp_accounting
            from dp_accounting.rdp import rdp_privacy_accountant
        except ImportError:  # pragma: no cover - dp-accounting is a core dependency
            raise ConfigError("privacy accounting needs `pip install dp-accounting`") from None
        if noise_multiplier <= 0:
            raise ConfigError(f"privacy.noise_multiplier must be > 0, got {noise_multiplier}")
        if not 0 < delta < 1:
            raise ConfigError(f"privacy.delta must be in (0, 1), got {delta}")
        self._dpa = dp_accounting
        self._accountant = rdp_privacy_accountant.RdpAccountant(orders=ORDERS)
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.rounds = 0
        #: One per composed round: what a checkpoint stores to `replay` after a restart.
        self.sampling_rates: list[float] = []

    def step(self, sampling_rate: float) -> float:
        """Compose one round; returns epsilon so far (for `delta`)."""
        if not 0 < sampling_rate <= 1:
            raise ConfigError(f"sampling rate must be in (0, 1], got {sampling_rate}")
        event = self._dpa.PoissonSampledDpEvent(
            sampling_rate, self._dpa.GaussianDpEvent(self.noise_multiplier)
        )
        self._accountant.compose(event)
        self.rounds += 1
        self.sampling_rates.append(sampling_rate)
        return self.epsilon

    def replay(self, sampling_rates: list[float]) -> None:
        """Compose the rounds of a checkpointed run, so that epsilon continues from there."""
        if self.rounds:
            raise ConfigError("replay a run's rounds into a fresh accountant only")
        for rate in sampling_rates:
            self.step(float(rate))

    @property
    def epsilon(self) -> float:
        return float(self._accountant.get_epsilon(self.delta)) if self.rounds else 0.0
