"""Status answered from a thread of its own: the run directory's socket, the status port.

Why a second listener: the main gRPC server's event loop accepts new calls one at a
time, interleaved with every site's transfers; during a round with a thousand sites a
Status call waits seconds in that queue, and a probe that asks there could restart a
server for being busy. A `StatusListener` has its own thread, event loop and gRPC
server, which serves only the Status method of the Fedtrain service (any other method
is UNIMPLEMENTED there), so it answers in milliseconds however busy the rounds are.

Subclasses say where it listens: `LocalStatus` (`local_status.py`) on an owner-only
Unix socket in the run directory, where the file system decides who may ask;
`StatusPort` (here) on a TCP address of its own (`status_address`), for operators and
probes on other hosts, with exactly the sites' port's security.
"""

from __future__ import annotations

import logging

import grpc

from fedtrain.runtime import rpc, wire
from fedtrain.runtime.loop_thread import LoopThread
from fedtrain.runtime.server.status_service import StatusService

log = logging.getLogger(__name__)

#: Another process on the same port is an error, not a partner (gRPC's default
#: SO_REUSEPORT would let a second listener share the port and half the calls); and,
#: as on the sites' port, idle peers cannot hold file descriptors, nor one connection
#: thousands of handlers.
OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_connection_idle_ms", int(wire.IDLE_CONNECTION_S * 1000)),
    ("grpc.max_concurrent_streams", wire.STREAMS_PER_CONNECTION),
]


class StatusListener:
    """Serves `service` from a thread of its own once started; `stop()` ends it.

    The service's snapshot and health must be safe to call from that thread."""

    thread_name = "fedtrain-status"

    def __init__(self, service: StatusService) -> None:
        self.service = service
        #: The bound TCP port (0 for a Unix socket) once started.
        self.port = 0
        self._thread: LoopThread | None = None
        self._server: grpc.aio.Server | None = None

    def _bind(self, server: grpc.aio.Server) -> int:
        """Add this listener's port to `server` (not yet started); the bound port."""
        raise NotImplementedError

    def _release(self) -> None:
        """What to clean up once the server stopped (nothing by default)."""

    def _start(self) -> None:
        self._thread = LoopThread(self.thread_name)
        self._thread.start()
        self.port = self._thread.run(self._listen(), 30)

    async def _listen(self) -> int:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(rpc.SERVICE, {"Status": self.service.method()}),)
        )
        port = self._bind(server)
        self._server = server
        await server.start()
        return port

    def stop(self, grace: float = 0.5) -> None:
        """Stop answering and clean up (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        server = self._server
        thread.stop(server.stop(grace) if server is not None else None, grace + 5)
        self._release()


class StatusPort(StatusListener):
    """Status on `address` (host:port): TLS with `credentials`, the sites' port's own
    (None only when the whole server runs --insecure). The service's `PeerCheck` makes
    the same challenge and proof check as the sites' port, and audits refusals."""

    thread_name = "fedtrain-status-port"

    def __init__(
        self, address: str, service: StatusService, credentials: grpc.ServerCredentials | None
    ) -> None:
        super().__init__(service)
        self.address = address
        self._credentials = credentials

    def start(self) -> int:
        """Listen; the bound port. An operator who asked for a status port expects it:
        one that cannot be opened is a ConfigError (the server refuses to start)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        log.info(
            "answering Status on %s (port %d, %s) from a thread of its own",
            self.address,
            self.port,
            "insecure" if self._credentials is None else "TLS, callers prove a certificate",
        )
        return self.port

    def _bind(self, server: grpc.aio.Server) -> int:
        return rpc.add_port(server, self.address, self._credentials, key="status_address")
