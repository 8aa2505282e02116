"""Status on a Unix socket in the run directory, answered from its own thread.

Why a second listener: the main gRPC server's event loop accepts new calls one at a
time, interleaved with every site's transfers; during a round with a thousand sites a
Status call waits seconds in that queue, and a Kubernetes liveness probe that asks
there could restart a server for being busy. This listener has its own thread, event
loop and gRPC server, so `fedtrain status --run-dir RUN_DIR` answers in milliseconds
however busy the rounds are.

Who may ask is decided by the file system: the socket is owner-only, beside the run
directory's checkpoints and audit log (the same trust boundary), so it needs no TLS and
no certificate. Remote operators keep asking on the main port, over mutual TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from fedtrain.observability.status import ServerState
from fedtrain.runtime import status, wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb

log = logging.getLogger(__name__)

SOCKET_NAME = "status.sock"
#: sun_path holds 108 bytes with its terminating NUL; a longer path cannot be bound.
MAX_SOCKET_PATH = 107


def socket_address(run_dir: Path) -> str:
    """The gRPC address of `run_dir`'s status socket (what `fedtrain status --run-dir` dials)."""
    return f"unix:{Path(run_dir).resolve() / SOCKET_NAME}"


class LocalStatus:
    """Serves the Status RPC on `RUN_DIR/status.sock` from a thread of its own.

    `snapshot(page)` must be safe to call from that thread: `server_state` is (it reads
    whole-replaced fields and the registry under its lock).
    """

    def __init__(self, run_dir: Path, snapshot: Callable[[status.SitePage], ServerState]) -> None:
        self.path = Path(run_dir).resolve() / SOCKET_NAME
        self._snapshot = snapshot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None

    def start(self) -> bool:
        """Listen; False (logged) when the path is too long for a Unix socket."""
        if len(str(self.path).encode()) > MAX_SOCKET_PATH:
            log.warning(
                "no local status socket: %s is longer than a Unix socket path may be (%d "
                "bytes); use a shorter run_dir for `fedtrain status --run-dir`",
                self.path,
                MAX_SOCKET_PATH,
            )
            return False
        _remove_stale(self.path)
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name="fedtrain-local-status", daemon=True
        )
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), loop).result(30)
        except BaseException:
            self.stop()
            raise
        return True

    async def _listen(self) -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(
            self._status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusMessage.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, {"Status": handler}),)
        )
        if not server.add_insecure_port(f"unix:{self.path}"):
            raise OSError(f"cannot listen on the status socket {self.path}")
        # Owner-only. Connecting needs write permission on the socket, which the usual
        # umask (022) already withholds from others; a process-wide umask change
        # instead would race with every other thread creating files.
        os.chmod(self.path, 0o600)
        await server.start()
        self._server = server

    async def _status(
        self, requests: AsyncIterator[pb.StatusRequest], context: grpc.aio.ServicerContext
    ) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        page = status.SitePage(first.sites_offset, first.max_sites or status.DEFAULT_PAGE)
        state = self._snapshot(page)
        await context.write(pb.StatusMessage(reply=status.to_proto(state)))

    def stop(self, grace: float = 0.5) -> None:
        """Stop listening and remove the socket (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        server = self._server
        if server is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace), loop).result(grace + 5)
            except Exception as exc:  # pragma: no cover - a call stuck past the grace
                log.warning("the local status server did not stop cleanly: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=grace + 5)
        if not loop.is_running():
            loop.close()
        _remove_stale(self.path)


def _remove_stale(path: Path) -> None:
    """Remove a socket left by a server that was killed; refuse to touch anything else."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket; move it away from the run directory")
    path.unlink()
