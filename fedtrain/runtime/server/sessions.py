"""The sites connected right now: one session per live control stream.

A session owns the outbox its control stream drains, so the coordinator *pushes* an
instruction by putting it there; nothing polls. The outbox is an asyncio queue on the
server's event loop (a site costs a coroutine, not a thread); `Session.send` may be
called from any thread. Membership changes notify a condition the coordinator waits
on, and leave listeners turn a vanished site into a dropout of the round in progress.
A site whose link failed is first *detached* (kept, with its outbox, for the outage
grace) and may `rejoin` its session from a new connection.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import resource
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fedtrain.runtime import wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.strategy import RoundConfig

log = logging.getLogger(__name__)

LeaveListener = Callable[["Session", str], None]
JoinListener = Callable[["Session"], None]


def new_session_token() -> str:
    """An unguessable token binding bulk RPCs to a control session.

    It is a credential (without TLS it is all that stops a peer from uploading in a
    site's name), hence `secrets` rather than a seeded generator.
    """
    return secrets.token_hex(16)


#: File descriptors kept free of site connections: logs, the audit log, checkpoints,
#: gRPC's own, the metrics endpoint (each transfer in flight may add a journal file).
FILES_RESERVED = 64


@dataclass(eq=False)
class Session:
    """One site's live control stream."""

    site: str
    peer: str
    token: str = field(default_factory=new_session_token)
    joined_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    #: How long the site may stay silent before it is disconnected: its heartbeat
    #: interval grows with the federation's size (see `servicer.heartbeat_interval`).
    timeout_s: float = 30.0
    #: The heartbeat interval the site was told (Welcome, then Pace as sites join).
    heartbeat_interval_s: float = 5.0
    closed: bool = False
    #: The site said it is leaving (Heartbeat.leaving): the end of its stream is a
    #: leave, whatever silence came before it.
    leaving: bool = False
    #: The site said it ends its stream to rejoin on a new connection at once
    #: (Heartbeat.reconnecting): the end of its stream is an outage, kept for the grace.
    reconnecting: bool = False
    #: With TLS: the site's certificate (PEM) whose key proved this session at join.
    certificate: bytes = b""
    #: What the site said it can do when it joined (e.g. `evaluate`: it holds a
    #: held-out set and answers EVALUATE instructions).
    capabilities: frozenset[str] = frozenset()
    #: When its control stream broke or went silent (an outage, presumably): the site
    #: stays in its round until `heartbeat.grace_s` later, and may rejoin meanwhile
    #: with its token (Join.resume_token). None while a control stream serves it.
    detached_at: float | None = None
    #: Seconds this session spent in outages it came back from (from its last message
    #: to its rejoin): a per-site deadline is not charged for them (`site_deadlines.py`).
    outage_s: float = 0.0
    #: The handler task of the control stream that serves it (cancelled when a rejoin
    #: takes over, or when it is detached).
    handler: Any = field(default=None, repr=False)
    #: Handler tasks of its downloads in progress (cancelled when it is detached).
    streams: set[Any] = field(default_factory=set, repr=False)
    #: Its downloads the server cut for idleness, with their streams whose end (the
    #: status, behind the bytes already on their way) the site has not read yet.
    unread_cuts: Counter[Any] = field(default_factory=Counter, repr=False)
    #: Upload bytes received over this session (what its link moved: `links.py`).
    bytes_received: int = 0
    #: Its transfers waiting for one of the server's `max_transfers` slots (the wait is
    #: the server's, never held against the site's deadline).
    queued: int = 0
    #: Further connections (peers) that proved this session's certificate and carry its
    #: parallel streams (Join.attach_to).
    connections: set[str] = field(default_factory=set, repr=False)
    _outbox: asyncio.Queue[pb.ServerMessage | None] | None = field(default=None, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)

    def open_outbox(self) -> None:
        """Bind the outbox to the running event loop (the control stream that drains it).
        A rejoined session keeps its outbox: what was queued meanwhile is sent on the new
        stream."""
        self._loop = asyncio.get_running_loop()
        if self._outbox is None:
            self._outbox = asyncio.Queue()

    def send(self, message: pb.ServerMessage | None) -> None:
        """Queue a message for the site, from any thread; its control stream sends it at
        once. None ends the stream. A session without an outbox (never streamed) drops it."""
        loop, outbox = self._loop, self._outbox
        if loop is None or outbox is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            loop.call_soon_threadsafe(outbox.put_nowait, message)

    async def next_message(self) -> pb.ServerMessage | None:
        """The next message to send (on the loop); None when the session ended."""
        assert self._outbox is not None, "open_outbox() first"
        return await self._outbox.get()

    def touch(self) -> None:
        self.last_seen = time.monotonic()


def summarize_sites(names: Iterable[str], limit: int = 10) -> str:
    """Site names for a log line: all of a few, the first `limit` and a count of many
    (a round of thousands must not write a line of thousands of names)."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def instruct(
    session: Session,
    server_round: int,
    model_version: str,
    config: RoundConfig,
    deadline_unix: float,
    *,
    secagg: bool = False,
    kind: pb.InstructionKind = pb.TRAIN,
    own_upload_connection: bool = False,
) -> None:
    """Push an instruction (TRAIN, or EVALUATE) onto the site's control stream."""
    instruction = pb.Instruction(
        round=server_round,
        kind=kind,
        model_version=model_version,
        deadline_unix=deadline_unix,
        secagg=secagg,
        own_upload_connection=own_upload_connection,
    )
    wire.config_to_proto(config, instruction.config)
    session.send(pb.ServerMessage(instruction=instruction))


def own_upload_room(config: ServerConfig, connected: int) -> int:
    """How many training sites may send their update on a connection of their own now
    (`transfers.own_upload_connection_sites`: 0 never, else from that many sites
    `connected` on): as many as the file limit has room for a second connection (one
    waiting for a transfer slot holds it too). The rest send on their control
    connection, so a round with more sites than that room still gets most of its
    updates on connections that close after them."""
    if not 0 < config.transfers.own_upload_connection_sites <= connected:
        return 0
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if files == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(0, files - connected - FILES_RESERVED - config.max_transfers)


class AtCapacity(Exception):
    """The registry holds as many sites as the server admits."""


class SessionRegistry:
    """Sessions by site and by token; thread-safe, with a condition for membership changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._by_site: dict[str, Session] = {}
        #: The names in `_by_site`, sorted: a page of them costs O(page) (`listed`), not
        #: a sort of every name per Status call (2.3 ms at 10,000 sites, per call).
        self._names: list[str] = []
        self._by_token: dict[str, Session] = {}
        self._by_peer: dict[str, Session] = {}  # connection (ip:port) -> its session
        self._by_connection: dict[str, Session] = {}  # a parallel stream's connection
        self._listeners: list[LeaveListener] = []
        self._join_listeners: list[JoinListener] = []
        self._stopped = False

    def on_leave(self, listener: LeaveListener) -> None:
        self._listeners.append(listener)

    def on_join(self, listener: JoinListener) -> None:
        """Call `listener(session)` after each new session is registered (outside the lock)."""
        self._join_listeners.append(listener)

    def add(self, session: Session, capacity: int | None = None) -> Session | None:
        """Register a new session; returns the session of the same site it replaced.

        A site that reconnects before its old stream was noticed dead replaces it; the
        caller must `remove` the replaced one (which ends its stream). With `capacity`,
        a new site is refused (`AtCapacity`) when that many are registered: checked
        under the lock, so joins admitted at the same time cannot overfill the server.
        """
        with self._lock:
            old = self._by_site.get(session.site)
            if capacity is not None and old is None and len(self._by_site) >= capacity:
                raise AtCapacity(capacity)
            self._by_site[session.site] = session
            if old is None:
                bisect.insort(self._names, session.site)
            self._by_token[session.token] = session
            self._by_peer[session.peer] = session
            self.changed.notify_all()
        for listener in self._join_listeners:
            listener(session)
        return old

    def remove(self, session: Session, reason: str) -> bool:
        """End a session (idempotent). Listeners run outside the lock; True if it was live."""
        with self._lock:
            if session.closed:
                return False
            session.closed = True
            self._by_token.pop(session.token, None)
            if self._by_site.get(session.site) is session:
                del self._by_site[session.site]
                del self._names[bisect.bisect_left(self._names, session.site)]
            if self._by_peer.get(session.peer) is session:
                del self._by_peer[session.peer]
            for peer in session.connections:
                self._by_connection.pop(peer, None)
            session.connections.clear()
            self.changed.notify_all()
        session.send(None)  # ends the control stream's send loop
        for listener in self._listeners:
            listener(session, reason)
        return True

    def detach(self, session: Session) -> bool:
        """Keep `session` (and its round) while its site is away; True if it was attached.
        Its connection no longer counts as its own."""
        with self._lock:
            if session.closed or session.detached_at is not None:
                return False
            session.detached_at = time.monotonic()
            if self._by_peer.get(session.peer) is session:
                del self._by_peer[session.peer]
            self.changed.notify_all()
            return True

    def rejoin(self, token: str, site: str, certificate: bytes, peer: str) -> Session | None:
        """The live session `token` names, now served on connection `peer`, if it is
        `site`'s (with the same certificate); else None (the site starts a new one)."""
        with self._lock:
            session = self._by_token.get(token)
            if session is None or session.closed:
                return None
            if session.site != site or session.certificate != certificate:
                return None
            if self._by_peer.get(session.peer) is session:
                del self._by_peer[session.peer]
            quiet_since = min(session.last_seen, session.detached_at or session.last_seen)
            session.outage_s += time.monotonic() - quiet_since
            session.peer, session.detached_at = peer, None
            session.leaving = session.reconnecting = False
            session.touch()
            self._by_peer[peer] = session
            self.changed.notify_all()
            return session

    def away(self, grace_s: float) -> list[Session]:
        """Detached sessions whose site has not rejoined within `grace_s`."""
        now = time.monotonic()
        with self._lock:
            return [
                s
                for s in self._by_site.values()
                if s.detached_at is not None and now - s.detached_at > grace_s
            ]

    def by_token(self, token: str) -> Session | None:
        with self._lock:
            return self._by_token.get(token)

    def by_peer(self, peer: str) -> Session | None:
        """The live session whose control stream came over the connection `peer`, or
        whose parallel streams it carries (`add_connection`)."""
        with self._lock:
            return self._by_peer.get(peer) or self._by_connection.get(peer)

    def add_connection(self, session: Session, peer: str) -> bool:
        """Connection `peer` carries `session`'s parallel streams; False if the session
        has ended."""
        with self._lock:
            if session.closed:
                return False
            session.connections.add(peer)
            self._by_connection[peer] = session
            return True

    def drop_connection(self, session: Session, peer: str) -> None:
        with self._lock:
            session.connections.discard(peer)
            if self._by_connection.get(peer) is session:
                del self._by_connection[peer]

    def get(self, site: str) -> Session | None:
        with self._lock:
            return self._by_site.get(site)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._by_site.values())

    def listed(self, offset: int, limit: int | None) -> tuple[list[Session], int]:
        """`limit` sessions (None: all) from `offset` in the order of their site names,
        and how many there are in all."""
        with self._lock:
            end = None if limit is None else offset + limit
            return [self._by_site[name] for name in self._names[offset:end]], len(self._names)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_site)

    def _attached(self) -> list[str]:
        return [name for name, s in self._by_site.items() if s.detached_at is None]

    def wait_for(self, count: int) -> list[str] | None:
        """Block until at least `count` sites are connected (not away in an outage);
        their names, or None if stopped."""
        with self._lock:
            while len(self._attached()) < count and not self._stopped:
                self.changed.wait()
            return None if self._stopped else sorted(self._attached())

    def wait_for_change(self) -> None:
        """Block until a site joins or leaves (or the registry stops)."""
        with self._lock:
            if not self._stopped:
                self.changed.wait()

    def stop(self) -> None:
        """Wake every waiter for good (server shutdown)."""
        with self._lock:
            self._stopped = True
            self.changed.notify_all()

    def silent(self) -> list[Session]:
        """Attached sessions silent for longer than their own `timeout_s`."""
        now = time.monotonic()
        with self._lock:
            return [
                s
                for s in self._by_site.values()
                if s.detached_at is None and now - s.last_seen > s.timeout_s
            ]
