"""The `inline` backend: every worker's share trained in turn, in the driver process.

Deterministic and dependency-free, for tests and small runs. It still splits each
round into the same per-worker shares and partial sums as the parallel backends, so
a run gives the same model bit for bit whichever backend trains it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType

from torch.utils.data import Dataset

from fedtrain.simulation.events import WorkerEvent
from fedtrain.simulation.plan import RoundPlan
from fedtrain.simulation.population import ClientPopulation
from fedtrain.simulation.worker import ClientRunner, WorkerSetup
from fedtrain.tensors import ModelState


class InlineBackend:
    """One `ClientRunner` in this process stands in for `num_workers` workers."""

    def __init__(
        self,
        setup: WorkerSetup,
        num_workers: int,
        data: tuple[Dataset, ClientPopulation] | None = None,
    ) -> None:
        """`data`: the driver's training set and population, reused instead of rebuilt."""
        self.setup = setup
        self.num_workers = num_workers
        self._data = data
        self._runner: ClientRunner | None = None

    def __enter__(self) -> InlineBackend:
        self._runner = ClientRunner(self.setup, self._data)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._runner = None

    def run_round(self, plan: RoundPlan, global_state: ModelState) -> Iterator[WorkerEvent]:
        if self._runner is None:
            raise RuntimeError("InlineBackend used outside its `with` block")
        for worker, share in enumerate(plan.shares):
            if share:
                yield from self._runner.run_share(
                    worker, share, global_state, plan.fold_in_workers, plan.evaluate
                )
