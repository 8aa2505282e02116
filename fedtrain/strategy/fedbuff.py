"""FedBuff (Nguyen et al. 2022): asynchronous FL over a buffer of K staleness-weighted updates.

Sites train continuously, each from the model version it last fetched, so updates
reach the server out of step. The server folds each arriving update into a buffer,
weighted by its example count n_i and by a staleness function s(tau_i) of how many
versions the model advanced since the site fetched it (tau_i), and once K updates
are buffered it applies

    x_{v+1} = x_v + server_lr * sum_i n_i s(tau_i) delta_i / sum_i n_i

and bumps the version. Normalizing by the examples only, not by the staleness
weights, is what makes a buffer of stale updates move the model less; with equal
n_i it is the paper's rule (the buffer divided by K). An update staler than
`max_staleness` versions is dropped and counted instead.

Streaming: the buffer is one running weighted sum (a `WeightedSum`), so memory is
O(model) whatever K, and updates fold chunk by chunk as they arrive.

Drivers call `begin_round(v, x_{v-1})` for the buffer that will produce version v,
`StalenessBuffer.stage(base_version)` before folding each update, and
`finalize_round` once `buffer_full`. A client's round config carries `round` = the
number of its training job (unique, so each job shuffles its data afresh) and
`version` = the version it trains from.

Secure aggregation is refused: SecAgg+ masks cancel only within a cohort of sites
that agreed keys and upload in one synchronous round, while FedBuff folds updates
one at a time, each against its own model version. Buffered asynchronous secure
aggregation (the paper suggests a trusted execution environment) is an open
research problem, not something this implementation pretends to do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.strategy.aggregate import Aggregator, WeightedSum, apply_mean_delta
from fedtrain.strategy.base import Strategy
from fedtrain.tensors import ModelState, TensorSpec

StalenessKind = Literal["constant", "polynomial", "hinge"]
StalenessFn = Callable[[int], float]


class StaleUpdate(UpdateRejected):
    """An update computed from a model older than `max_staleness` versions; dropped."""


def staleness_function(
    kind: str, exponent: float = 0.5, hinge_slope: float = 10.0, hinge_threshold: int = 4
) -> StalenessFn:
    """The weight of an update `s` versions stale (1.0 for a fresh one).

    `constant`: 1; `polynomial`: (1 + s)^-exponent (0.5: 1/sqrt(1 + s), the paper's
    choice); `hinge` (Xie et al. 2019): 1 up to `hinge_threshold` versions, then
    1 / (hinge_slope * (s - hinge_threshold) + 1).
    """
    if kind == "constant":
        return lambda s: 1.0
    if kind == "polynomial":
        if not exponent >= 0:
            raise ConfigError(f"strategy.staleness_exponent must be >= 0, got {exponent}")
        return lambda s: float((1.0 + s) ** -exponent)
    if kind == "hinge":
        if not hinge_slope >= 0 or hinge_threshold < 0:
            raise ConfigError(
                f"strategy.hinge_slope ({hinge_slope}) and strategy.hinge_threshold "
                f"({hinge_threshold}) must be >= 0"
            )
        return lambda s: (
            1.0 if s <= hinge_threshold else 1.0 / (hinge_slope * (s - hinge_threshold) + 1.0)
        )
    raise ConfigError(
        f"strategy.staleness = {kind!r} is unknown; choose constant, polynomial or hinge"
    )


class StalenessBuffer(WeightedSum):
    """sum_i n_i s(tau_i) delta_i, with sum_i n_i as its total weight.

    `version` is the model version the buffer will be applied to; an update trained
    from `base_version` is `version - base_version` versions stale. `stage` that
    before folding each update (chunk by chunk with `add_chunk`/`commit`, or whole
    with `add`); an update folded without staging counts as fresh.
    """

    def __init__(
        self,
        specs: tuple[TensorSpec, ...],
        version: int,
        weigh: StalenessFn,
        max_staleness: int | None,
    ) -> None:
        super().__init__(specs)
        self.version = version
        self.weigh = weigh
        self.max_staleness = max_staleness
        self.staleness: list[int] = []  # of each buffered update, in fold order
        self.factors: list[float] = []  # s(tau) of each buffered update
        self.stale_dropped = 0
        self._pending = (0, 1.0)

    def stage(self, base_version: int) -> tuple[int, float]:
        """Weigh the next update, trained from `base_version`: (staleness, weight factor).

        Raises `StaleUpdate` (and counts it) beyond `max_staleness`.
        """
        self._pending = self.check(base_version)
        return self._pending

    def check(self, base_version: int) -> tuple[int, float]:
        """`stage` without staging: whether an update from `base_version` would be taken
        (e.g. before its bytes are received). A stale one is counted here already."""
        staleness = self.version - base_version
        if staleness < 0:
            raise UpdateRejected(
                f"update trained from version {base_version}, but the model is only at "
                f"version {self.version}"
            )
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.stale_dropped += 1
            raise StaleUpdate(
                f"update trained from version {base_version} is {staleness} versions stale "
                f"(the model is at version {self.version}; max_staleness = "
                f"{self.max_staleness}); dropped"
            )
        return staleness, self.weigh(staleness)

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        super().add_chunk(name, start, values, weight * self._pending[1])

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        try:
            super().add(delta, weight)
        finally:
            self._pending = (0, 1.0)

    def commit(self, weight: float) -> None:
        super().commit(weight)
        staleness, factor = self._pending
        self.staleness.append(staleness)
        self.factors.append(factor)
        self._pending = (0, 1.0)

    def stats(self) -> dict[str, float]:
        """Staleness facts about the buffered updates, for the version's metrics line."""
        out: dict[str, float] = {"stale_dropped": self.stale_dropped}
        if self.staleness:
            out.update(
                staleness_mean=sum(self.staleness) / len(self.staleness),
                staleness_max=max(self.staleness),
                staleness_weight_mean=sum(self.factors) / len(self.factors),
            )
        return out


class FedBuff(Strategy):
    """Buffered asynchronous aggregation (see the module docstring).

    `buffer_size` is K; `concurrency` caps how many clients/sites train at once (0:
    every available one). `fraction_fit` and `min_fit_clients` do not apply; the
    runtime waits for `min_available_clients` sites before handing out the first work.
    """

    name = "fedbuff"
    asynchronous = True

    def __init__(
        self,
        *,
        buffer_size: int = 10,
        server_lr: float = 1.0,
        concurrency: int = 0,
        staleness: StalenessKind = "polynomial",
        staleness_exponent: float = 0.5,
        hinge_slope: float = 10.0,
        hinge_threshold: int = 4,
        max_staleness: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if buffer_size < 1:
            raise ConfigError(f"strategy.buffer_size must be >= 1, got {buffer_size}")
        if not server_lr > 0:
            raise ConfigError(f"strategy.server_lr must be > 0, got {server_lr}")
        if concurrency < 0:
            raise ConfigError(
                f"strategy.concurrency must be >= 0 (0: every available client), got {concurrency}"
            )
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError(
                f"strategy.max_staleness must be >= 0 (leave it out for no limit), "
                f"got {max_staleness}"
            )
        self.buffer_size = buffer_size
        self.server_lr = server_lr
        self.concurrency = concurrency
        self.max_staleness = max_staleness
        self.weigh = staleness_function(staleness, staleness_exponent, hinge_slope, hinge_threshold)
        self._last: dict[str, float] = {}

    def begin_round(self, server_round: int, global_state: ModelState) -> StalenessBuffer:
        """The buffer that produces version `server_round` from `global_state` (one before)."""
        return StalenessBuffer(global_state.specs, server_round - 1, self.weigh, self.max_staleness)

    def buffer_full(self, aggregate: Aggregator) -> bool:
        return aggregate.count >= self.buffer_size

    def finalize_round(
        self, server_round: int, global_state: ModelState, aggregate: Aggregator
    ) -> ModelState:
        assert isinstance(aggregate, StalenessBuffer)
        self._last = aggregate.stats()
        mean = aggregate.mean(in_place=True)  # sum n s delta / sum n
        if self.server_lr != 1.0:
            for tensor in mean.values():
                tensor.mul_(self.server_lr)
        return apply_mean_delta(global_state, mean, consume=True)

    def round_metrics(self) -> dict[str, float]:
        return dict(self._last)
