"""Status on a Unix socket in the run directory (`status_socket`), answered from a
thread of its own (`status_listener.py` says why), so `fedtrain status --run-dir
RUN_DIR` and a liveness probe on the server's host answer in milliseconds however busy
the rounds are.

Who may ask is decided by the file system: the socket is owner-only, beside the run
directory's checkpoints and audit log (the same trust boundary), so it needs no TLS and
no certificate. Remote operators ask on the status port (`status_address`) or the
sites' port, over mutual TLS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from concurrent import futures
from pathlib import Path

import grpc

from fedtrain.errors import ConfigError
from fedtrain.runtime.server.status_listener import OPTIONS, StatusListener, status_handler
from fedtrain.runtime.server.status_service import StatusService

log = logging.getLogger(__name__)

SOCKET_NAME = "status.sock"
#: Threads answering Status on the socket: its callers are the operator's `fedtrain
#: status` and a liveness probe, each a call of milliseconds (a caller that opens a
#: call and never asks holds one; only the server's own user can reach the socket).
HANDLER_THREADS = 4
#: sun_path holds 108 bytes with its terminating NUL; a longer path cannot be bound.
MAX_SOCKET_PATH = 107


def socket_address(run_dir: Path) -> str:
    """The gRPC address of `run_dir`'s status socket (what `fedtrain status --run-dir` dials)."""
    return f"unix:{Path(run_dir).resolve() / SOCKET_NAME}"


def trusted_socket(run_dir: Path) -> None:
    """Refuse to ask a socket that someone other than the run directory's owner put
    there (a run dir others may write to, e.g. under /tmp, could hold a planted one
    that answers with a made-up state)."""
    run_dir = Path(run_dir).resolve()
    try:
        owner, sock = run_dir.stat().st_uid, (run_dir / SOCKET_NAME).lstat()
    except FileNotFoundError:
        return  # nothing to trust or distrust: the call says nobody answers
    if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != owner:
        raise ConfigError(
            f"{run_dir / SOCKET_NAME} is not a socket owned by the run directory's owner "
            f"(uid {owner}); not asking it. Ask over the gRPC port with --server instead"
        )


class LocalStatus(StatusListener):
    """Serves `service` (which checks no peer) on `RUN_DIR/status.sock`."""

    thread_name = "fedtrain-local-status"

    def __init__(self, run_dir: Path, service: StatusService) -> None:
        super().__init__(service)
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / SOCKET_NAME
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket
        self._server: grpc.Server | None = None

    def start(self) -> bool:
        """Listen; False, with a warning saying why, when it cannot. The socket is a
        convenience beside the gRPC port: failing to open it never stops a server."""
        why = _unusable(self.path)
        if why is None:
            try:
                self._start()
                return True
            except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError on bind
                self.stop()
                why = f"it could not be opened ({exc})"
        log.warning("no local status socket at %s: %s", self.path, why)
        return False

    def _start(self) -> None:
        # grpc's synchronous server, with no event loop of its own: every loop that uses
        # grpc.aio in a process is woken for the process's gRPC completions (grpc.aio has
        # one poller, and a loop passes on what another loop's calls need), so a loop here
        # carried a share of the rounds' completions (benchmarks/RESULTS.md). The socket
        # needs no challenge (the file system checks the caller), so threads do.
        server = grpc.server(
            futures.ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix=self.thread_name),
            handlers=(status_handler(self.service.method(blocking=True)),),
            options=OPTIONS,
        )
        self._server = server
        self._halt = lambda grace: server.stop(grace).wait(grace + 5)
        self._bind(server)
        server.start()

    def _bind(self, server: grpc.Server | grpc.aio.Server) -> int:
        # Bound in a private (0700) directory, made owner-only, then moved into place in
        # one step: no moment in which another user of the host could connect, and no
        # process-wide umask change racing with other threads' files.
        private = Path(tempfile.mkdtemp(prefix=".status-", dir=self.run_dir))
        try:
            bound = private / "s"
            server.add_insecure_port(f"unix:{bound}")  # raises RuntimeError if it cannot
            os.chmod(bound, 0o600)
            os.replace(bound, self.path)  # atomically replaces a dead server's socket
        finally:
            shutil.rmtree(private, ignore_errors=True)
        info = self.path.lstat()
        self._bound = (info.st_dev, info.st_ino)
        return 0

    def _release(self) -> None:
        """Remove our socket, never another server's."""
        with contextlib.suppress(OSError):
            info = self.path.lstat()
            # A successor started on the same run dir (a replacement pod while this one
            # terminates) has its own socket there now: leave it.
            if (info.st_dev, info.st_ino) == self._bound:
                self.path.unlink()


def _unusable(path: Path) -> str | None:
    """Why a socket cannot be put at `path` (None: it can; a dead server's is replaced)."""
    if len(str(path.parent / ".status-XXXXXXXX" / "s").encode()) > MAX_SOCKET_PATH:
        return (
            f"the run directory's path is longer than a Unix socket path may be "
            f"({MAX_SOCKET_PATH} bytes); use a shorter run_dir for `fedtrain status --run-dir`"
        )
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return "something that is not a socket is there; it was left in place (move it away)"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return None  # nobody listens: a socket a killed server left behind
    finally:
        probe.close()
    return "another server answers on it (a second server on the same run_dir?)"
