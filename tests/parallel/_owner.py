"""A process that owns a worker group: the test ends it and checks, by PID, that no
worker outlives it. Prints the worker PIDs as one JSON line.

argv[1] == "with": idles inside a `with` block until signalled.
argv[1] == "leak": never closes the group and exits normally when stdin closes, so
only the atexit hook stands between its workers and a hang at exit.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time

from fedtrain.parallel import WorkerGroup

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the test asks where it hangs
    # Ctrl-C as in a terminal, also when the tests run in a background job (shells start
    # those with SIGINT ignored, which children inherit).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    group = WorkerGroup("_ddp_tasks:ToyTask", nproc=2)
    if sys.argv[1] == "leak":
        group.start()
        print(json.dumps(group.pids), flush=True)
        sys.stdin.read()
    else:
        with group:
            print(json.dumps(group.pids), flush=True)
            time.sleep(600)
