"""Checksum candidates for `fedtrain.tensor_file` blobs, on a checkpoint-sized buffer.

A checkpoint is written on a background thread while the next round runs, so two
things count: the CPU time per GB, and whether the checksum holds the GIL (one that
does stalls the gRPC handlers and the round loop for as long as each call runs).
For each candidate this prints the CPU seconds per GB over 4 MiB pieces (what the
writer's staging buffer holds; best of `--repeat`) and, for one call over 64 MB on
a thread, the longest a pure-Python loop on the main thread went without running
(about the call's duration if the GIL is held, a scheduler tick if it is released).

    python -m benchmarks.checksum_bench [--mb 400] [--repeat 5]

`--checkpoint` times what the server does instead: `RunDir.save_checkpoint` (direct
I/O, fsync, rename; with the checksum) and `load_checkpoint` (verified) of a model of
`--mb` MB of random float32, wall and CPU seconds of the calling thread, best of
`--repeat`. Run it with PYTHONPATH pointing at a checkout without checksums to get
the cost of the checksum as the difference.
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

#: A checksum over `data` in pieces of the given size (the running value carried on).
Checksum = Callable[[memoryview, int], int]


def _zlib(data: memoryview, piece: int) -> int:
    crc = 0
    for start in range(0, len(data), piece):
        crc = zlib.crc32(data[start : start + piece], crc)
    return crc


def _google_crc32c(data: memoryview, piece: int) -> int:
    import google_crc32c

    crc = 0
    for start in range(0, len(data), piece):
        # It takes `bytes` only (not a memoryview), so every piece is copied first.
        crc = google_crc32c.extend(crc, bytes(data[start : start + piece]))
    return crc


def _crc32c(data: memoryview, piece: int) -> int:
    import crc32c

    crc = 0
    for start in range(0, len(data), piece):
        crc = crc32c.crc32c(data[start : start + piece], crc)
    return crc


def _xxh3(data: memoryview, piece: int) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for start in range(0, len(data), piece):
        h.update(data[start : start + piece])
    return h.intdigest()


def _blake2b(data: memoryview, piece: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    for start in range(0, len(data), piece):
        h.update(data[start : start + piece])
    return int.from_bytes(h.digest(), "little")


CANDIDATES: dict[str, Checksum] = {
    "zlib.crc32": _zlib,
    "google_crc32c.extend": _google_crc32c,
    "crc32c.crc32c": _crc32c,
    "xxhash.xxh3_64": _xxh3,
    "hashlib.blake2b(8)": _blake2b,
}


def _cpu_seconds(fn: Checksum, data: memoryview) -> float:
    started = time.thread_time()
    fn(data, PIECE)
    return time.thread_time() - started


def _longest_stall(fn: Checksum, data: memoryview) -> tuple[float, float]:
    """(seconds of one call over `data` on a thread, the longest the main thread's
    Python loop went without an iteration meanwhile)."""
    done = threading.Event()
    took: list[float] = []

    def call() -> None:
        started = time.perf_counter()
        fn(data, len(data))
        took.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=call)
    last = time.perf_counter()
    longest = 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return took[0], longest


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
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    parser.add_argument("--checkpoint", action="store_true", help="time RunDir checkpoints")
    args = parser.parse_args()
    if args.checkpoint:
        _checkpoint(args.mb, args.repeat)
        return
    data = memoryview(np.random.default_rng(0).integers(0, 256, args.mb << 20, dtype=np.uint8))
    gb = len(data) / 1e9
    print(f"{args.mb} MB buffer, {PIECE >> 20} MiB pieces, CPU time best of {args.repeat}")
    print(f"{'checksum':<22} {'CPU s/GB':>8} {'s/400MB':>8} {'GB/s':>6}   one 64 MB call")
    for name, fn in CANDIDATES.items():
        try:
            fn(data[:PIECE], PIECE)
        except ImportError as exc:
            print(f"{name:<22} not installed ({exc.name})")
            continue
        best = min(_cpu_seconds(fn, data) for _ in range(args.repeat))
        call_s, stall_s = _longest_stall(fn, data[: 64 << 20])
        print(
            f"{name:<22} {best / gb:8.3f} {best / gb * 0.4:8.3f} {gb / best:6.1f}   "
            f"{call_s * 1e3:5.0f} ms, main thread stalled <= {stall_s * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
