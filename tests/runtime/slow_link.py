"""A TCP proxy on 127.0.0.1 that moves at most `rate` bytes per second each way: one
site's slow link, for tests of what the server does about it. The rate is the link's,
shared by all the connections through it (a site's parallel streams share its link)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

from fedtrain.runtime.demo import free_port

PIECE = 16 * 1024


class SlowLink:
    """Listens on `port` (127.0.0.1) and forwards to `target_port`, paced to `rate` B/s."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.target_port, self.rate = target_port, rate
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        #: Per direction, when the link is free again (loop time): connections queue on it.
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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(
            self._pipe(reader, up_writer, "up"),
            self._pipe(up_reader, writer, "down"),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        try:
            while data := await reader.read(PIECE):
                now = self._loop.time()
                done = max(now, self._free[direction]) + len(data) / self.rate
                self._free[direction] = done
                await asyncio.sleep(done - now)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
