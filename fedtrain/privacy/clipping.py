"""Client-level clipping: bound each site's influence on the sum (DP sensitivity).

The L2 norm is taken over all floating tensors of an update together. Adaptive
clipping (Andrew et al. 2021) moves the clip norm towards a target quantile of the
sites' update norms with a geometric step, so nobody has to guess a norm up front.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedtrain.errors import ConfigError


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over all floating tensors, computed in float64."""
    total = 0.0
    for t in update.values():
        if t.is_floating_point():
            total += float(t.double().square().sum())
    return math.sqrt(total)


def clip_update(
    update: Mapping[str, torch.Tensor], clip_norm: float
) -> tuple[dict[str, torch.Tensor], float]:
    """(update scaled to norm <= clip_norm, its norm before clipping)."""
    norm = update_norm(update)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    clipped = {
        n: (t * scale).to(t.dtype) if t.is_floating_point() and scale < 1.0 else t
        for n, t in update.items()
    }
    return clipped, norm


class AdaptiveClip:
    """Geometric quantile tracking: C <- C * exp(-lr * (fraction_unclipped - quantile))."""

    def __init__(self, initial: float, quantile: float = 0.5, lr: float = 0.2) -> None:
        if initial <= 0:
            raise ConfigError(f"privacy.clip_norm must be > 0, got {initial}")
        if not 0 < quantile < 1:
            raise ConfigError(f"privacy.target_quantile must be in (0, 1), got {quantile}")
        self.clip_norm = initial
        self.quantile = quantile
        self.lr = lr

    def update(self, fraction_unclipped: float) -> float:
        """Move the clip norm given the (possibly noised) fraction of unclipped updates."""
        self.clip_norm *= math.exp(-self.lr * (fraction_unclipped - self.quantile))
        return self.clip_norm
