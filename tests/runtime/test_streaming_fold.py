"""Uploads are journaled as they arrive and fold into the round's sum when whole, so an
unfinished one leaves no trace: the sum is bit for bit the sum without it.

Driven at the `RoundState` level (the lock-holding object the servicer's threads and
the coordinator share), with real journals on disk.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fedtrain.errors import TensorStreamError
from fedtrain.runtime.server.rounds import Outcome, RoundState, UploadRefused
from fedtrain.runtime.server.sessions import Session
from fedtrain.runtime.server.uploads import UpdateSpool
from fedtrain.strategy import WeightedSum
from fedtrain.strategy.aggregate import UpdateCollector
from fedtrain.tensors import ModelState

CHUNK = 64


def _update(seed: int) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    return ModelState({"w": torch.randn(40, 3, generator=gen), "b": torch.randn(9, generator=gen)})


def _round(aggregate, *sites: Session) -> RoundState:
    return RoundState(
        round=1,
        attempt=1,
        model_version="v",
        plan={s.site: {} for s in sites},
        tokens={s.site: s.token for s in sites},
        aggregate=aggregate,
        deadline=time.monotonic() + 60,
    )


def _stream(state: RoundState, site: Session, spool: UpdateSpool, update: ModelState, n=None):
    state.admit(site, 1, "v")
    for chunk in list(update.chunks(CHUNK))[:n]:
        spool.add(chunk)


def _without(directory: Path, *updates: ModelState) -> WeightedSum:
    """The round's sum had only `updates` ever arrived (weight 2 each, same chunks)."""
    direct = WeightedSum(updates[0].specs)
    for u in updates:
        with UpdateSpool(u.specs, directory, CHUNK) as spool:
            for chunk in u.chunks(CHUNK):
                spool.add(chunk)
            spool.finish()
            spool.fold_into(direct, 2.0)
    return direct


def test_a_broken_upload_leaves_the_sum_bit_identical_to_a_round_without_it(
    tmp_path: Path,
) -> None:
    a, b, c = Session("a", "peer"), Session("b", "peer"), Session("c", "peer")
    ua, ub, uc = _update(1), _update(2), _update(3)
    state = _round(WeightedSum(ua.specs), a, b, c)
    with (
        UpdateSpool(ua.specs, tmp_path, CHUNK) as sa,
        UpdateSpool(ub.specs, tmp_path, CHUNK) as sb,
        UpdateSpool(uc.specs, tmp_path, CHUNK) as sc,
    ):
        _stream(state, b, sb, ub)
        sb.finish()
        state.commit(b, sb, 2, {})
        _stream(state, a, sa, ua, n=3)  # a's stream breaks after three chunks...
        _stream(state, c, sc, uc)  # ...while c's arrives whole, interleaved with it
        sc.finish()
        state.commit(c, sc, 2, {})
        with pytest.raises(TensorStreamError, match="stream ended early"):
            sa.finish()
        state.abandon("a")
    assert state.outcomes == {"a": Outcome.PENDING, "b": Outcome.DONE, "c": Outcome.DONE}
    want = _without(tmp_path, ub, uc)
    for name, acc in state.aggregate.sums.items():
        assert torch.equal(acc, want.sums[name]), name
    assert (state.aggregate.count, state.aggregate.total_weight) == (2, 4.0)


def test_closing_the_round_mid_upload_refuses_the_rest_and_leaves_no_trace(
    tmp_path: Path,
) -> None:
    a = Session("a", "peer")
    ua = _update(1)
    state = _round(WeightedSum(ua.specs), a)
    with UpdateSpool(ua.specs, tmp_path, CHUNK) as spool:
        _stream(state, a, spool, ua, n=2)
        summary = state.close()  # the deadline passed
        assert summary.dropped == ["a"] and not summary.poisoned
        for chunk in list(ua.chunks(CHUNK))[2:]:
            spool.add(chunk)
        spool.finish()
        with pytest.raises(UploadRefused, match="closed while the update was being received"):
            state.commit(a, spool, 2, {})
    assert all(not torch.any(acc) for acc in state.aggregate.sums.values())
    assert state.aggregate.count == 0


def test_whole_update_aggregators_get_the_update_from_the_journal_at_commit(tmp_path) -> None:
    a, b = Session("a", "peer"), Session("b", "peer")
    ua, ub = _update(1), _update(2)
    state = _round(UpdateCollector(ua.specs), a, b)
    with UpdateSpool(ua.specs, tmp_path, CHUNK) as sa, UpdateSpool(ub.specs, tmp_path, CHUNK) as sb:
        _stream(state, a, sa, ua, n=2)
        _stream(state, b, sb, ub)  # interleaved streams cannot mix: nothing staged yet
        sb.finish()
        state.commit(b, sb, 2, {})
        state.abandon("a")
    ((staged, weight),) = state.aggregate.updates
    assert weight == 2.0
    assert torch.equal(staged["w"], ub["w"].reshape(-1))
