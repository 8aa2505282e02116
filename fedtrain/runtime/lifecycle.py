"""Starting and stopping things cleanly: signal routing and child process groups.

Whoever starts a server or a process owns its shutdown. `stop_on_signals` turns
SIGTERM/SIGINT into a call to a stop function (so daemons leave cleanly instead of
dying mid-write), and `ProcessGroup` starts children in their own sessions and, on
exit (normal, exception or Ctrl-C), terminates each whole process group and waits for
it, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Call `stop()` on SIGTERM/SIGINT while inside the block (main thread only).

    The handler only writes a byte to a pipe; a helper thread blocked on the pipe makes
    the call. `stop` takes locks, and a handler that took one the interrupted main thread
    already held would deadlock. Even an `Event.set` in the handler can: a second signal
    (process supervisors often send SIGTERM twice) interrupts the first handler inside
    the event's lock, and the second `set` waits for that lock forever. A pipe write
    takes no lock. Outside the main thread (e.g. in tests) handlers cannot be installed:
    a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)  # a burst of signals must never block the handler
    leaving = False

    def handler(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake-up is pending
            os.write(wake_write, b"\0")

    def relay() -> None:
        os.read(wake_read, 1)
        if not leaving:
            log.info("received a stop signal; stopping")
            stop()

    helper = threading.Thread(target=relay, name="fedtrain-signals", daemon=True)
    helper.start()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        leaving = True
        handler(0, None)
        helper.join()
        os.close(wake_read)
        os.close(wake_write)


class ProcessGroup:
    """Child processes, each in its own session; all are terminated on close."""

    def __init__(self, term_timeout_s: float = 5.0) -> None:
        self.term_timeout_s = term_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        #: How each child was started, so `restart` can start it again.
        self._again: dict[str, Callable[[], subprocess.Popen[bytes]]] = {}
        # `restart` may run on a watcher thread while `close` runs: the lock and the
        # flag make sure nothing is started once closing began.
        self._lock = threading.Lock()
        self._closing = False

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        log_path: Path | None = None,
        stdout_pipe: bool = False,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `args` as its own process group; output goes to `log_path` (or a pipe)."""
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was started already")
        self._again[name] = functools.partial(
            self.start,
            name,
            list(args),
            log_path=log_path,
            stdout_pipe=stdout_pipe,
            env=env,
            cwd=cwd,
        )
        sink: IO[bytes] | int = subprocess.DEVNULL
        if log_path is not None:
            log_file = log_path.open("ab")
            self._logs.append(log_file)
            sink = log_file
        proc = subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else sink,
            stderr=sink,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: killpg reaches its children too
        )
        self.procs[name] = proc
        log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(args))
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        """Signal one child's process group, wait, escalate to SIGKILL; returns its exit code."""
        proc = self.procs[name]
        if proc.poll() is None:
            _killpg(proc, sig)
            try:
                proc.wait(self.term_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored signal %d; killing it", name, proc.pid, sig)
                _killpg(proc, signal.SIGKILL)
                proc.wait()
        # The leader is gone, but children it started may still hold the group.
        _killpg(proc, signal.SIGKILL)
        return proc.returncode

    def restart(self, name: str) -> subprocess.Popen[bytes] | None:
        """Start an exited child again, as it was started (output appended to its log);
        None once the group is closing. What a service manager's Restart= does."""
        with self._lock:
            if self._closing:
                return None
            old = self.procs.pop(name)
            if old.poll() is None:
                self.procs[name] = old
                raise ValueError(f"{name!r} (pid {old.pid}) is still running")
            return self._again[name]()

    def send_signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Send a signal to one child's process group without waiting (safe from any thread)."""
        proc = self.procs[name]
        if proc.poll() is None:
            _killpg(proc, sig)

    def close(self) -> None:
        """Terminate every child (SIGTERM first, so they leave cleanly), then wait for all."""
        with self._lock:
            self._closing = True
        for proc in self.procs.values():
            if proc.poll() is None:
                _killpg(proc, signal.SIGTERM)
        for name, proc in self.procs.items():
            self.stop(name)
            if proc.stdout is not None:
                proc.stdout.close()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
