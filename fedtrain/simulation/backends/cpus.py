"""How many CPU cores the simulation may use on this machine."""

from __future__ import annotations

import os


def machine_cpus() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
