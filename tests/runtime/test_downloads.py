"""What a model download sends (`server/downloads.py`): the pieces of a plain call and of
parallel streams' ranges, for models shared as wire bytes and for those chunked per
download."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
import torch

from fedtrain.compression.settings import DownloadSettings
from fedtrain.runtime import wire
from fedtrain.runtime.server import downloads
from fedtrain.runtime.server.downloads import SharedDownloads
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.tensors import ModelState

MIB = 1 << 20


async def _run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _model(*numels: int) -> GlobalModel:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(numels)}
    return GlobalModel(1, "v1", ModelState(tensors))


def _sizes(model: GlobalModel, chunk_bytes: int, *, ranged: bool, current: bool = True) -> list:
    served = SharedDownloads(chunk_bytes, DownloadSettings())
    prepared = served.prepare(
        model, encoded=False, current=current, held="", run=_run, ranged=ranged
    )
    _, pieces = asyncio.run(prepared)
    return [size for _, size in pieces]


def _ends(sizes: list[int]) -> set[int]:
    return set(itertools.accumulate(sizes))


@pytest.mark.parametrize("shared", [True, False], ids=["wire-bytes", "chunked"])
def test_a_plain_download_sends_its_first_bytes_in_range_pieces(monkeypatch, shared) -> None:
    """A 10 MB model (a bias first, then 10 MB of weights): the chunks that start in the
    first HEAD_BYTES come in 64 KiB pieces (a lossy link's single flow moves several in
    the second the site judges its call), the rest in chunk_bytes; every chunk's end is
    a piece's end, and the ranged pieces end wherever the plain ones do, so a call cut
    or resumed at any piece continues in ranges or another call."""
    if not shared:  # (a model above SHARED_DOWNLOAD_BYTES is chunked per download)
        monkeypatch.setattr(downloads, "SHARED_DOWNLOAD_BYTES", 0)
    model = _model(10, 2_500_000)
    plain = _sizes(model, 4 * MIB, ranged=False)
    ranged = _sizes(model, 4 * MIB, ranged=True)
    assert sum(plain) == sum(ranged) == model.state.nbytes
    starts = list(itertools.accumulate(plain, initial=0))[:-1]
    head = [size for start, size in zip(starts, plain, strict=True) if start < wire.HEAD_BYTES]
    assert plain[0] == 40 and max(head) == wire.RANGE_CHUNK_BYTES
    assert len(head) > wire.HEAD_BYTES // wire.RANGE_CHUNK_BYTES  # (the last: to 4 MiB + 40)
    assert plain[len(head) :] == [4 * MIB, model.state.nbytes - 40 - 8 * MIB]
    assert _ends(_sizes(model, 4 * MIB, ranged=False, current=False)) == _ends(plain)
    assert _ends(plain) <= _ends(ranged)
    assert _ends([40, 4 * MIB, 4 * MIB, sum(plain) - 40 - 8 * MIB]) <= _ends(plain)


def test_a_download_the_site_never_cuts_goes_in_whole_chunks() -> None:
    """Below PROBE_MIN_BYTES (the many-sites swarm's 400 KB model) a plain download is
    whole chunks: small pieces would cost the server messages at every site."""
    model = _model(100_000)
    assert _sizes(model, 4 * MIB, ranged=False) == [400_000]
    assert max(_sizes(model, 4 * MIB, ranged=True)) == wire.RANGE_CHUNK_BYTES


def test_ranged_pieces_end_where_chunks_do_whatever_the_chunk_size() -> None:
    """A chunk_bytes that is no multiple of the range pieces (1 MB): a range piece never
    straddles a chunk's end, so a plain call cut after any chunk continues in ranges
    without a gap (before, the pieces were cut from each tensor's start, and the bytes
    from a chunk's end to the next 64 KiB were sent by no range)."""
    model = _model(1_500_000)
    plain = _sizes(model, 1_000_000, ranged=False)
    ranged = _sizes(model, 1_000_000, ranged=True)
    assert _ends(plain) <= _ends(ranged) and max(ranged) <= wire.RANGE_CHUNK_BYTES
    assert {1_000_000, 2_000_000, 6_000_000} <= _ends(plain)
