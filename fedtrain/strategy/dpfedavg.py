"""DP-FedAvg with central noise (McMahan et al. 2018; adaptive clipping, Andrew et al. 2021).

The server is trusted to see individual updates (it does without secure aggregation):
it clips each update to L2 norm C, sums them with equal weight (example counts would
leak and change the sensitivity), adds Gaussian noise N(0, (z C)^2) from a CSPRNG to
the sum and divides by the number of clients selected. The privacy unit is the site
(client-level DP). Epsilon for the configured delta is tracked with dp-accounting and
reported each round through `round_metrics`.

With adaptive clipping the clip norm follows the `target_quantile` of the update
norms, from a noised count of unclipped updates (std `clip_count_std`, Andrew et al.'s
sigma_b), whose privacy cost this accounting does not include: keep
clip_count_std >= selected/20 as recommended there.

Under secure aggregation the server never sees an update to clip, so this strategy
refuses secagg (`needs_only_sum = False`); use sites-side clipping with discrete noise
(distributed DP) there instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedtrain.errors import ConfigError
from fedtrain.privacy.accounting import PrivacyAccountant
from fedtrain.privacy.clipping import AdaptiveClip, clip_update
from fedtrain.privacy.noise import gaussian
from fedtrain.strategy.aggregate import Aggregator, WeightedSum, apply_mean_delta
from fedtrain.strategy.base import RoundConfig
from fedtrain.strategy.fedavg import FedAvg
from fedtrain.tensors import ModelState, TensorSpec, torch_dtype


class ClippedSum(WeightedSum):
    """Clips each whole update to `clip_norm`, then adds it with weight 1."""

    def __init__(self, specs: tuple[TensorSpec, ...], clip_norm: float) -> None:
        super().__init__(specs)
        self.clip_norm = clip_norm
        self.unclipped = 0

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        self._stage(name, start, values)  # clipping needs the whole update's norm

    def commit(self, weight: float) -> None:
        """Clip the staged update and add it with weight 1 (the passed weight is ignored:
        example counts would change the sensitivity)."""
        staged = self._take_staged()  # in accumulator dtypes: clip by the model's dtypes
        floats = {
            n: t for n, t in staged.items() if torch_dtype(self.specs[n].dtype).is_floating_point
        }
        clipped, norm = clip_update(floats, self.clip_norm)
        self.unclipped += int(norm <= self.clip_norm)
        for name, values in {**staged, **clipped}.items():
            self._sums[name].add_(values)
        super().commit(1.0)


class DPFedAvg(FedAvg):
    name = "dpfedavg"
    needs_only_sum = False

    def __init__(
        self,
        *,
        noise_multiplier: float = 1.0,
        clip_norm: float = 1.0,
        adaptive_clipping: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        clip_count_std: float | None = None,
        delta: float = 1e-5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if noise_multiplier < 0:
            raise ConfigError(f"strategy.noise_multiplier must be >= 0, got {noise_multiplier}")
        self.noise_multiplier = noise_multiplier
        self.clip = AdaptiveClip(clip_norm, target_quantile, clip_lr)
        self.adaptive_clipping = adaptive_clipping
        self.clip_count_std = clip_count_std
        self.accountant = PrivacyAccountant(noise_multiplier, delta) if noise_multiplier else None
        self.sampling_rates: list[float] = []
        self._selected = 0
        self._rate = 1.0
        self._last: dict[str, float] = {}

    def configure_round(
        self, server_round: int, available: Sequence[str], rng: np.random.Generator
    ) -> dict[str, RoundConfig]:
        plan = super().configure_round(server_round, available, rng)
        self._selected = len(plan)
        self._rate = len(plan) / max(len(available), 1)
        return plan

    def begin_round(self, server_round: int, global_state: ModelState) -> ClippedSum:
        return ClippedSum(global_state.specs, self.clip.clip_norm)

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        assert isinstance(aggregate, ClippedSum)
        selected = max(self._selected, aggregate.count)
        std = self.noise_multiplier * aggregate.clip_norm
        mean = {}
        for name, total in aggregate.take_sums().items():
            # noise only what the model holds as floats: integer buffers (step counters)
            # accumulate in float64 but carry no private signal worth noising
            if std > 0 and global_state[name].is_floating_point():
                noise = gaussian(total.numel(), std).reshape(total.shape)
                total.add_(torch.from_numpy(noise).to(total.dtype))
            mean[name] = total.div_(selected)
        new_state = apply_mean_delta(global_state, mean, consume=True)
        self._account(aggregate, selected)
        return new_state

    def _account(self, aggregate: ClippedSum, selected: int) -> None:
        rate = self._rate
        metrics = {"clip_norm": aggregate.clip_norm}
        if self.accountant is not None:
            self.sampling_rates.append(rate)
            metrics["epsilon"] = self.accountant.step(rate)
            metrics["delta"] = self.accountant.delta
        if self.adaptive_clipping:
            std = self.clip_count_std if self.clip_count_std is not None else selected / 20
            noisy = aggregate.unclipped + (float(gaussian(1, std)[0]) if std > 0 else 0.0)
            self.clip.update(noisy / selected)
        self._last = metrics

    def round_metrics(self) -> dict[str, float]:
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip.clip_norm, "sampling_rates": list(self.sampling_rates)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"clip_norm", "sampling_rates"}:
            raise ConfigError(f"dpfedavg checkpoint has keys {sorted(state)}")
        self.clip.clip_norm = float(state["clip_norm"])
        self.sampling_rates = []
        if self.accountant is not None:  # replay the composition so epsilon continues
            for rate in state["sampling_rates"]:
                self.sampling_rates.append(rate)
                self.accountant.step(rate)
