"""Results are folded in a fixed order, whatever order they arrive in."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedtrain.errors import UpdateRejected
from fedtrain.simulation.events import ClientResult, ClientsDone, ShareDone
from fedtrain.simulation.fold import RoundFold
from fedtrain.simulation.plan import RoundPlan
from fedtrain.strategy import WeightedSum
from fedtrain.strategy.aggregate import UpdateCollector
from fedtrain.tensors import ModelState

SPECS = ModelState({"w": torch.zeros(4, 3), "b": torch.zeros(3)}).specs
CLIENTS = [f"client-{i}" for i in range(7)]


def delta(seed: int) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    return ModelState({s.name: torch.randn(s.shape, generator=gen) * 1e3 for s in SPECS})


def plan(workers: int, fold: bool) -> RoundPlan:
    shares = tuple(
        tuple((c, {}) for i, c in enumerate(CLIENTS) if i % workers == w) for w in range(workers)
    )
    return RoundPlan(1, tuple(CLIENTS), (), shares, fold)


def partial_events(workers: int) -> list[ShareDone]:
    events = []
    for w, share in enumerate(plan(workers, True).shares):
        partial = WeightedSum(SPECS)
        for client_id, _ in share:
            partial.add(delta(CLIENTS.index(client_id)), 1.0 + CLIENTS.index(client_id))
        events.append(ShareDone(w, (), dict(partial.sums), partial.total_weight, partial.count))
    return events


def sums_of(aggregate: WeightedSum) -> list[bytes]:
    return [t.numpy().tobytes() for t in aggregate.sums.values()]


def test_partial_sums_merge_in_worker_order_whatever_the_arrival():
    outcomes = set()
    for order in itertools.permutations(partial_events(3)):
        aggregate = WeightedSum(SPECS)
        fold = RoundFold(aggregate, plan(3, True))
        for event in order:
            fold.add(event)
        assert fold.complete and aggregate.count == 7
        outcomes.add(tuple(sums_of(aggregate)))
    assert len(outcomes) == 1


def test_merged_partials_equal_adding_every_update():
    direct = WeightedSum(SPECS)
    for i in range(7):
        direct.add(delta(i), 1.0 + i)
    merged = WeightedSum(SPECS)
    for event in partial_events(3):
        merged.merge(WeightedSum.from_sums(SPECS, event.sums, event.total_weight, event.count))
    assert merged.total_weight == direct.total_weight and merged.count == direct.count
    for name, total in direct.sums.items():
        torch.testing.assert_close(merged.sums[name], total, rtol=1e-6, atol=1e-3)


def test_single_updates_fold_in_client_order_whatever_the_arrival():
    outcomes = set()
    results = [ClientResult(c, 1 + i, {"loss": float(i)}, delta(i)) for i, c in enumerate(CLIENTS)]
    for order in (results, results[::-1], results[3:] + results[:3]):
        aggregate = UpdateCollector(SPECS)
        fold = RoundFold(aggregate, plan(2, False))
        for event in [*order, ShareDone(0), ShareDone(1)]:
            fold.add(event)
        assert fold.complete
        assert [n for n, _ in fold.train_metrics()] == [1, 2, 3, 4, 5, 6, 7]
        outcomes.add(tuple(u["w"].numpy().tobytes() for u, _ in aggregate.updates))
    assert len(outcomes) == 1


def test_a_rejected_update_is_left_out_and_reported():
    bad = ModelState({"w": torch.full((4, 3), float("nan")), "b": torch.zeros(3)})
    aggregate = WeightedSum(SPECS)
    fold = RoundFold(aggregate, RoundPlan(1, ("a", "b"), (), ((("a", {}), ("b", {})),), False))
    fold.add(ClientResult("a", 5, {}, bad))
    fold.add(ClientResult("b", 5, {}, delta(0)))
    fold.add(ClientsDone(0, 2))
    assert fold.clients_done == 2 and not fold.complete
    fold.add(ShareDone(0))
    assert set(fold.rejected) == {"a"} and "NaN" in fold.rejected["a"]
    assert list(fold.results) == ["b"] and aggregate.count == 1


def test_a_partial_of_the_wrong_shape_is_refused():
    sums = {"w": torch.zeros(12), "b": torch.zeros(4)}
    with pytest.raises(UpdateRejected, match="'b'"):
        WeightedSum.from_sums(SPECS, sums, 1.0, 1)
    with pytest.raises(UpdateRejected, match="weight"):
        WeightedSum.from_sums(SPECS, {"w": torch.zeros(12), "b": torch.zeros(3)}, 0.0, 2)
