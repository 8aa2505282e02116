"""Ending a process that has finished its work, without the interpreter's teardown.

A process that has imported torch spends seconds, on a busy machine, in its final
garbage collection and module teardown (py-spy: the main thread in `gc_collect_main`
after `main()` returned), and threads it no longer needs (gRPC's, OpenMP's) are joined
or torn down on the way. A site daemon or a DDP worker that has stopped cleanly has
nothing left to save, while a service manager (systemd, Kubernetes) waits for it to
exit, and kills it past its grace period. So once the work is done and everything
that matters is closed, they leave at once, after flushing what is buffered.

No torch here: whoever calls this decides it is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def leave_now(code: int = 0) -> NoReturn:
    """Flush log handlers and the standard streams, then `os._exit(code)`.

    Skips atexit handlers and `finally` blocks of other threads: call it only when
    every resource worth closing is closed (worker groups, files, channels).
    """
    with contextlib.suppress(Exception):
        logging.shutdown()  # flushes and closes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
