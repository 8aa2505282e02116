"""Server optimizers on the averaged delta: FedAvgM, FedAdagrad, FedAdam, FedYogi.

Reddi et al. 2021 ("Adaptive Federated Optimization") treat the example-weighted mean
delta as a pseudo-gradient and step a server optimizer with it; Hsu et al. 2019 add
server momentum (FedAvgM). All of them need only the weighted sum of updates, so they
stream and run under secure aggregation. Optimizer state (momentum, second moments)
is kept per floating tensor in float32 or wider and saved in checkpoints; integer
buffers (e.g. BatchNorm's step counter) are averaged as in FedAvg.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedtrain.errors import ConfigError
from fedtrain.strategy.aggregate import Aggregator, WeightedSum, apply_mean_delta
from fedtrain.strategy.base import Strategy
from fedtrain.tensors import ModelState


class ServerOptimizer(Strategy):
    """FedAvg's shape plus a server-side step; subclasses define `step`."""

    def __init__(self, *, server_lr: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not server_lr > 0:
            raise ConfigError(f"strategy.server_lr must be > 0, got {server_lr}")
        self.server_lr = server_lr
        self.steps = 0
        self.server_round = 0  # the round being finalized, for `step`
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        assert isinstance(aggregate, WeightedSum)
        mean = aggregate.mean(in_place=True)
        self.steps += 1
        self.server_round = server_round
        out = dict(apply_mean_delta(global_state, mean).items())  # non-float tensors
        for name, g in global_state.items():
            if g.dtype.is_floating_point:
                delta = mean[name]
                update = self.step(name, delta)
                out[name] = (g.to(delta.dtype) + update).to(g.dtype)
        return ModelState(out)

    def buffer(self, kind: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """A zero-initialised optimizer buffer, created on first use."""
        per_kind = self.buffers.setdefault(kind, {})
        if name not in per_kind:
            per_kind[name] = torch.zeros_like(like)
        return per_kind[name]

    def step(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """The change applied to tensor `name` given this round's mean delta."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "buffers": self.buffers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"steps", "buffers"}:
            raise ConfigError(
                f"{type(self).__name__} checkpoint has keys {sorted(state)}, "
                "expected ['buffers', 'steps']: was it written by another strategy?"
            )
        self.steps = int(state["steps"])
        self.buffers = {k: dict(v) for k, v in state["buffers"].items()}


class FedAvgM(ServerOptimizer):
    """Server momentum: u = beta * u + delta; x += server_lr * u."""

    name = "fedavgm"

    def __init__(self, *, server_lr: float = 1.0, server_momentum: float = 0.9, **kw: Any):
        super().__init__(server_lr=server_lr, **kw)
        if not 0.0 <= server_momentum < 1.0:
            raise ConfigError(f"strategy.server_momentum must be in [0, 1), got {server_momentum}")
        self.server_momentum = server_momentum

    def step(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        u = self.buffer("momentum", name, delta)
        u.mul_(self.server_momentum).add_(delta)
        return self.server_lr * u


class FedOpt(ServerOptimizer):
    """Adaptive server optimizers (Reddi et al. 2021, Algorithm 2).

    m = beta_1 * m + (1 - beta_1) * delta; v per subclass;
    x += lr_t * m / (sqrt(v) + tau).
    """

    def __init__(
        self,
        *,
        server_lr: float = 0.1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-9,
        **kw: Any,
    ) -> None:
        super().__init__(server_lr=server_lr, **kw)
        for key, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"strategy.{key} must be in [0, 1), got {value}")
        if not tau > 0:
            raise ConfigError(f"strategy.tau must be > 0, got {tau}")
        self.beta_1, self.beta_2, self.tau = beta_1, beta_2, tau

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        raise NotImplementedError

    def step_size(self) -> float:
        return self.server_lr

    def step(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        m = self.buffer("m", name, delta)
        v = self.buffer("v", name, delta)
        m.mul_(self.beta_1).add_(delta, alpha=1.0 - self.beta_1)
        self.second_moment(v, delta * delta)
        return self.step_size() * m / (v.sqrt() + self.tau)


class FedAdagrad(FedOpt):
    """v += delta^2."""

    name = "fedadagrad"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.add_(delta_sq)


class FedAdam(FedOpt):
    """v = beta_2 * v + (1 - beta_2) * delta^2, with Adam's bias correction.

    `bias_correction = "adam"` (the default) uses t = server steps taken so far (t = 1
    on the first), as Kingma & Ba and Reddi et al.; `"flower"` uses t = server_round + 1,
    as Flower 1.42's FedAdam does (legacy and Message API alike), so the first round
    steps sqrt(1 - beta_2^2) / (1 - beta_1^2) of server_lr instead of
    sqrt(1 - beta_2) / (1 - beta_1): with the default betas 0.74 x server_lr instead of
    1.0 x per coordinate (0.074 vs 0.1 at server_lr = 0.1). `"flower"` reproduces a
    Flower run's models; the standard form is the published algorithm.
    """

    name = "fedadam"

    def __init__(self, *, bias_correction: str = "adam", **kw: Any) -> None:
        super().__init__(**kw)
        if bias_correction not in ("adam", "flower"):
            raise ConfigError(
                f"strategy.bias_correction = {bias_correction!r} should be 'adam' "
                "(t = server steps taken) or 'flower' (t = server_round + 1, Flower's FedAdam)"
            )
        self.bias_correction = bias_correction

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.mul_(self.beta_2).add_(delta_sq, alpha=1.0 - self.beta_2)

    def step_size(self) -> float:
        t = self.steps if self.bias_correction == "adam" else self.server_round + 1
        return self.server_lr * math.sqrt(1.0 - self.beta_2**t) / (1.0 - self.beta_1**t)


class FedYogi(FedOpt):
    """v = v - (1 - beta_2) * delta^2 * sign(v - delta^2): additive, sign-controlled."""

    name = "fedyogi"

    def __init__(self, *, server_lr: float = 0.01, tau: float = 1e-3, **kw: Any) -> None:
        super().__init__(server_lr=server_lr, tau=tau, **kw)

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.sub_((1.0 - self.beta_2) * delta_sq * torch.sign(v - delta_sq))
