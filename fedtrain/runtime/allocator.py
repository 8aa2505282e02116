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
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    applied = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and applied
    if not applied:
        log.debug("mallopt refused the allocator settings; glibc's defaults stay")
    return applied
