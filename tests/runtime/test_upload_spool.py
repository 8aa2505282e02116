"""The upload journal: only complete, valid updates count in the aggregate, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedtrain.errors import TensorStreamError, UpdateRejected
from fedtrain.runtime.server.uploads import (
    MemoryBudget,
    UpdateSpool,
    ensure_finite,
    remove_stale_spools,
)
from fedtrain.strategy import WeightedSum
from fedtrain.strategy.dpfedavg import ClippedSum
from fedtrain.strategy.fedbuff import StalenessBuffer
from fedtrain.tensors import Chunk, ModelState


def _update() -> ModelState:
    gen = torch.Generator().manual_seed(1)
    return ModelState(
        {
            "w": torch.randn(40, 3, generator=gen).to(torch.bfloat16),
            "b": torch.randn(7, generator=gen),
            "steps": torch.arange(9, dtype=torch.int64),
            "none": torch.zeros(0),
        }
    )


def test_fold_equals_adding_the_whole_update(tmp_path: Path) -> None:
    update = _update()
    via_spool = WeightedSum(update.specs)
    with UpdateSpool(update.specs, tmp_path, max_chunk_bytes=64) as spool:
        for chunk in update.chunks(64):
            spool.add(chunk)
        spool.finish()
        spool.fold_into(via_spool, 3.0)
        assert spool.path.exists()
    assert not list(tmp_path.iterdir()), "the spool file is deleted on exit"
    direct = WeightedSum(update.specs)
    direct.add(update, 3.0)
    for name in update:
        assert torch.equal(via_spool.mean()[name], direct.mean()[name])


def test_folding_from_the_journal_skips_only_the_nan_check(tmp_path: Path) -> None:
    """The journal's chunks were found finite as they arrived; the aggregators' own work
    (DP's clip, FedBuff's staleness weight) still happens when they are folded."""
    update = ModelState({"w": torch.full((40, 3), 2.0), "b": torch.full((7,), 2.0)})
    clipped = ClippedSum(update.specs, clip_norm=1.0)
    stale = StalenessBuffer(update.specs, version=3, weigh=lambda s: 0.5**s, max_staleness=None)
    stale.stage(base_version=2)
    with UpdateSpool(update.specs, tmp_path, max_chunk_bytes=64) as spool:
        for chunk in update.chunks(64):
            spool.add(chunk)
        spool.finish()
        spool.fold_into(clipped, 10.0)
        spool.fold_into(stale, 10.0)
    norm = torch.cat([t.reshape(-1) for t in clipped.take_sums().values()]).norm()
    assert norm.item() == pytest.approx(1.0) and clipped.total_weight == 1.0
    assert all(torch.all(acc == 10.0) for acc in stale.sums.values())  # 10 x 0.5 x 2.0
    with pytest.raises(UpdateRejected, match="NaN/Inf"):  # only while a journal is folded
        clipped.add_chunk("b", 0, torch.full((7,), float("nan")), 1.0)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda c: Chunk(c.name, c.dtype, (41, 3), c.offset, c.data), TensorStreamError, "'w'"),
        (
            lambda c: Chunk(c.name, "float32", c.shape, c.offset, c.data),
            TensorStreamError,
            "float32",
        ),
        (lambda c: Chunk("nope", c.dtype, c.shape, c.offset, c.data), TensorStreamError, "nope"),
        (
            lambda c: Chunk(c.name, c.dtype, c.shape, c.offset + 1, c.data),
            TensorStreamError,
            "aligned",
        ),
        (
            lambda c: Chunk(c.name, c.dtype, c.shape, c.offset, bytes(c.data) + bytes(64)),
            TensorStreamError,
            "exceeds the server's chunk_bytes",
        ),
    ],
)
def test_malformed_chunks_are_refused(tmp_path, mutate, error, match) -> None:
    update = _update()
    with UpdateSpool(update.specs, tmp_path, max_chunk_bytes=64) as spool:
        first = next(update.chunks(64))
        with pytest.raises(error, match=match):
            spool.add(mutate(first))


def test_nan_is_refused_before_it_is_written(tmp_path: Path) -> None:
    update = _update()
    bad = update.clone()
    bad["b"][3] = float("nan")
    with UpdateSpool(bad.specs, tmp_path, max_chunk_bytes=1 << 20) as spool:
        with pytest.raises(UpdateRejected, match="NaN/Inf"):
            for chunk in bad.chunks():
                spool.add(chunk)
        assert spool.path.stat().st_size < bad.nbytes


def test_truncated_and_duplicated_streams_are_refused(tmp_path: Path) -> None:
    update = _update()
    chunks = list(update.chunks(64))
    aggregate = WeightedSum(update.specs)
    with UpdateSpool(update.specs, tmp_path, max_chunk_bytes=64) as spool:
        for chunk in chunks[:-1]:
            spool.add(chunk)
        with pytest.raises(TensorStreamError, match="stream ended early"):
            spool.finish()
        with pytest.raises(TensorStreamError, match="incomplete"):
            spool.fold_into(aggregate, 1.0)
        with pytest.raises(TensorStreamError, match="duplicate"):
            spool.add(chunks[0])
    assert aggregate.count == 0


def test_journals_stay_in_memory_within_the_shared_budget(tmp_path: Path) -> None:
    """An upload's journal is in memory if the whole update fits in what is left of the
    budget, else on disk: here the second of two uploads does not fit."""
    update = _update()
    budget = MemoryBudget(update.nbytes + update.nbytes // 2)
    folded = WeightedSum(update.specs)
    with (
        UpdateSpool(update.specs, tmp_path, 64, budget) as first,
        UpdateSpool(update.specs, tmp_path, 64, budget) as second,
    ):
        assert budget.used == update.nbytes, "the first reserved its whole update"
        for spool in (first, second):
            for chunk in update.chunks(64):
                spool.add(chunk)
        assert first.path is None, "the first upload fits in memory: no file"
        assert second.path is not None
        assert second.path.stat().st_size == update.nbytes
        assert budget.used == update.nbytes
        for spool in (first, second):
            spool.finish()
            spool.fold_into(folded, 2.0)
    assert budget.used == 0, "closing gives the memory back"
    assert not list(tmp_path.iterdir())
    direct = WeightedSum(update.specs)
    direct.add(update, 2.0)
    direct.add(update, 2.0)
    for name in update:
        assert torch.equal(folded.mean()[name], direct.mean()[name])


def test_stale_spools_are_removed(tmp_path: Path) -> None:
    spool = UpdateSpool(_update().specs, tmp_path, 64)
    spool.add(next(_update().chunks(64)))
    os.close(spool._fd)  # a crash leaves the file behind
    spool._fd = -1
    (tmp_path / "keep.txt").write_text("x")
    assert remove_stale_spools(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fast_finite_check_agrees_with_the_exact_one(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    ok = torch.tensor([big, big, -1.0, 0.0], dtype=dtype)  # the sum overflows; values are finite
    ensure_finite("w", ok)
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.tensor([1.0, bad, 2.0], dtype=dtype)
        with pytest.raises(UpdateRejected, match="'w' holds 1 NaN/Inf"):
            ensure_finite("w", values)
    ensure_finite("i", torch.tensor([1, 2], dtype=torch.int64))
    ensure_finite("e", torch.zeros(0, dtype=dtype))
