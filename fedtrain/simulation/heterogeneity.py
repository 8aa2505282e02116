"""Simulated device differences: per-client local epochs and speeds, and dropouts.

Real federations are uneven: some devices finish more local work than others, some
are slower, and some chosen clients never report (battery, network, a straggler
past the deadline). All are drawn from the run's seed on streams of their own, so
switching them on does not change which clients the strategy samples, and every
backend sees the same draws. Dataset-size skew is the `quantity` partitioner's job.
Speeds only matter where time does: the asynchronous (FedBuff) engine's virtual clock.
"""

from __future__ import annotations

import numpy as np

from fedtrain.simulation.config import HeterogeneityConfig
from fedtrain.strategy import RoundConfig

# Independent random streams under the run's seed (numpy SeedSequence entropy words).
_EPOCHS_STREAM = 0x45504F43
_DROPOUT_STREAM = 0x44524F50
_SPEED_STREAM = 0x53504545
_JOB_DROPOUT_STREAM = 0x4A4F4244


class Heterogeneity:
    """Applies `HeterogeneityConfig` to round configs and participant lists."""

    def __init__(self, config: HeterogeneityConfig, num_clients: int, seed: int) -> None:
        self.dropout_rate = config.dropout_rate
        self.seed = seed
        self.epochs: np.ndarray | None = None
        if config.epochs_range:
            low, high = config.epochs_range
            rng = np.random.default_rng([seed, _EPOCHS_STREAM])
            self.epochs = rng.integers(low, high + 1, size=num_clients)
        self.slowdown: np.ndarray | None = None
        if config.speed_range:
            low, high = config.speed_range
            rng = np.random.default_rng([seed, _SPEED_STREAM])
            self.slowdown = np.exp(rng.uniform(np.log(low), np.log(high), size=num_clients))

    def client_config(self, client_index: int, config: RoundConfig) -> RoundConfig:
        """`config` with this client's own number of local epochs, if they differ."""
        if self.epochs is None:
            return config
        return {**config, "epochs": int(self.epochs[client_index])}

    def dropouts(self, server_round: int, chosen: list[str]) -> set[str]:
        """Which of the round's `chosen` clients never report: round(rate * n) of them."""
        count = int(self.dropout_rate * len(chosen) + 0.5)
        if count == 0:
            return set()
        rng = np.random.default_rng([self.seed, _DROPOUT_STREAM, server_round])
        return {chosen[i] for i in rng.choice(len(chosen), size=count, replace=False)}

    def job_duration(self, client_index: int, num_examples: int, config: RoundConfig) -> float:
        """Virtual time a client takes for one training job: slowdown x epochs x examples."""
        slowdown = 1.0 if self.slowdown is None else float(self.slowdown[client_index])
        return slowdown * int(config.get("epochs", 1)) * num_examples

    def job_dropped(self, job: int) -> bool:
        """Whether training job number `job` never reports (probability `dropout_rate`)."""
        if self.dropout_rate == 0.0:
            return False
        rng = np.random.default_rng([self.seed, _JOB_DROPOUT_STREAM, job])
        return bool(rng.random() < self.dropout_rate)
