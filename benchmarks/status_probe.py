"""Times `Status` from a session of its own, as an operator's `fedtrain status` runs.

The swarm benchmark's driver shares its session with the swarm processes that
impersonate the sites, and so, under the kernel's autogroup scheduling, their share of
the CPU: on this 2-core machine a call it times waits for four busy processes that in a
deployment run on other hosts. An operator asks from a login shell on the server's host
(the run dir's socket) or from another host (the ports): this process runs in a session
of its own (`start_new_session`), asks each address about once a second, and prints one
JSON line per answered call: {"where": NAME, "seconds": S, "phase": PHASE, "at": UNIX
TIME ASKED} (to line a slow call up with the server's log).

    python -m benchmarks.status_probe NAME=ADDRESS [NAME=ADDRESS ...]

It runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time

from fedtrain.runtime.status import ServerUnreachable, fetch_status

#: Seconds between rounds of calls.
INTERVAL_S = 1.0


def status_seconds(address: str) -> tuple[float, str]:
    """How long one Status call to `address` took, and the phase it answered."""
    start = time.perf_counter()
    state = fetch_status(address, None, timeout_s=60)
    return time.perf_counter() - start, state.phase


def main(argv: list[str]) -> int:
    asked = [item.partition("=")[::2] for item in argv]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            for where, address in asked:
                with contextlib.suppress(ServerUnreachable):  # not up yet, or gone
                    asked_at = time.time()
                    seconds, phase = status_seconds(address)
                    print(
                        json.dumps(
                            {"where": where, "seconds": seconds, "phase": phase, "at": asked_at}
                        )
                    )
            sys.stdout.flush()
            time.sleep(INTERVAL_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
