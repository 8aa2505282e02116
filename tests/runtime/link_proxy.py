"""A TCP proxy on 127.0.0.1 that a test can pause: a link outage without a network.

Paused, it forwards nothing in either direction and closes nothing: each side's
sockets stay open and quiet, as when a router between site and server goes down (no
FIN, no RST; only timeouts can notice). `pause_after_up(n)` pauses it by itself once
`n` bytes have gone from the site to the server (`pause_after_down`: the other way),
so a test can cut a link in the middle of a transfer without racing it. New
connections made while it is paused wait until it resumes. `resume(stall_connections=
True)` leaves the connections made before silent for good, as TCP leaves connections
that were sending when the link went down (their retransmission timer backed off
during the outage), while new ones carry data at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading

BUFFER = 64 * 1024


class LinkProxy:
    """Forwards 127.0.0.1:`port` to `upstream` (host:port) until `close()`."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._bytes = {True: 0, False: 0}  # sent up (site to server), sent down
        self._pause_at: tuple[bool, int] | None = None
        self._closed = False
        self._ended = threading.Event()  # set by close()
        #: Connections are numbered as they are made; those below this stay silent.
        self._made = 0
        self._live_from = 0
        threading.Thread(target=self._accept, daemon=True).start()

    # -- what a test does ---------------------------------------------------------------
    def pause(self) -> None:
        self._flowing.clear()

    def resume(self, *, drop_connections: bool = False, stall_connections: bool = False) -> None:
        """End the outage; with `drop_connections` the connections made before it are
        gone (reset, as after a NAT or firewall forgot them), with `stall_connections`
        they stay silent: either way only new ones carry data."""
        if stall_connections:
            with self._lock:
                self._live_from = self._made
        if drop_connections:
            with self._lock:
                sockets, self._sockets = self._sockets, []
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
        self._flowing.set()

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    def pause_after_up(self, more_bytes: int) -> None:
        """Pause once `more_bytes` more bytes went from the site to the server."""
        with self._lock:
            self._pause_at = (True, self._bytes[True] + more_bytes)

    def pause_after_down(self, more_bytes: int) -> None:
        """Pause once `more_bytes` more bytes went from the server to the site."""
        with self._lock:
            self._pause_at = (False, self._bytes[False] + more_bytes)

    def close(self) -> None:
        self._closed = True
        self._ended.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    # -- forwarding ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._flowing.wait()  # an outage: the connection attempt goes nowhere until it ends
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
            number, self._made = self._made, self._made + 1
        for src, dst, up in ((client, server, True), (server, client, False)):
            threading.Thread(target=self._pump, args=(src, dst, up, number), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, number: int) -> None:
        try:
            while True:
                self._wait_flowing(number)
                data = src.recv(BUFFER)
                if not data:
                    break
                while data:
                    self._wait_flowing(number)
                    if self._closed:
                        return
                    data = self._forward(dst, data, up)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _wait_flowing(self, number: int) -> None:
        """Until the link carries connection `number`'s data (never, once it stalled)."""
        self._flowing.wait()
        if number < self._live_from:
            self._ended.wait()

    def _forward(self, dst: socket.socket, data: bytes, up: bool) -> bytes:
        """Send `data` (up to a pending pause point); what is left to send after it."""
        send, rest = data, b""
        with self._lock:
            if self._pause_at is not None and self._pause_at[0] == up:
                room = self._pause_at[1] - self._bytes[up]
                if room <= len(data):
                    send, rest = data[:room], data[room:]
                    self._pause_at = None
                    self._flowing.clear()
            self._bytes[up] += len(send)
        dst.sendall(send)
        return rest
