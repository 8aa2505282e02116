"""Tensor payloads (checkpoints) written past the page cache, atomically, with checksums.

A server checkpoints its model every round while it is also sending and receiving
that model. A buffered write (what `torch.save` and safetensors do) copies every byte
into the page cache; on a machine whose page cache is already full, allocating those
pages made a 400 MB `torch.save` checkpoint cost 0.3-1.3 s of CPU here, against ~0.2 s
for the same checkpoint written with `O_DIRECT` (one memcpy into an aligned buffer;
the device does the rest).
No well-kept library writes tensors with `O_DIRECT`, so this module has its own small
format for them:

    b"FTTENS02" | u64 header length | u64 n | n x u64 checksums | header | zero padding to ALIGN
    blob 0 (a tensor's raw little-endian bytes) | zero padding to ALIGN | blob 1 | ...

The header is `torch.save` of the payload with every tensor of a wire dtype replaced
by a reference to its blob, so loading it with `weights_only=True` runs no code, and
each blob is read straight into a fresh tensor. Where `O_DIRECT` is not supported
(tmpfs, macOS) the same layout goes through the page cache.

Checksums (XXH3-64): the first covers the preamble and the header, then one per blob,
computed on the aligned buffer each blob is copied into on its way to the disk, and
checked when it is read back, so a flipped byte anywhere in the header or in a
tensor is refused with the tensor's name instead of resumed from. XXH3 because the
checksum runs on the background thread that writes a checkpoint while the next round
runs: it costs ~0.03 s of CPU per GB here and releases the GIL (figures and the other
candidates in benchmarks/RESULTS.md). The blobs are written first and the head
(preamble, checksums, header) last, so each checksum is computed in the same pass as
its copy. Files written before checksums (`FTTENS01`: no count, no checksums) still
load, with a warning that they are unverified.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from fedtrain.errors import ConfigError
from fedtrain.files import atomic_path
from fedtrain.tensors import DTYPES, dtype_name, torch_dtype

__all__ = ["load_tensor_file", "save_tensor_file"]

log = logging.getLogger(__name__)

MAGIC = b"FTTENS02"
#: The format before checksums: `MAGIC_UNVERIFIED | u64 header length | header | ...`.
MAGIC_UNVERIFIED = b"FTTENS01"
#: Offsets, lengths and buffer addresses of direct writes are multiples of this (the
#: largest logical block size in common use).
ALIGN = 4096
#: Bytes copied into the aligned buffer and written per call.
_BUFFER_BYTES = 4 << 20
_BLOB = "__fedtrain_blob__"
_PREAMBLE = struct.Struct("<8sQQ")  # magic, header length, number of checksums
_PREAMBLE_UNVERIFIED = struct.Struct("<8sQ")
_SUM = struct.Struct("<Q")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (sharing memory when it is contiguous)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _split(payload: Any, blobs: list[torch.Tensor], offset: list[int]) -> Any:
    """`payload` with each wire-dtype tensor replaced by
    [offset, nbytes, dtype, shape, blob index]."""
    if isinstance(payload, torch.Tensor) and payload.dtype in DTYPES.values():
        data = _flat_bytes(payload)
        ref = [offset[0], data.numel(), dtype_name(payload.dtype), list(payload.shape), len(blobs)]
        blobs.append(data)
        offset[0] += _aligned(data.numel())
        return {_BLOB: ref}
    if isinstance(payload, dict):
        return {k: _split(v, blobs, offset) for k, v in payload.items()}
    if isinstance(payload, list | tuple):
        return type(payload)(_split(v, blobs, offset) for v in payload)
    return payload


class _DirectWriter:
    """Positional writes from one page-aligned buffer; `O_DIRECT` where the file system
    takes it, else (or after the first EINVAL) through the page cache."""

    def __init__(self, path: Path) -> None:
        self.buffer = mmap.mmap(-1, _BUFFER_BYTES)  # anonymous: page-aligned
        self.staging = torch.frombuffer(self.buffer, dtype=torch.uint8)
        direct = getattr(os, "O_DIRECT", 0)
        self.fd = -1
        if direct:
            with contextlib.suppress(OSError):
                self.fd = os.open(path, os.O_WRONLY | direct)
        self.direct = self.fd >= 0
        if not self.direct:
            self.fd = os.open(path, os.O_WRONLY)
        self.path = path

    def write(self, data: torch.Tensor, offset: int) -> int:
        """Write `data` (flat uint8) at `offset` (a multiple of ALIGN), zero-padded to
        ALIGN; returns the checksum of `data`, taken from the buffer that was written."""
        checksum = xxhash.xxh3_64()
        view = memoryview(self.buffer)
        for start in range(0, max(data.numel(), 1), _BUFFER_BYTES):
            piece = data[start : start + _BUFFER_BYTES]
            size = _aligned(piece.numel())
            self.staging[: piece.numel()].copy_(piece)
            self.staging[piece.numel() : size].zero_()
            checksum.update(view[: piece.numel()])
            self._pwrite(view[:size], offset + start)
        return checksum.intdigest()

    def _pwrite(self, view: memoryview, offset: int) -> None:
        try:
            written = os.pwrite(self.fd, view, offset)
        except OSError as exc:
            if not (self.direct and exc.errno == errno.EINVAL):
                raise
            os.close(self.fd)  # the file system refuses direct I/O after all
            self.fd, self.direct = os.open(self.path, os.O_WRONLY), False
            written = os.pwrite(self.fd, view, offset)
        if written != len(view):
            raise OSError(f"short write to {self.path}: {written} of {len(view)} bytes")

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)  # the buffer is unmapped once nothing refers to it


def save_tensor_file(path: Path, payload: Any) -> None:
    """Write `payload` (dicts, lists, tuples, tensors, plain values) atomically to `path`."""
    blobs: list[torch.Tensor] = []
    skeleton = _split(payload, blobs, [0])
    buffer = io.BytesIO()
    torch.save(skeleton, buffer)
    header = buffer.getvalue()
    preamble = _PREAMBLE.pack(MAGIC, len(header), 1 + len(blobs))
    data_start = _aligned(len(preamble) + _SUM.size * (1 + len(blobs)) + len(header))
    with atomic_path(path) as tmp:
        writer = _DirectWriter(tmp)
        try:
            sums = [xxhash.xxh3_64_intdigest(preamble + header)]
            offset = data_start
            for blob in blobs:
                sums.append(writer.write(blob, offset))
                offset += _aligned(blob.numel())
            head = preamble + b"".join(_SUM.pack(s) for s in sums) + header
            writer.write(torch.frombuffer(bytearray(head), dtype=torch.uint8), 0)
        finally:
            writer.close()


class _Reader:
    """Reads one tensor file back; every problem is a `damaged` error naming the file."""

    def __init__(self, path: Path, f: BinaryIO) -> None:
        self.path = path
        self.f = f
        self.size = path.stat().st_size
        self.sums: list[int] | None = None  # None: a file from before checksums

    def damaged(self, what: str) -> ConfigError:
        return ConfigError(
            f"{self.path} is damaged ({what}); its contents cannot be trusted. Restore an older "
            "copy of it from a backup (the run then repeats the rounds after that copy), or "
            "start the run anew"
        )

    def read_exact(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.damaged(f"truncated {what}")
        return data

    def header(self) -> tuple[Any, int]:
        """The payload's skeleton (blob references in place of tensors) and where the
        blobs start."""
        magic = self.read_exact(len(MAGIC), "preamble")
        if magic == MAGIC:
            rest = self.read_exact(_PREAMBLE.size - len(magic), "preamble")
            _, header_len, count = _PREAMBLE.unpack(magic + rest)
            if _PREAMBLE.size + _SUM.size * count + header_len > self.size:
                raise self.damaged("truncated header")
            sums = self.read_exact(_SUM.size * count, "checksums")
            self.sums = [s for (s,) in _SUM.iter_unpack(sums)]
            header = self.read_exact(header_len, "header")
            if not self.sums or xxhash.xxh3_64_intdigest(magic + rest + header) != self.sums[0]:
                raise self.damaged("its header fails its checksum")
            head_len = _PREAMBLE.size + len(sums) + header_len
        elif magic == MAGIC_UNVERIFIED:
            rest = self.read_exact(_PREAMBLE_UNVERIFIED.size - len(magic), "preamble")
            (header_len,) = struct.unpack("<Q", rest)
            if _PREAMBLE_UNVERIFIED.size + header_len > self.size:
                raise self.damaged("truncated header")
            header = self.read_exact(header_len, "header")
            head_len = _PREAMBLE_UNVERIFIED.size + header_len
            log.warning(
                "%s was written before fedtrain checksummed tensor files: it is loaded "
                "unverified (damage inside it would go unnoticed); files written from now on "
                "carry checksums",
                self.path,
            )
        else:
            raise self.damaged("not a fedtrain tensor file")
        try:
            skeleton = torch.load(io.BytesIO(header), weights_only=True)
        except Exception as exc:  # a damaged header of a file without checksums
            raise self.damaged(f"unreadable header: {exc}") from None
        return skeleton, _aligned(head_len)

    def tensor(self, ref: list[Any], data_start: int, name: str) -> torch.Tensor:
        """Read blob `ref` into a fresh tensor and check it against its checksum."""
        offset, nbytes, dtype, shape = ref[:4]
        out = torch.empty(shape, dtype=torch_dtype(dtype))
        view = out.reshape(-1).view(torch.uint8)
        where = f"tensor {name!r} ({dtype} {tuple(shape)})"
        if view.numel() != nbytes or data_start + offset + nbytes > self.size:
            raise self.damaged(f"{where} is truncated")
        self.f.seek(data_start + offset)
        if nbytes and self.f.readinto(memoryview(view.numpy())) != nbytes:
            raise self.damaged(f"short read of {where}")
        if self.sums is not None:
            index = ref[4] + 1 if len(ref) > 4 else len(self.sums)
            if index >= len(self.sums):
                raise self.damaged(f"{where} has no checksum")
            if xxhash.xxh3_64_intdigest(memoryview(view.numpy())) != self.sums[index]:
                raise self.damaged(f"{where} fails its checksum")
        return out


def load_tensor_file(path: Path, *, tensors: bool = True) -> Any:
    """The payload `save_tensor_file` wrote, every checksum verified; a clear error
    naming the file (and the tensor) when it is damaged.

    `tensors=False` reads the header alone: the plain values, with None for each tensor
    (e.g. a checkpoint's round, without reading its model).
    """
    with path.open("rb") as f:
        reader = _Reader(path, f)
        skeleton, data_start = reader.header()

        def join(node: Any, name: str) -> Any:
            if isinstance(node, dict) and set(node) == {_BLOB}:
                return reader.tensor(node[_BLOB], data_start, name) if tensors else None
            if isinstance(node, dict):
                return {k: join(v, f"{name}/{k}" if name else str(k)) for k, v in node.items()}
            if isinstance(node, list | tuple):
                return type(node)(join(v, f"{name}/{i}") for i, v in enumerate(node))
            return node

        return join(skeleton, "")
