"""glibc malloc settings for the processes that stream a model through memory each round.

Every round a server or a site allocates and frees the model's bytes several times over
in 4 MiB pieces: gRPC messages, upload journals, update chunks. With glibc's defaults
such pieces are served by fresh `mmap`s or returned to the kernel when the heap top is
trimmed, so each round pays page faults and kernel page zeroing for memory it had just
freed. Keeping them in the heap (pieces under 32 MiB come from the heap; up to 64 MiB of
free heap top is kept) made 100M-parameter rounds ~6% faster here (1.39-1.45 s vs
1.48-1.54 s in alternating runs; server -0.05 s and sites -0.12 s of CPU per round;
benchmarks/RESULTS.md). Peak RSS is unchanged (a 1 GiB trim threshold, also tried, kept
up to 0.8 GB more resident at 500M parameters for no speed gain).

`mallopt` must run before torch is imported: applied after it, the same settings gave
only part of the gain (1.47 s). Skipped on other C libraries, and wherever the operator
chose allocator settings already (`MALLOC_*` or `GLIBC_TUNABLES` in the environment, or
`FEDTRAIN_MALLOC=default` to keep glibc's defaults).

The other way round, a server with thousands of connections: gRPC's threads receive
each site's upload into memory of their own arenas, and what they free there stays
resident in pieces between other connections' live buffers, never at an arena's top
where glibc would trim it: ~100 KB per connection that carried an upload (2,000 bare
gRPC connections receiving 400 KB each: 110 MB -> 290 MB, and 165 MB after
`malloc_trim`). `release_free_memory` gives such pages back (the server calls it every
few seconds, `runtime/server/heap.py`; 27 ms for 400 MB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Pieces below this come from the heap (glibc's largest allowed value on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap top up to this is kept for the next round.
TRIM_THRESHOLD = 64 << 20


def operator_chose(environ: Mapping[str, str]) -> bool:
    """Whether the environment already sets glibc's allocator (or opts out of this)."""
    return environ.get("FEDTRAIN_MALLOC") == "default" or any(
        key.startswith("MALLOC_") or key == "GLIBC_TUNABLES" for key in environ
    )


def tune_allocator(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply the settings above (call first thing in a server or site process);
    returns whether they were applied."""
    if operator_chose(environ):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    applied = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and applied
    if not applied:
        log.debug("mallopt refused the allocator settings; glibc's defaults stay")
    return applied


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once: `find_library` runs `ldconfig` in a child process,
    which at every heap trim (every 10 s) was a spawn of a server holding 10,000
    connections, counted as a second copy of its resident memory while it ran."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the kernel (glibc's `malloc_trim`,
    which also releases free pages inside an arena, unlike the automatic trim of its
    top); False where the C library has none. ctypes releases the GIL meanwhile."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
