"""A TCP proxy on 127.0.0.1 that moves at most `rate` bytes per second each way: one
site's slow link, for tests of what the server does about it. The rate is the link's,
shared by all the connections through it (a site's parallel streams share its link),
or with `per_connection` each connection's own (as one TCP flow's share of a lossy, long
link: more flows move more). `up_rate`, when set, paces the site-to-server direction
instead; both may change while it runs (a link that degrades)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from runtime_support import Deployment

from fedtrain.runtime.demo import free_port

ROOT = Path(__file__).resolve().parents[2]

PIECE = 16 * 1024
#: What the slow site's link holds in flight per connection (`buffer_bytes`): about a
#: real link's window, not the megabytes loopback sockets grow to (the server would
#: count them as moved: a site probing parallel streams would look four times as fast).
LINK_BUFFER_BYTES = 64 * 1024
#: The segment size of the proxy's connections to the server (a WAN's MTU, 1500).
WAN_MSS = 1448
#: How far behind its schedule a connection may fall and still catch up (see `_pipe`).
SLACK_S = 0.05


class SlowLink:
    """Listens on `port` (127.0.0.1) and forwards to `target_port`, paced to `rate` B/s."""

    def __init__(
        self,
        target_port: int,
        rate: float,
        *,
        per_connection: bool = False,
        buffer_bytes: int | None = None,
    ) -> None:
        self.target_port, self.rate = target_port, rate
        self.per_connection = per_connection
        #: The receive buffer of the sockets the proxy reads from (None: the kernel's):
        #: on loopback nothing else stops a sender from filling megabytes of buffers
        #: ahead of the pace, which a real link's congestion window does.
        self.buffer_bytes = buffer_bytes
        self.up_rate: float | None = None
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        #: Per direction, when the link is free again (loop time): connections queue on it
        #: (each on its own with `per_connection`).
        self._free = {"up": 0.0, "down": 0.0}

    def __enter__(self) -> SlowLink:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", self.port), self._loop
        ).result(10)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def close(self) -> None:
        self.__exit__(None, None, None)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        # A WAN's segments (loopback's are 64 KiB): the server's send buffer grows with
        # its window in segments, and at loopback's size each connection's held
        # megabytes the server counted as sent: over 16-64 streams its rate estimate of
        # a 16 Mbit/s link read 37.5 Mbit/s, with these 24
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, WAN_MSS)
        if self.buffer_bytes is not None:
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes)
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes
            )
        try:
            await self._loop.sock_connect(upstream, ("127.0.0.1", self.target_port))
        except OSError:  # the server is gone: the site sees its connection close
            upstream.close()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        free = {"up": 0.0, "down": 0.0} if self.per_connection else self._free
        await asyncio.gather(
            self._pipe(reader, up_writer, "up", free),
            self._pipe(up_reader, writer, "down", free),
            return_exceptions=True,
        )

    def _rate(self, direction: str) -> float:
        return (self.up_rate if direction == "up" else None) or self.rate

    def _piece(self, direction: str) -> int:
        """At most ~10 ms of the link per piece (a packet at least), so that connections
        sharing a slow link interleave as packets would, instead of one waiting seconds
        behind another's 16 KiB."""
        return max(1500, min(PIECE, int(self._rate(direction) / 100)))

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
        free: dict[str, float],
    ) -> None:
        try:
            while data := await reader.read(self._piece(direction)):
                now = self._loop.time()
                rate = self._rate(direction)
                # (a connection late by the proxy's own delays catches up by SLACK_S: on
                # a busy machine one connection would use only part of the link)
                done = max(now - SLACK_S, free[direction]) + len(data) / rate
                free[direction] = done
                await asyncio.sleep(done - now)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@contextlib.contextmanager
def fast_and_slow(
    root: Path,
    task_options: dict[str, Any],
    rate: float,
    slow_site: dict[str, Any] | None = None,
    **server: Any,
) -> Iterator[tuple[Deployment, SlowLink]]:
    """A `FlatTask` deployment (TLS): sites fast-a and fast-b dial the server, site slow
    dials it through a `SlowLink` at `rate` (LINK_BUFFER_BYTES in flight), with
    `slow_site`'s site.toml keys; all started. The round needs 2 of the 3."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the sites and the server import benchmarks.flat_task
    with (
        Deployment(
            root,
            "benchmarks.flat_task:FlatTask",
            task_options=task_options,
            allowed_sites=["fast-a", "fast-b", "slow"],
            strategy={"min_fit_clients": 2, "min_available_clients": 3},
            **server,
        ) as dep,
        SlowLink(dep.port, rate=rate, buffer_bytes=LINK_BUFFER_BYTES) as link,
    ):
        dep.start_server()
        for name in ("fast-a", "fast-b"):
            dep.start_site(name, task_options=task_options)
        slow = dep.site_toml("slow", task_options=task_options, **(slow_site or {}))
        slow.write_text(slow.read_text().replace(f"127.0.0.1:{dep.port}", f"127.0.0.1:{link.port}"))
        dep.start_site("slow", slow)
        yield dep, link
