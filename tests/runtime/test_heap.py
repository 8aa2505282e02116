"""The frozen heap: the collector never walks what was alive at a freeze, and the
cyclic garbage of departed sites is reclaimed after enough of them left."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_support import TinyTask, inprocess_server, wait_for

from fedtrain.runtime.server.heap import FREEZE_EVERY_S, TRIM_EVERY_S, FrozenHeap


class _Site:
    """Stands for a site's objects: a reference cycle, as grpc.aio's call objects make."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def heap() -> Iterator[FrozenHeap]:
    heap = FrozenHeap(thaw_after=3)
    try:
        yield heap
    finally:
        heap.close()
        gc.collect()


def _departed_cycle() -> weakref.ref[_Site]:
    site = _Site()
    return weakref.ref(site)  # the cycle is garbage now, for the collector to find


def test_what_is_alive_at_a_freeze_is_out_of_the_collectors_sight(heap: FrozenHeap) -> None:
    gc.collect()
    alive = _Site()
    heap.tick(in_round=True, now=100.0)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    later = _Site()
    heap.tick(in_round=True, now=100.0 + FREEZE_EVERY_S / 2)  # not due yet
    assert gc.get_freeze_count() == frozen
    heap.tick(in_round=True, now=100.0 + FREEZE_EVERY_S)
    assert gc.get_freeze_count() > frozen
    assert alive.me is alive and later.me is later


def test_a_departed_sites_cycle_waits_for_the_thaw_then_is_collected(heap: FrozenHeap) -> None:
    gone = _departed_cycle()
    heap.tick(in_round=False, now=0.0)  # frozen with the rest
    gc.collect()
    assert gone() is not None  # a frozen cycle is not collected: what the thaw is for
    heap.site_left()
    heap.site_left()
    heap.tick(in_round=False, now=1.0)
    assert gone() is not None  # two departures of three: not yet
    heap.site_left()
    heap.tick(in_round=False, now=2.0)
    assert gone() is None and heap.departed == 0
    assert gc.get_freeze_count() > 0  # frozen again after the collection


def test_mid_round_the_thaw_waits_for_twice_as_many_departures(heap: FrozenHeap) -> None:
    gone = _departed_cycle()
    heap.tick(in_round=True, now=0.0)
    for _ in range(3):
        heap.site_left()
    heap.tick(in_round=True, now=1.0)
    gc.collect()
    assert gone() is not None
    for _ in range(3):
        heap.site_left()
    heap.tick(in_round=True, now=2.0)
    assert gone() is None


def test_close_unfreezes_everything(heap: FrozenHeap) -> None:
    heap.tick(in_round=False, now=0.0)
    assert gc.get_freeze_count() > 0
    heap.close()
    assert gc.get_freeze_count() == 0


def test_a_server_freezes_its_heap_while_it_runs_and_unfreezes_it_when_it_stops(
    tmp_path: Path,
) -> None:
    server = inprocess_server(tmp_path, TinyTask())
    try:
        wait_for(gc.get_freeze_count, 5.0, "the server's first freeze (once a second)")
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0


def test_freed_memory_is_given_back_every_few_seconds_off_the_callers_thread() -> None:
    submitted: list[object] = []
    trims: list[int] = []
    heap = FrozenHeap(submit=submitted.append, trim=lambda: trims.append(1))
    try:
        heap.tick(in_round=True, now=0.0)
        heap.tick(in_round=True, now=TRIM_EVERY_S / 2)
        assert len(submitted) == 1 and not trims  # handed to the pool, not run here
        heap.tick(in_round=True, now=TRIM_EVERY_S)
        assert len(submitted) == 2
    finally:
        heap.close()


#: In a fresh interpreter (a test process's arenas hold whatever earlier tests left):
#: a thread allocates and frees 192 MB in 64 KB buffers with small allocations that
#: stay between them, as gRPC's threads do with uploads; prints the bytes resident
#: before and after `release_free_memory`.
_THREAD_BUFFERS = """
import threading, psutil
from fedtrain.runtime.allocator import release_free_memory
kept = []
def receive():
    buffers = []
    for _ in range(3000):
        buffers.append(bytearray(64 * 1024))
        kept.append(bytearray(1024))  # what stays between them (a connection's state)
    del buffers
thread = threading.Thread(target=receive)
thread.start()
thread.join()
before = psutil.Process().memory_info().rss
assert release_free_memory()
print(before, psutil.Process().memory_info().rss)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_memory_gives_a_threads_freed_buffers_back_to_the_kernel() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _THREAD_BUFFERS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert before - after > 64 << 20, (before, after)
