"""Robust aggregation for untrusted sites: coordinate-wise median, trimmed mean, Krum.

These need every update of the round at once (a running sum is not enough), so they
hold O(clients x model) memory and cannot run under secure aggregation, which hides
individual updates by design; `needs_only_sum = False` makes the drivers refuse that
combination with a clear error. All statistics are taken over deltas, which equals
taking them over the sites' weights (they are shift-invariant), and are unweighted
by example count (a Byzantine site could lie about its count), except multi-Krum's
final average over the selected updates, which is example-weighted as in Blanchard
et al. and Flower.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.strategy.aggregate import Aggregator, UpdateCollector
from fedtrain.strategy.base import Strategy, weighted_metrics
from fedtrain.tensors import ModelState


class RobustStrategy(Strategy):
    """Collects all updates; subclasses reduce a (clients, numel) matrix per tensor."""

    needs_only_sum = False

    def begin_round(self, server_round: int, global_state: ModelState) -> UpdateCollector:
        return UpdateCollector(global_state.specs)

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        assert isinstance(aggregate, UpdateCollector)
        if aggregate.count == 0:
            raise UpdateRejected("no updates were aggregated this round")
        combined = self.combine(aggregate)
        out = {}
        for name, g in global_state.items():
            delta = combined[name].reshape(g.shape)
            if g.dtype.is_floating_point:
                out[name] = (g.to(delta.dtype) + delta).to(g.dtype)
            elif g.dtype == torch.bool:
                out[name] = g.clone()
            else:
                out[name] = (g.to(torch.float64) + delta.to(torch.float64)).round().to(g.dtype)
        return ModelState(out)

    def combine(self, updates: UpdateCollector) -> dict[str, torch.Tensor]:
        """One flat delta per tensor from all of the round's updates."""
        return {name: self.reduce(updates.stacked(name)) for name in updates.specs}

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _trimmed_mean(stacked: torch.Tensor, cut: int) -> torch.Tensor:
    ordered = stacked.sort(dim=0).values
    return ordered[cut : stacked.shape[0] - cut].mean(dim=0)


class FedMedian(RobustStrategy):
    """Coordinate-wise median (Yin et al. 2018); the mean of the two middle values
    for an even number of sites, as numpy's median."""

    name = "fedmedian"

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        n = stacked.shape[0]
        ordered = stacked.sort(dim=0).values
        lo, hi = (n - 1) // 2, n // 2
        return (ordered[lo] + ordered[hi]) / 2


class FedTrimmedAvg(RobustStrategy):
    """Coordinate-wise trimmed mean: drop the `beta` fraction of largest and smallest
    values per coordinate, average the rest (Yin et al. 2018; scipy's trim_mean)."""

    name = "fedtrimmedavg"

    def __init__(self, *, beta: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= beta < 0.5:
            raise ConfigError(f"strategy.beta must be in [0, 0.5), got {beta}")
        self.beta = beta

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        return _trimmed_mean(stacked, int(self.beta * stacked.shape[0]))


class Krum(RobustStrategy):
    """Krum / multi-Krum (Blanchard et al. 2017).

    Each update is scored by the sum of squared distances to its n - f - 2 nearest
    neighbours (f = `num_malicious`); Krum keeps the best-scored update, multi-Krum
    (`num_to_keep` > 0) the example-weighted mean of the `num_to_keep` best. The
    round's training metrics are those of the kept updates only (as Flower's Message
    API Krum/MultiKrum): a rejected outlier's loss says nothing about the new model.
    """

    name = "krum"

    def __init__(self, *, num_malicious: int = 0, num_to_keep: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_malicious < 0 or num_to_keep < 0:
            raise ConfigError("strategy.num_malicious and strategy.num_to_keep must be >= 0")
        self.num_malicious = num_malicious
        self.num_to_keep = num_to_keep
        #: (updates this round, commit-order indices of the kept ones); None until the
        #: round's aggregate is combined.
        self._kept: tuple[int, list[int]] | None = None

    def begin_round(self, server_round: int, global_state: ModelState) -> UpdateCollector:
        self._kept = None
        return super().begin_round(server_round, global_state)

    def scores(self, updates: UpdateCollector) -> torch.Tensor:
        flat = torch.stack(
            [torch.cat([u[n].to(torch.float64) for n in updates.specs]) for u, _ in updates.updates]
        )
        distances = torch.cdist(flat, flat).square()
        n = flat.shape[0]
        closest = max(1, n - self.num_malicious - 2)
        nearest = distances.sort(dim=1).values[:, 1 : closest + 1]  # skip the self-distance
        return nearest.sum(dim=1)

    def combine(self, updates: UpdateCollector) -> dict[str, torch.Tensor]:
        order = torch.argsort(self.scores(updates), stable=True).tolist()
        keep = order[: self.num_to_keep] if self.num_to_keep > 0 else order[:1]
        self._kept = (len(updates.updates), keep)
        chosen = [updates.updates[i] for i in keep]
        total = sum(w for _, w in chosen)
        return {
            name: sum(u[name] * (w / total) for u, w in chosen)  # type: ignore[misc]
            for name in updates.specs
        }

    def aggregate_metrics(
        self, results: Sequence[tuple[int, Mapping[str, float]]]
    ) -> dict[str, float]:
        """Example-weighted metrics of the kept updates (all of them before combining)."""
        if self._kept is None:
            return weighted_metrics(results)
        count, keep = self._kept
        if len(results) != count:
            raise UpdateRejected(
                f"Krum kept updates {keep} of {count}, but {len(results)} results were "
                "reported: drivers must list one result per committed update, in order"
            )
        return weighted_metrics([results[i] for i in keep])
