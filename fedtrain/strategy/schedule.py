"""Round-config values that change by round: learning-rate decay, epochs by round.

`[client]` is the round config every chosen client trains with; `[client_schedule]`
says how some of its values change as rounds pass, the way torch's LR schedulers
change a learning rate by epoch:

    [client]
    lr = 0.1
    epochs = 1

    [client_schedule.lr]          # lr = 0.1 in round 1, then cosine down to 0.001
    decay = "cosine"
    min_value = 0.001

    [client_schedule.epochs]      # 1 epoch until round 10, then 2
    decay = "piecewise"
    values = { 1 = 1, 10 = 2 }

The strategy evaluates schedules on the server when it configures a round (its
`base_config`), so sites and virtual clients just receive numbers; anything a
schedule cannot say is a `Strategy.round_config` override.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.config import option
from fedtrain.errors import ConfigError

Decay = Literal["step", "exponential", "cosine", "piecewise"]


@dataclass
class Schedule:
    """How one round-config key changes with the round (round 1 gets the `[client]` value)."""

    decay: Decay = option(
        doc="`step`: x gamma every `step_size` rounds; `exponential`: x gamma every round; "
        "`cosine`: from the `[client]` value down to `min_value` over `rounds` rounds; "
        "`piecewise`: `values` from the round each key names on.",
    )
    gamma: float = option(0.1, "Factor of `step` and `exponential` decay.")
    step_size: int = option(1, "`step`: rounds between two multiplications by gamma.")
    min_value: float = option(0.0, "`cosine`: the value reached after `rounds` rounds.")
    rounds: int = option(0, "`cosine`: rounds to reach min_value, then kept; 0: the run's rounds.")
    values: dict[str, Any] = option(
        {},
        "`piecewise`: { first round = value }, e.g. { 1 = 0.1, 50 = 0.01 }; before the first "
        "key, the `[client]` value.",
    )

    def check(self, key: str) -> None:
        """Refuse impossible settings; errors name `client_schedule.KEY.SETTING`."""
        where = f"client_schedule.{key}"
        if self.decay in ("step", "exponential") and not self.gamma > 0:
            raise ConfigError(f"{where}.gamma must be > 0, got {self.gamma}")
        if self.step_size < 1:
            raise ConfigError(f"{where}.step_size must be >= 1, got {self.step_size}")
        if self.rounds < 0:
            raise ConfigError(
                f"{where}.rounds must be >= 0 (0: the run's rounds), got {self.rounds}"
            )
        if self.decay == "piecewise" and not self.values:
            raise ConfigError(
                f'{where}: decay = "piecewise" needs values, e.g. {{ 1 = 0.1, 50 = 0.01 }}'
            )
        if self.decay != "piecewise" and self.values:
            raise ConfigError(f'{where}.values is for decay = "piecewise", not {self.decay!r}')
        for first, value in self.values.items():
            if not first.isdigit() or int(first) < 1:
                raise ConfigError(
                    f"{where}.values key {first!r} should be a round number (1, 2, ...)"
                )
            if not isinstance(value, bool | int | float | str):
                raise ConfigError(
                    f"{where}.values.{first} = {value!r} should be a boolean, number or string"
                )

    @property
    def steps(self) -> list[tuple[int, Any]]:
        """`values` as (first round, value), in round order."""
        return sorted((int(k), v) for k, v in self.values.items())

    def over(self, rounds: int) -> Schedule:
        """This schedule with `rounds = 0` (cosine: the run's rounds) made concrete."""
        return self if self.rounds else dataclasses.replace(self, rounds=rounds)

    def value(self, base: Any, server_round: int) -> Any:
        """The value in `server_round` (1-based) of a key whose round-1 value is `base`.

        Decayed integers (epochs, batch sizes) are rounded to the nearest integer.
        """
        if self.decay == "piecewise":
            current = base
            for first, value in self.steps:
                if first > server_round:
                    break
                current = value
            return current
        t = server_round - 1  # rounds already past: round 1 trains with `base`
        if self.decay == "step":
            x = base * self.gamma ** (t // self.step_size)
        elif self.decay == "exponential":
            x = base * self.gamma**t
        else:  # cosine, as torch's CosineAnnealingLR with T_max = rounds
            frac = min(t, self.rounds) / self.rounds
            x = self.min_value + (base - self.min_value) * (1 + math.cos(math.pi * frac)) / 2
        return round(x) if isinstance(base, int) else float(x)


def check_schedules(
    client: Mapping[str, Any], schedules: Mapping[str, Schedule], *, resolved: bool = False
) -> None:
    """Every decayed key has a number in `[client]` to decay from; errors name the key.

    `resolved`: the schedules are the ones a strategy runs, so a cosine one must know
    its length (configs fill in the run's rounds with `over`).
    """
    for key, schedule in schedules.items():
        schedule.check(key)
        if resolved and schedule.decay == "cosine" and schedule.rounds == 0:
            raise ConfigError(
                f"client_schedule.{key}: a cosine schedule needs its length in rounds; set "
                "rounds (configs use the run's rounds: Schedule.over(rounds))"
            )
        if key == "round":
            raise ConfigError("client_schedule.round: `round` is set by the server, not scheduled")
        base = client.get(key)
        if schedule.decay == "piecewise":
            first = schedule.steps[0][0]
            if base is None and first != 1:
                raise ConfigError(
                    f"client_schedule.{key} starts at round {first} and "
                    f"client.{key} is not set: give round 1 a value (add 1 = ... to values, "
                    f"or set {key} in [client])"
                )
        elif isinstance(base, bool) or not isinstance(base, int | float):
            raise ConfigError(
                f"client_schedule.{key} decays client.{key}, which is "
                f"{'not set' if base is None else repr(base)}: set a number in [client], "
                f"e.g. {key} = 0.1, the value of round 1"
            )


def scheduled(
    client: Mapping[str, Any], schedules: Mapping[str, Schedule], server_round: int
) -> dict[str, Any]:
    """`client` with every scheduled key set to its value in `server_round`."""
    out = dict(client)
    for key, schedule in schedules.items():
        out[key] = schedule.value(client.get(key), server_round)
    return out
