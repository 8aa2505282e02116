"""A user strategy written against fedtrain's Strategy API: FedAvg with server momentum
and a warmup-then-cosine server learning rate.

    [strategy]
    name = "mylab.strategies:WarmupCosineFedAvgM"
    [strategy.options]
    server_lr = 1.0       # peak server step
    warmup_rounds = 3     # ramp 1/3, 2/3, 1 of it ...
    total_rounds = 30     # ... then cosine down to min_lr by this round
    min_lr = 0.1
    momentum = 0.9

Each round: mean = the example-weighted mean update (a streaming sum, so it runs under
secure aggregation), u = momentum * u + mean, x += eta_t * u. The step count and the
momentum buffers are the strategy's state: checkpointed every round and restored by
`--resume`, so a resumed run continues the schedule where it stopped. During warmup
the clients' own learning rate ramps up with the server's (`round_config`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedtrain.errors import ConfigError
from fedtrain.strategy import RoundConfig, Strategy, WeightedSum
from fedtrain.tensors import ModelState


class WarmupCosineFedAvgM(Strategy):
    needs_only_sum = True  # begin_round's WeightedSum is all it reads: secure aggregation works

    def __init__(
        self,
        *,
        server_lr: float = 1.0,
        warmup_rounds: int = 0,
        total_rounds: int = 100,
        min_lr: float = 0.0,
        momentum: float = 0.9,
        **kwargs: Any,  # fraction_fit, min_fit_clients, client_config, ...: the base's
    ) -> None:
        super().__init__(**kwargs)
        if not server_lr > 0 or not 0 <= min_lr <= server_lr:
            raise ConfigError(
                "strategy.server_lr must be > 0 and strategy.min_lr in [0, server_lr]"
            )
        if not 0 <= warmup_rounds < total_rounds:
            raise ConfigError("strategy.warmup_rounds must be in [0, total_rounds)")
        if not 0 <= momentum < 1:
            raise ConfigError(f"strategy.momentum must be in [0, 1), got {momentum}")
        self.server_lr, self.min_lr, self.momentum = server_lr, min_lr, momentum
        self.warmup_rounds, self.total_rounds = warmup_rounds, total_rounds
        self.steps = 0  # server steps taken: the schedule's clock
        self.velocity: dict[str, torch.Tensor] = {}

    def lr_at(self, step: int) -> float:
        """The server learning rate of server step `step` (1-based)."""
        if step <= self.warmup_rounds:
            return self.server_lr * step / self.warmup_rounds
        progress = min(1.0, (step - self.warmup_rounds) / (self.total_rounds - self.warmup_rounds))
        return self.min_lr + (self.server_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2

    def round_config(
        self, server_round: int, client_id: str, base_config: RoundConfig
    ) -> RoundConfig:
        # Clients warm up with the server: scale their lr by the same ramp.
        step = self.steps + 1
        if step <= self.warmup_rounds and "lr" in base_config:
            base_config["lr"] = float(base_config["lr"]) * step / self.warmup_rounds
        return base_config

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: WeightedSum
    ) -> ModelState:
        mean = aggregate.mean(in_place=True)  # sum_i n_i delta_i / sum_i n_i, per tensor
        self.steps += 1
        eta = self.lr_at(self.steps)
        out = {}
        for name, g in global_state.items():
            if not g.dtype.is_floating_point:  # integer buffers (step counters): FedAvg
                out[name] = (g.to(torch.float64) + mean[name].to(torch.float64)).round().to(g.dtype)
                continue
            u = self.velocity.setdefault(name, torch.zeros_like(mean[name]))
            u.mul_(self.momentum).add_(mean[name])
            out[name] = (g.to(u.dtype) + eta * u).to(g.dtype)
        return ModelState(out)

    def round_metrics(self) -> dict[str, float]:
        return {"server_lr": self.lr_at(self.steps), "server_steps": float(self.steps)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "velocity": dict(self.velocity)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"steps", "velocity"}:
            raise ConfigError(
                f"{type(self).__name__} cannot resume from state with keys {sorted(state)}: "
                "was the run started with another strategy?"
            )
        self.steps = int(state["steps"])
        self.velocity = dict(state["velocity"])
