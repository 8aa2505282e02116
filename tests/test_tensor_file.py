"""fedtrain.tensor_file: tensor payloads round-trip bit for bit, atomically, and damage is named."""

from __future__ import annotations

import io
import logging
import os
import struct
from pathlib import Path

import pytest
import torch

from fedtrain import tensor_file
from fedtrain.errors import ConfigError
from fedtrain.run_dir import RunDir
from fedtrain.tensors import ModelState


def _payload() -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 1_500_000, generator=gen)  # 18 MB: several staging buffers
    return {
        "round": 7,
        "model": {
            "w": weights,
            "half": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
            "flags": torch.tensor([True, False, True]),
            "steps": torch.tensor(12345678901, dtype=torch.int64),  # 0-dim
            "empty": torch.zeros(0, 4),
        },
        "strategy": {"moments": [torch.ones(3, dtype=torch.float64), (1, "x")]},
        "extra": {"model_version": "abc", "cfg": {"lr": 0.1}, "note": None},
        "strided": weights[:, ::2],  # non-contiguous: written as its values
        "complex": torch.ones(2, dtype=torch.complex64),  # no wire dtype: stays in the header
    }


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.is_complex():
            assert torch.equal(a, b)
        else:  # bits, so NaN payloads and -0.0 count
            as_bytes = a.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(as_bytes, b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_round_trip_bit_exact_and_aligned(tmp_path: Path) -> None:
    path = tmp_path / "ck.ft"
    payload = _payload()
    tensor_file.save_tensor_file(path, payload)
    assert path.stat().st_size % tensor_file.ALIGN == 0
    _same(payload, tensor_file.load_tensor_file(path))
    assert [p.name for p in tmp_path.iterdir()] == ["ck.ft"]  # no temp file left


def test_falls_back_to_the_page_cache_when_direct_io_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses O_DIRECT at the first write still gets the same file."""
    real = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if not refused:  # the first write, made with O_DIRECT, is refused
            refused.append(offset)
            raise OSError(22, "Invalid argument")
        return real(fd, data, offset)

    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform: the buffered path is the only path")
    monkeypatch.setattr(tensor_file.os, "pwrite", pwrite)
    payload = _payload()
    tensor_file.save_tensor_file(tmp_path / "ck.ft", payload)
    assert len(refused) == 1  # then every write went through the page cache
    _same(payload, tensor_file.load_tensor_file(tmp_path / "ck.ft"))


def test_a_failed_write_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ck.ft"
    tensor_file.save_tensor_file(path, {"round": 1, "w": torch.ones(10)})

    def broken(fd: int, data: memoryview, offset: int) -> int:
        if offset > 0:
            raise OSError(28, "No space left on device")
        return len(data)

    monkeypatch.setattr(tensor_file.os, "pwrite", broken)
    with pytest.raises(OSError, match="No space"):
        tensor_file.save_tensor_file(path, {"round": 2, "w": torch.zeros(10)})
    monkeypatch.undo()
    assert tensor_file.load_tensor_file(path)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ck.ft"]


@pytest.mark.parametrize("cut", ["preamble", "header", "blob", "magic"])
def test_damaged_files_are_named(tmp_path: Path, cut: str) -> None:
    path = tmp_path / "ck.ft"
    tensor_file.save_tensor_file(path, {"w": torch.arange(5000, dtype=torch.float32)})
    data = path.read_bytes()
    damaged = {
        "preamble": data[:10],
        "header": data[:40],
        "blob": data[: tensor_file.ALIGN + 100],
        "magic": b"NOTMAGIC" + data[8:],
    }[cut]
    path.write_bytes(damaged)
    with pytest.raises(ConfigError, match=r"ck\.ft is damaged .*start the run anew"):
        tensor_file.load_tensor_file(path)


def test_run_dir_checkpoint_and_legacy_torch_save(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    state = ModelState({"w": torch.randn(100), "b": torch.zeros(3, dtype=torch.bfloat16)})
    run.save_checkpoint(4, state, {"m": torch.ones(2)}, {"model_version": "v4"})
    done, loaded, strategy, extra = run.load_checkpoint()
    assert (done, extra, list(strategy)) == (4, {"model_version": "v4"}, ["m"])
    assert loaded.equal(state)

    legacy = RunDir(tmp_path / "old")  # a run directory written before checkpoint.ft
    payload = {"round": 2, "model": dict(state.items()), "strategy": {}, "extra": {}}
    torch.save(payload, legacy.legacy_checkpoint_path)
    assert legacy.load_checkpoint()[0] == 2
    assert legacy.load_checkpoint()[1].equal(state)


def _flip(path: Path, at: int, n: int = 64) -> None:
    """Invert `n` bytes of `path` from offset `at` (what a failing disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


def _offset_of(path: Path, tensor: torch.Tensor) -> int:
    """Where `tensor`'s bytes (64 of them from its middle) lie in the file."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    middle = len(raw) // 2
    at = path.read_bytes().find(raw[middle : middle + 64])
    assert at > 0
    return at


def test_flipped_bytes_in_a_tensor_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "ck.ft"
    payload = _payload()
    tensor_file.save_tensor_file(path, payload)
    _flip(path, _offset_of(path, payload["model"]["w"]))
    with pytest.raises(ConfigError) as refused:
        tensor_file.load_tensor_file(path)
    message = str(refused.value)
    assert "tensor 'model/w' (float32 (3, 1500000)) fails its checksum" in message
    assert str(path) in message and "Restore an older copy" in message
    assert "start the run anew" in message


def test_every_tensor_is_checked_not_only_the_first(tmp_path: Path) -> None:
    path = tmp_path / "ck.ft"
    payload = _payload()
    tensor_file.save_tensor_file(path, payload)
    moments = payload["strategy"]["moments"][0]
    _flip(path, _offset_of(path, moments), n=1)
    with pytest.raises(ConfigError, match=r"tensor 'strategy/moments/0' \(float64 \(3,\)\) fails"):
        tensor_file.load_tensor_file(path)


@pytest.mark.parametrize("where", ["header", "checksums", "header length"])
def test_flipped_bytes_in_the_head_are_refused(tmp_path: Path, where: str) -> None:
    path = tmp_path / "ck.ft"
    tensor_file.save_tensor_file(path, {"round": 3, "w": torch.arange(5000.0)})
    preamble = tensor_file._PREAMBLE.size
    at, n = {
        "header": (preamble + 16 + 40, 64),
        "checksums": (preamble, 8),
        "header length": (8, 1),
    }[where]
    _flip(path, at, n)
    with pytest.raises(
        ConfigError, match=r"ck\.ft is damaged \((its header fails its checksum|truncated)"
    ):
        tensor_file.load_tensor_file(path)


def test_the_header_alone_is_read_without_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ck.ft"
    tensor_file.save_tensor_file(path, {"round": 3, "model": {"w": torch.ones(4)}})
    assert tensor_file.load_tensor_file(path, tensors=False) == {"round": 3, "model": {"w": None}}


def _save_unverified(path: Path, payload: dict) -> None:
    """The format fedtrain wrote before checksums (FTTENS01): no count, no checksums,
    blob references without an index."""
    blobs: list[torch.Tensor] = []
    skeleton = tensor_file._split(payload, blobs, [0])

    def strip(node: object) -> object:
        if isinstance(node, dict) and set(node) == {tensor_file._BLOB}:
            return {tensor_file._BLOB: node[tensor_file._BLOB][:4]}
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        return node

    header = io.BytesIO()
    torch.save(strip(skeleton), header)
    head = struct.pack("<8sQ", b"FTTENS01", header.tell()) + header.getvalue()
    data = bytearray(head.ljust(tensor_file._aligned(len(head)), b"\0"))
    for blob in blobs:
        raw = blob.numpy().tobytes()
        data += raw.ljust(tensor_file._aligned(len(raw)), b"\0")
    path.write_bytes(bytes(data))


def test_a_file_from_before_checksums_still_loads_and_says_it_is_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir(tmp_path / "run")
    state = ModelState({"w": torch.randn(100), "b": torch.zeros(3, dtype=torch.bfloat16)})
    payload = {"round": 5, "model": dict(state.items()), "strategy": {}, "extra": {"x": 1}}
    _save_unverified(run.checkpoint_path, payload)
    with caplog.at_level(logging.WARNING, logger="fedtrain.tensor_file"):
        done, loaded, _, extra = run.load_checkpoint()
    assert (done, extra) == (5, {"x": 1}) and loaded.equal(state)
    assert "loaded unverified" in caplog.text and "checkpoint.ft" in caplog.text
