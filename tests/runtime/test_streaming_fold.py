"""Uploads fold into the round's sum as they arrive; an unfinished one leaves no trace.

Driven at the `RoundState` level (the lock-holding object the servicer's threads and
the coordinator share), with real journals on disk.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fedtrain.errors import TensorStreamError
from fedtrain.runtime.rounds import Outcome, RoundState, UploadRefused
from fedtrain.runtime.sessions import Session
from fedtrain.runtime.upload import UpdateSpool
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
        state.fold(site.site, spool, spool.add(chunk), 2.0)


def _expected(*updates: ModelState) -> dict[str, torch.Tensor]:
    direct = WeightedSum(updates[0].specs)
    for u in updates:
        direct.add(u, 2.0)
    return direct.mean()


def test_a_broken_upload_is_taken_back_out_while_another_folds(tmp_path: Path) -> None:
    a, b = Session("a", "peer"), Session("b", "peer")
    ua, ub = _update(1), _update(2)
    state = _round(WeightedSum(ua.specs), a, b)
    with UpdateSpool(ua.specs, tmp_path, CHUNK) as sa, UpdateSpool(ub.specs, tmp_path, CHUNK) as sb:
        _stream(state, a, sa, ua, n=3)  # a's stream breaks after three chunks...
        _stream(state, b, sb, ub)  # ...while b's arrives whole, interleaved in the sum
        assert sa.folded == 3
        with pytest.raises(TensorStreamError, match="stream ended early"):
            sa.finish()
        state.abandon("a")
        sb.finish()
        state.commit(b, sb, 2, {})
    assert state.outcomes == {"a": Outcome.PENDING, "b": Outcome.DONE}
    got, want = state.aggregate.mean(), _expected(ub)
    for name in want:  # b alone, up to the rounding that taking a's chunks out leaves
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    assert state.aggregate.count == 1


def test_closing_the_round_mid_upload_undoes_it_and_refuses_the_rest(tmp_path: Path) -> None:
    a = Session("a", "peer")
    ua = _update(1)
    state = _round(WeightedSum(ua.specs), a)
    with UpdateSpool(ua.specs, tmp_path, CHUNK) as spool:
        _stream(state, a, spool, ua, n=2)
        summary = state.close()  # the deadline passed
        assert summary.dropped == ["a"] and not summary.poisoned
        for acc in state.aggregate.sums.values():
            assert torch.count_nonzero(acc.abs() > 1e-6) == 0
        late = next(iter(list(ua.chunks(CHUNK))[2:]))
        with pytest.raises(UploadRefused, match="closed while the update was being received"):
            state.fold("a", spool, spool.add(late), 2.0)


def test_whole_update_aggregators_get_the_update_from_the_journal_at_commit(tmp_path) -> None:
    a, b = Session("a", "peer"), Session("b", "peer")
    ua, ub = _update(1), _update(2)
    state = _round(UpdateCollector(ua.specs), a, b)
    with UpdateSpool(ua.specs, tmp_path, CHUNK) as sa, UpdateSpool(ub.specs, tmp_path, CHUNK) as sb:
        _stream(state, a, sa, ua, n=2)
        _stream(state, b, sb, ub)  # interleaved streams cannot mix: nothing staged yet
        assert sa.folded == sb.folded == 0
        sb.finish()
        state.commit(b, sb, 2, {})
        state.abandon("a")
    ((staged, weight),) = state.aggregate.updates
    assert weight == 2.0
    assert torch.equal(staged["w"], ub["w"].reshape(-1))
