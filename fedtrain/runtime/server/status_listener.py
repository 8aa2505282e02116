"""Status answered from a thread of its own: the run directory's socket, the status port.

Why a second listener: the main gRPC server's event loop accepts new calls one at a
time, interleaved with every site's transfers; during a round with a thousand sites a
Status call waits seconds in that queue, and a probe that asks there could restart a
server for being busy. A `StatusListener` has threads and a gRPC server of its own,
which serves only the Status method of the Fedtrain service (any other method is
UNIMPLEMENTED there), so it answers in milliseconds however busy the rounds are.

Subclasses say where it listens and how: `LocalStatus` (`local_status.py`) on an
owner-only Unix socket in the run directory, where the file system decides who may
ask, with grpc's synchronous server (no second grpc.aio loop: it says why);
`StatusPort` (here) on a TCP address of its own (`status_address`), for operators and
probes on other hosts, with exactly the sites' port's security, on a grpc.aio loop of
its own (its challenges need one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    """Serves `service` from threads of its own once started; `stop()` ends it.

    The service's snapshot and health must be safe to call from those threads.
    Subclasses start a server (`_start`, which sets `_halt`) and say where it listens
    (`_bind`)."""

    thread_name = "fedtrain-status"

    def __init__(self, service: StatusService) -> None:
        self.service = service
        #: The bound TCP port (0 for a Unix socket) once started.
        self.port = 0
        #: Stops the started server within a grace (seconds); None when not running.
        self._halt: Callable[[float], None] | None = None

    def _bind(self, server: grpc.Server | grpc.aio.Server) -> int:
        """Add this listener's port to `server` (not yet started); the bound port."""
        raise NotImplementedError

    def _start(self) -> None:
        """Start the server (bound by `_bind`) and set `_halt` to stop it."""
        raise NotImplementedError

    def _release(self) -> None:
        """What to clean up once the server stopped (nothing by default)."""

    def stop(self, grace: float = 0.5) -> None:
        """Stop answering and clean up (idempotent)."""
        halt, self._halt = self._halt, None
        if halt is None:
            return
        halt(grace)
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
        self._server: grpc.aio.Server | None = None

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

    def _start(self) -> None:
        # grpc.aio, on a loop of its own: the challenge's timeout (`PeerCheck`) and up
        # to hundreds of unanswered challenges need coroutines, not threads.
        thread = LoopThread(self.thread_name)
        thread.start()
        self._halt = lambda grace: thread.stop(
            self._server.stop(grace) if self._server is not None else None, grace + 5
        )
        thread.run(self._listen(), 30)

    async def _listen(self) -> None:
        """On the listener's loop (a grpc.aio server belongs to the loop it is made on)."""
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((status_handler(self.service.method()),))
        self.port = self._bind(server)
        self._server = server
        await server.start()

    def _bind(self, server: grpc.Server | grpc.aio.Server) -> int:
        return rpc.add_port(server, self.address, self._credentials, key="status_address")


def status_handler(method: grpc.RpcMethodHandler) -> grpc.GenericRpcHandler:
    """A generic handler that serves only Status (any other method is UNIMPLEMENTED)."""
    return grpc.method_handlers_generic_handler(rpc.SERVICE, {"Status": method})
