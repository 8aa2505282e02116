"""The server-side algorithm interface, shared by the runtime and the simulation.

A strategy decides who trains each round and with what config, hands out a
streaming aggregator, and turns the aggregate into the next global model. It never
sees sockets or processes: the drivers feed it.

What a driver calls, in order, each round (the contract a user strategy fills in):

1. `configure_round(server_round, available, rng)`: who trains, with which config
   (`base_config` applies `[client_schedule]`, then `round_config` per client);
2. `begin_round(server_round, global_state)`: a fresh aggregator the driver folds
   each arriving update into (`add`/`add_chunk` + `commit(weight)`);
3. `finalize_round(server_round, global_state, aggregate)`: the next global model,
   once enough updates arrived (`min_results`); never called for a failed round;
4. `aggregate_metrics(results)` and `round_metrics()`: the round's metrics line;
5. when the model is evaluated at the sites (federated evaluation, see
   `fedtrain.evaluation`): `configure_evaluate(server_round, available, rng)` chooses
   who evaluates the new model, and `aggregate_evaluate(server_round, results)` turns
   their (examples, metrics) into the federation's figures (Flower's names);
6. `state_dict()`: saved with the round's checkpoint; `load_state_dict` on `--resume`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedtrain.errors import ConfigError
from fedtrain.strategy.aggregate import Aggregator, WeightedSum
from fedtrain.strategy.schedule import Schedule, check_schedules, scheduled
from fedtrain.tensors import ModelState

Scalar = bool | int | float | str
RoundConfig = dict[str, Scalar]


def weighted_metrics(results: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Example-weighted mean of each metric over the sites that reported it."""
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for n, metrics in results:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + n * float(value)
            weights[key] = weights.get(key, 0) + n
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


class Strategy(ABC):
    """One federated algorithm. Subclasses override what differs from FedAvg's shape.

    A subclass's constructor takes its own options as keyword arguments (what
    `[strategy.options]` holds) and passes the rest (`**kwargs`) on to this one.
    """

    #: How configs and messages name the strategy; a subclass that sets none is named
    #: by its import reference ("package.module:ClassName").
    name: ClassVar[str]
    #: Whether the algorithm only needs the (weighted) sum of updates, so it can run
    #: under secure aggregation. Median/Krum-style strategies set this False. When it
    #: is True, `begin_round` must return a `WeightedSum`, and drivers may pre-fold
    #: updates elsewhere into partial `WeightedSum`s (simulation workers do) and
    #: `merge` those into it: the strategy sees the same sum either way.
    needs_only_sum: ClassVar[bool] = True
    #: Whether updates are folded as they arrive, each against the model version its
    #: client trained from, instead of in synchronous rounds (FedBuff). Drivers run
    #: such strategies on their asynchronous loop; secure aggregation refuses them.
    asynchronous: ClassVar[bool] = False

    def __init__(
        self,
        *,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 2,
        min_available_clients: int = 2,
        client_config: Mapping[str, Scalar] | None = None,
        client_schedule: Mapping[str, Schedule] | None = None,
        fraction_evaluate: float = 1.0,
        min_evaluate_clients: int = 1,
    ) -> None:
        if not 0.0 < fraction_evaluate <= 1.0:
            raise ConfigError(
                f"strategy.fraction_evaluate must be in (0, 1], got {fraction_evaluate}"
            )
        if min_evaluate_clients < 1:
            raise ConfigError(
                f"strategy.min_evaluate_clients must be >= 1, got {min_evaluate_clients}"
            )
        self.fraction_evaluate = fraction_evaluate
        self.min_evaluate_clients = min_evaluate_clients
        if not 0.0 < fraction_fit <= 1.0:
            raise ConfigError(f"strategy.fraction_fit must be in (0, 1], got {fraction_fit}")
        if min_fit_clients < 1:
            raise ConfigError(f"strategy.min_fit_clients must be >= 1, got {min_fit_clients}")
        if min_available_clients < min_fit_clients:
            raise ConfigError(
                f"strategy.min_available_clients ({min_available_clients}) must be >= "
                f"min_fit_clients ({min_fit_clients})"
            )
        self.fraction_fit = fraction_fit
        self.min_fit_clients = min_fit_clients
        self.min_available_clients = min_available_clients
        self.client_config: RoundConfig = dict(client_config or {})
        self.client_schedule: dict[str, Schedule] = dict(client_schedule or {})
        check_schedules(self.client_config, self.client_schedule, resolved=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = f"{cls.__module__}:{cls.__qualname__}"

    # -- round planning ---------------------------------------------------------------
    def num_to_sample(self, num_available: int) -> int:
        """How many of the available clients train this round (0: not enough yet)."""
        if num_available < self.min_available_clients:
            return 0
        wanted = max(self.min_fit_clients, math.ceil(self.fraction_fit * num_available))
        return min(wanted, num_available)

    def configure_round(
        self, server_round: int, available: Sequence[str], rng: np.random.Generator
    ) -> dict[str, RoundConfig]:
        """Choose this round's participants (seeded) and the config each receives."""
        k = self.num_to_sample(len(available))
        if k == 0:
            return {}
        ids = sorted(available)
        chosen = sorted(rng.choice(len(ids), size=k, replace=False).tolist())
        base = self.base_config(server_round)
        return {ids[i]: self.round_config(server_round, ids[i], dict(base)) for i in chosen}

    def base_config(self, server_round: int) -> RoundConfig:
        """`[client]` with `[client_schedule]` applied at `server_round`, plus `round`."""
        return {
            **scheduled(self.client_config, self.client_schedule, server_round),
            "round": server_round,
        }

    def round_config(
        self, server_round: int, client_id: str, base_config: RoundConfig
    ) -> RoundConfig:
        """The config `client_id` trains with in `server_round` (Flower's
        `on_fit_config_fn`, per client): override it to change the base config.

        `base_config` is this client's own copy of `base_config(server_round)`; return
        it (changed or not) or a new dict. Values must be booleans, numbers or strings:
        they travel to sites as the round's config and reach `Task.train` (and a Flower
        app's config record) unchanged.
        """
        return base_config

    def job_config(self, job: int, version: int, client_id: str) -> RoundConfig:
        """An asynchronous strategy's config for training job `job` from model `version`.

        Schedules follow the model version the job trains toward (`version + 1`, as
        a synchronous round would); `round` is the job's number (it seeds the shuffle)
        and `round_config` gets it as `server_round`.
        """
        base = {**self.base_config(version + 1), "round": job, "version": version}
        return self.round_config(job, client_id, base)

    def configure_evaluate(
        self, server_round: int, available: Sequence[str], rng: np.random.Generator
    ) -> dict[str, RoundConfig]:
        """Who evaluates the model that round `server_round` produced, with which config
        (`available`: the clients able to evaluate). `fraction_evaluate` of them, at least
        `min_evaluate_clients`; none (no evaluation) while fewer are available."""
        if len(available) < self.min_evaluate_clients:
            return {}
        k = min(
            len(available),
            max(self.min_evaluate_clients, math.ceil(self.fraction_evaluate * len(available))),
        )
        ids = sorted(available)
        chosen = sorted(rng.choice(len(ids), size=k, replace=False).tolist())
        base = self.base_config(server_round)
        return {ids[i]: dict(base) for i in chosen}

    def aggregate_evaluate(
        self, server_round: int, results: Sequence[tuple[int, Mapping[str, float]]]
    ) -> dict[str, float]:
        """The federation's evaluation from each evaluating client's (examples, metrics),
        metrics holding `loss` and whatever the task reported (e.g. `accuracy`), in
        client-name order: the example-weighted mean of each. Override it for another
        summary (a median, a weighting of your own)."""
        return weighted_metrics(results)

    def min_results(self, num_selected: int) -> int:
        """Updates needed for a round to count (the rest may drop out)."""
        return min(self.min_fit_clients, num_selected)

    # -- aggregation ------------------------------------------------------------------
    def begin_round(self, server_round: int, global_state: ModelState) -> Aggregator:
        """A fresh streaming aggregator for this round's updates."""
        return WeightedSum(global_state.specs)

    @abstractmethod
    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        """The next global model from the round's aggregate."""

    def round_metrics(self) -> dict[str, float]:
        """Strategy facts about the round just finalized (e.g. epsilon), for metrics.jsonl."""
        return {}

    def aggregate_metrics(
        self, results: Sequence[tuple[int, Mapping[str, float]]]
    ) -> dict[str, float]:
        """The round's training metrics from each counted update's (examples, metrics),
        listed in the order the updates were committed to this round's aggregator."""
        return weighted_metrics(results)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy must remember across a server restart: tensors,
        numbers, strings and containers of them (saved with `torch.save`, loaded
        with `weights_only=True`)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (on `--resume`, before the next round)."""
        if state:
            raise ConfigError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")
