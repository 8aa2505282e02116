"""Checksum candidates for `fedtrain.tensor_file` blobs, on a checkpoint-sized buffer.

A checkpoint is written on a background thread while the next round runs, so two
things count: the CPU time per GB, and whether the checksum holds the GIL (a
checksum that does stalls the gRPC handlers and the round loop for as long as it
runs). For each candidate this prints the seconds per GB over 4 MiB pieces (what
the writer's staging buffer holds) and how far a pure-Python loop on the main
thread slowed down while the checksum ran beside it (1.0x: the GIL was released).

    python -m benchmarks.checksum_bench [--mb 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

PIECE = 4 << 20


def _zlib(data: memoryview) -> int:
    crc = 0
    for start in range(0, len(data), PIECE):
        crc = zlib.crc32(data[start : start + PIECE], crc)
    return crc


def _google_crc32c(data: memoryview) -> int:
    import google_crc32c

    crc = 0
    for start in range(0, len(data), PIECE):
        # It takes `bytes` only (not a memoryview), so every piece is copied first.
        crc = google_crc32c.extend(crc, bytes(data[start : start + PIECE]))
    return crc


def _crc32c(data: memoryview) -> int:
    import crc32c

    crc = 0
    for start in range(0, len(data), PIECE):
        crc = crc32c.crc32c(data[start : start + PIECE], crc)
    return crc


def _xxh3(data: memoryview) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for start in range(0, len(data), PIECE):
        h.update(data[start : start + PIECE])
    return h.intdigest()


def _blake2b(data: memoryview) -> int:
    h = hashlib.blake2b(digest_size=8)
    for start in range(0, len(data), PIECE):
        h.update(data[start : start + PIECE])
    return int.from_bytes(h.digest(), "little")


def _memcpy(data: memoryview) -> int:
    """Not a checksum: a copy that releases the GIL, the baseline of the last column."""
    np.copyto(_SINK[: len(data)], np.frombuffer(data, dtype=np.uint8))
    return 0


_SINK = np.empty(0, dtype=np.uint8)

CANDIDATES: dict[str, Callable[[memoryview], int]] = {
    "(memcpy, baseline)": _memcpy,
    "zlib.crc32": _zlib,
    "google_crc32c.extend": _google_crc32c,
    "crc32c.crc32c": _crc32c,
    "xxhash.xxh3_64": _xxh3,
    "hashlib.blake2b(8)": _blake2b,
}


def _python_loop(seconds: float) -> int:
    """Iterations of a pure-Python loop in `seconds` (needs the GIL throughout)."""
    count, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        count += 1
    return count


def _gil_slowdown(fn: Callable[[memoryview], int], data: memoryview, seconds: float) -> float:
    """How much slower a Python loop runs while `fn` hashes `data` over and over beside it."""
    alone = _python_loop(seconds)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            fn(data)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        beside = _python_loop(seconds)
    finally:
        stop.set()
        thread.join()
    return alone / max(beside, 1)


def _checkpoint(mb: int, repeat: int) -> None:
    """Wall and thread CPU seconds of writing and reading back a checkpoint of `mb` MB."""
    import torch

    from fedtrain.run_dir import RunDir
    from fedtrain.tensors import ModelState

    model = ModelState({"weights": torch.randn((mb << 20) // 4, generator=torch.Generator())})
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        run_dir = RunDir(tmp)
        for name, fn in (
            ("save_checkpoint", lambda: run_dir.save_checkpoint(1, model, {}, {"x": 1})),
            ("load_checkpoint", run_dir.load_checkpoint),
        ):
            runs = []
            for _ in range(repeat):
                wall, cpu = time.perf_counter(), time.thread_time()
                fn()
                runs.append((time.perf_counter() - wall, time.thread_time() - cpu))
            wall_s, cpu_s = min(r[0] for r in runs), min(r[1] for r in runs)
            print(f"{name:<16} {mb} MB: wall {wall_s:.3f} s, CPU {cpu_s:.3f} s (best of {repeat})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=400, help="buffer size (100M float32: 400)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    parser.add_argument("--checkpoint", action="store_true", help="time RunDir checkpoints")
    args = parser.parse_args()
    if args.checkpoint:
        _checkpoint(args.mb, args.repeat)
        return
    global _SINK
    _SINK = np.empty(args.mb << 20, dtype=np.uint8)
    data = memoryview(np.random.default_rng(0).integers(0, 256, args.mb << 20, dtype=np.uint8))
    gb = len(data) / 1e9
    print(f"{args.mb} MB buffer, {PIECE >> 20} MiB pieces, best of {args.repeat}")
    print(f"{'checksum':<22} {'s/GB':>7} {'s/400MB':>8} {'GB/s':>6} {'python loop beside':>19}")
    for name, fn in CANDIDATES.items():
        try:
            fn(data[:PIECE])
        except ImportError as exc:
            print(f"{name:<22} not installed ({exc.name})")
            continue
        best = min(_timed(fn, data) for _ in range(args.repeat))
        slowdown = _gil_slowdown(fn, data[: 64 << 20], 2.0)
        print(
            f"{name:<22} {best / gb:7.3f} {best / gb * 0.4:8.3f} {gb / best:6.1f} {slowdown:18.2f}x"
        )


def _timed(fn: Callable[[memoryview], int], data: memoryview) -> float:
    started = time.perf_counter()
    fn(data)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
