"""`max_transfers` slots, one per transfer however many parallel streams it uses.

A site may spread a download or an upload over several streams (`transfer_streams`
in site.toml: separate connections, so that a lossy long link carries K congestion
windows instead of one). The slots bound what the server moves at once for its
memory and files (an upload's journal, a download's encoding), and those are per
transfer, not per stream: the streams of one transfer share its slot, so a site with
K streams takes the same share of scarce slots as a site with one, and its streams
start together once the slot is granted (one stream each would make the others wait
behind other sites, the transfer then as slow as its last range).

On the server's event loop only (no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_V = TypeVar("_V")


@dataclass(eq=False)
class _Shared(Generic[_V]):
    acquired: asyncio.Task[bool]
    users: int = 0
    value: list[_V] = field(default_factory=list)  # [] until the slot is granted


class TransferSlots(Generic[_V]):
    """Slots shared by the streams of one transfer (named by a key)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._semaphore: asyncio.Semaphore | None = None
        self._shared: dict[Hashable, _Shared[_V]] = {}
        self._waiting = 0  # transfers whose slot is not granted yet

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """Created on the server's loop at first use."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.limit)
        return self._semaphore

    def __len__(self) -> int:
        """Transfers holding or waiting for a slot."""
        return len(self._shared)

    @property
    def saturated(self) -> bool:
        """Every slot is held or waited for (safe to read from another thread)."""
        return len(self._shared) >= self.limit

    @property
    def waiting(self) -> int:
        """Transfers waiting for a slot while none is free (0 when one is free: the next
        one takes it at once)."""
        return self._waiting if self.semaphore.locked() else 0

    @contextlib.asynccontextmanager
    async def hold(
        self, key: Hashable, opened: Callable[[], _V], closed: Callable[[_V], None]
    ) -> AsyncIterator[_V]:
        """The slot of transfer `key` while the caller's stream runs: the first stream
        of a transfer waits for a free slot, the others for the same grant. `opened()`
        makes what the streams share once the slot is granted (a link meter);
        `closed(it)` ends it when the last stream leaves, and the slot is freed."""
        shared = self._shared.get(key)
        if shared is None:
            shared = self._shared[key] = _Shared(asyncio.ensure_future(self.semaphore.acquire()))
            self._waiting += 1
            shared.acquired.add_done_callback(self._waited)
        shared.users += 1
        try:
            await asyncio.shield(shared.acquired)
            if not shared.value:
                shared.value.append(opened())
            yield shared.value[0]
        finally:
            shared.users -= 1
            if shared.users == 0 and self._shared.get(key) is shared:  # not `free`d
                del self._shared[key]
                self._give_back(shared, closed)

    def free(self, value: _V, closed: Callable[[_V], None]) -> bool:
        """Give back the slot of the transfer whose streams share `value` now, before its
        streams have unwound (the server cut them: their ending may wait on the site);
        a stream of the same transfer that comes later waits for a slot again. False:
        no transfer holds `value` (it ended meanwhile)."""
        for key, shared in self._shared.items():
            if shared.value and shared.value[0] is value:
                del self._shared[key]
                self._give_back(shared, closed)
                return True
        return False

    def _waited(self, _: asyncio.Future[bool]) -> None:
        self._waiting -= 1  # granted, or the wait was given up

    def _give_back(self, shared: _Shared[_V], closed: Callable[[_V], None]) -> None:
        if shared.acquired.cancel():  # still waiting: the semaphore takes the wait back
            return
        try:
            if shared.value:
                closed(shared.value[0])
        finally:
            if not shared.acquired.cancelled() and shared.acquired.exception() is None:
                self.semaphore.release()
