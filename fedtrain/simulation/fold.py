"""Fold a round's worker results into the strategy's aggregator in a fixed order.

Float addition is not associative, so the order in which results happen to arrive
(process scheduling, network) must not decide the sum. Partial sums are merged in
worker order; single updates (strategies that need every update) are folded in
client order. Whatever arrives early waits for its turn, which with round-robin
shares is a short wait.
"""

from __future__ import annotations

import dataclasses
import logging

from fedtrain.errors import UpdateRejected
from fedtrain.simulation.events import ClientResult, ClientsDone, ShareDone, WorkerEvent
from fedtrain.simulation.plan import RoundPlan
from fedtrain.strategy import WeightedSum
from fedtrain.strategy.aggregate import Aggregator

log = logging.getLogger(__name__)


class RoundFold:
    """Collects one round's events; `results` and `rejected` describe what was folded."""

    def __init__(self, aggregate: Aggregator, plan: RoundPlan) -> None:
        self.aggregate = aggregate
        self.plan = plan
        self.results: dict[str, ClientResult] = {}
        self.rejected: dict[str, str] = {}
        self.upload_bytes = 0  # of every update that arrived, folded or rejected
        self._done = [0] * len(plan.shares)
        self._workers_left = {w for w, share in enumerate(plan.shares) if share}
        # worker-side folding: partials wait here until all lower workers merged
        self._merge_order = sorted(self._workers_left)
        self._partials: dict[int, WeightedSum] = {}
        # driver-side folding: updates wait here until all earlier clients folded
        self._fold_order = plan.training
        self._next = 0
        self._updates: dict[str, ClientResult] = {}

    @property
    def clients_done(self) -> int:
        return sum(self._done)

    @property
    def complete(self) -> bool:
        return not self._workers_left

    def add(self, event: WorkerEvent) -> None:
        if isinstance(event, ClientsDone):
            self._done[event.worker] = max(self._done[event.worker], event.done)
        elif isinstance(event, ClientResult):
            self._updates[event.client_id] = event
            self._fold_ready_updates()
        else:
            self._share_done(event)

    def _share_done(self, event: ShareDone) -> None:
        self._workers_left.discard(event.worker)
        self._done[event.worker] = len(self.plan.shares[event.worker])
        for result in event.results:
            self._record(result)
        if event.sums is not None:
            assert isinstance(self.aggregate, WeightedSum)
            self._partials[event.worker] = WeightedSum.from_sums(
                tuple(self.aggregate.specs.values()), event.sums, event.total_weight, event.count
            )
            while self._merge_order and self._merge_order[0] in self._partials:
                self.aggregate.merge(self._partials.pop(self._merge_order.pop(0)))

    def _fold_ready_updates(self) -> None:
        while self._next < len(self._fold_order) and self._fold_order[self._next] in self._updates:
            result = self._updates.pop(self._fold_order[self._next])
            self._next += 1
            if result.delta is not None:
                try:
                    self.aggregate.add(result.delta, float(result.num_examples))
                except UpdateRejected as exc:
                    log.warning("update of %s rejected: %s", result.client_id, exc)
                    result = dataclasses.replace(result, rejected=str(exc))
            self._record(result)

    def _record(self, result: ClientResult) -> None:
        self.upload_bytes += result.upload_bytes
        if result.rejected is not None:
            self.rejected[result.client_id] = result.rejected
        else:
            self.results[result.client_id] = dataclasses.replace(result, delta=None)

    def train_metrics(self) -> list[tuple[int, dict[str, float]]]:
        """(examples, metrics) of the clients whose updates count, in client order."""
        return [
            (self.results[c].num_examples, self.results[c].metrics)
            for c in self._fold_order
            if c in self.results
        ]
