"""Streams whose peer has not proved who it is yet: few at a time, and briefly.

The TLS handshake lets any client through (``peer_auth`` says why), so a stream that
waits for a peer's answer to the challenge holds a coroutine, a socket and a little
memory on the server. :class:`AdmissionGate` bounds how many such streams there are,
per peer address and in all; the servicer gives each `timeout_s` to answer. An
unauthenticated peer therefore cannot pile up streams, and a site that is refused for
being late or one too many is told so and retries with its usual backoff.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fedtrain.runtime.server.audit import peer_host

#: A peer must answer the challenge within this many seconds (a site does at once).
ANSWER_TIMEOUT_S = 10.0
#: Unanswered challenges one address may hold at a time (a hospital's sites behind one
#: NAT share an address; a peer that floods from one address is held to this).
MAX_PENDING_PER_ADDRESS = 16
#: Unanswered challenges in all (a coroutine each: joins of thousands of sites at once
#: queue here; beyond it a join is refused as busy and the site retries).
MAX_PENDING = 512


@dataclass
class Refusal:
    """Why a peer is not admitted: `cause` (one word, for the audit log) and `reason`
    (sent to the peer: what is wrong and what to do), plus what is known of it."""

    cause: str
    reason: str
    site: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    #: > 0 for a temporary refusal (capacity): the site waits at least this long.
    retry_after_s: float = 0.0


@dataclass
class Slot:
    """One admission in progress: `granted` False means the gate was full."""

    granted: bool


class AdmissionGate:
    """Counts the streams that wait for a peer's proof; see the module docstring.

    Used on the server's event loop only, so it needs no lock."""

    def __init__(
        self,
        max_pending: int = MAX_PENDING,
        *,
        per_address: int = MAX_PENDING_PER_ADDRESS,
        timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> None:
        self.max_pending = max_pending
        self.per_address = per_address
        self.timeout_s = timeout_s
        self._by_address: Counter[str] = Counter()
        self._pending = 0

    @contextmanager
    def pending(self, peer: str) -> Iterator[Slot]:
        """Hold a slot while `peer` has not answered; not granted when the gate is full."""
        address = peer_host(peer)
        if self._pending >= self.max_pending or self._by_address[address] >= self.per_address:
            yield Slot(granted=False)
            return
        self._by_address[address] += 1
        self._pending += 1
        try:
            yield Slot(granted=True)
        finally:
            self._pending -= 1
            self._by_address[address] -= 1
            if self._by_address[address] <= 0:
                del self._by_address[address]

    def __len__(self) -> int:
        return self._pending
