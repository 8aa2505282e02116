"""Streams whose peer has not proved who it is yet: few at a time, and briefly.

The TLS handshake lets any client through (``peer_auth`` says why), so a stream that
waits for a peer's answer to the challenge holds one of the server's worker threads.
:class:`AdmissionGate` bounds how many such streams there are, per peer address and in
all, and for how long: a stream not answered within the deadline is cancelled. An
unauthenticated peer therefore cannot starve the sites' control streams and
transfers of threads, and a site that is refused for being late or one too many is
told so and retries with its usual backoff.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fedtrain.runtime.audit import peer_host

#: A peer must answer the challenge within this many seconds (a site does at once).
ANSWER_TIMEOUT_S = 10.0
#: Unanswered challenges one address may hold at a time.
MAX_PENDING_PER_ADDRESS = 4


@dataclass
class Refusal:
    """Why a peer is not admitted: `cause` (one word, for the audit log) and `reason`
    (sent to the peer: what is wrong and what to do), plus what is known of it."""

    cause: str
    reason: str
    site: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Slot:
    """One admission in progress: `granted` False means the gate was full; `expired`
    turns True if the deadline cancelled the stream."""

    granted: bool
    expired: bool = False


class AdmissionGate:
    """Counts the streams that wait for a peer's proof; see the module docstring."""

    def __init__(
        self,
        max_pending: int,
        *,
        per_address: int = MAX_PENDING_PER_ADDRESS,
        timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> None:
        self.max_pending = max_pending
        self.per_address = per_address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._by_address: Counter[str] = Counter()

    @contextmanager
    def pending(self, peer: str, cancel: Callable[[], None]) -> Iterator[Slot]:
        """Hold a slot while `peer` has not answered; `cancel` ends its stream at the
        deadline. The slot is not granted when the gate is full."""
        address = peer_host(peer)
        with self._lock:
            full = (
                sum(self._by_address.values()) >= self.max_pending
                or self._by_address[address] >= self.per_address
            )
            if not full:
                self._by_address[address] += 1
        if full:
            yield Slot(granted=False)
            return
        slot = Slot(granted=True)

        def expire() -> None:
            slot.expired = True
            cancel()

        timer = threading.Timer(self.timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            yield slot
        finally:
            timer.cancel()
            with self._lock:
                self._by_address[address] -= 1
                if self._by_address[address] <= 0:
                    del self._by_address[address]

    def __len__(self) -> int:
        with self._lock:
            return sum(self._by_address.values())
