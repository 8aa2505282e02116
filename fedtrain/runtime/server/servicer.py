"""The gRPC face of the aggregation server: admission, control streams, bulk transfers.

Every request from a site is untrusted. Admission checks the protocol version, the
site's identity (with TLS, its certificate and its proof of holding the key:
`peer_auth`), the allow-list, the task fingerprint and the server's capacity; every
refusal is audited with the peer's address and a one-word cause (`AuditLog.refusal`,
throttled). Bulk RPCs must carry the token of a live control session and, with TLS,
arrive on that session's connection. Uploads are validated, journaled and folded
chunk by chunk (see `uploads.py`), and a broken upload is kept for its site to resume
(`resumable.py`); whatever is wrong becomes a gRPC status naming site,
round and tensor, an audit record and a log line, and never an exception that escapes
a handler.

A control stream that breaks after a silence is an outage, not a departure: the
session is kept `heartbeat.grace_s` (`detach`) and the site may rejoin it with its
token (Join.resume_token); one that closes while the site was talking (its process
ended) drops the site at once.

The handlers are coroutines on the server's event loop (`grpc.aio`): a connected
site costs a coroutine and a socket, never a thread. Work that takes the round's
locks or the CPU (validating and folding chunks, protocol messages, joins and leaves,
which reach the coordinator's state) runs on a small fixed pool (`cpu_threads`), so
the loop only moves bytes and never waits on a lock; `max_transfers` bounds the
downloads and uploads moved at once, so journal memory and open files stay bounded
however many sites there are. A site may spread a transfer over parallel streams
(separate connections, a byte range each: `resumable.py`, `site/streams.py`); they
share the transfer's one slot (`transfer_slots.py`). A transfer that holds a slot and
moves no byte for 3 x `transfers.stall_s` gives it up once another transfer waits
(`cut_idle`, decided by `transfer_watch.py`'s once-a-second sample): its streams end
with UNAVAILABLE, and the site resumes it like a broken one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc

from fedtrain.errors import ConfigError, FedtrainError, ProtocolError
from fedtrain.runtime import tls, wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.peer_auth import PeerCertificate, PeerVerifier
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.rpc import abort
from fedtrain.runtime.server.admission import Refusal
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.buffered import BufferedRounds
from fedtrain.runtime.server.coordinator import Coordinator
from fedtrain.runtime.server.downloads import SharedDownloads
from fedtrain.runtime.server.encoded_upload import DecodingSpool
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.runtime.server.links import TransferMeter
from fedtrain.runtime.server.model_push import ModelPush
from fedtrain.runtime.server.peer_check import PeerCheck
from fedtrain.runtime.server.resumable import (
    HeldUpload,
    HeldUploads,
    Lane,
    Superseded,
    header_terms,
)
from fedtrain.runtime.server.rounds import Outcome, RoundState, UploadRefused
from fedtrain.runtime.server.secure_round import SecureRoundState
from fedtrain.runtime.server.sessions import AtCapacity, Session, SessionRegistry
from fedtrain.runtime.server.status import server_state
from fedtrain.runtime.server.status_service import StatusService
from fedtrain.runtime.server.transfer_slots import TransferSlots
from fedtrain.runtime.server.transfer_watch import IDLE_CUT_STALLS, describe
from fedtrain.runtime.server.uploads import MaskedUpload, MemoryBudget, UpdateSpool
from fedtrain.runtime.server.weights import WeightDecision, WeightPolicy, WeightRefused
from fedtrain.task import fingerprint_mismatch
from fedtrain.tensors import Chunk

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: All sites' heartbeats together stay near this many messages per second: a larger
#: federation is told a longer interval when it joins, and sites that joined when it
#: was smaller are told again (`Pace`) once it has grown by a quarter, so the rate
#: stays under 1.25x this (keepalive pings, answered by gRPC itself, and any bytes
#: received are what keep a site alive in between). Without the re-pacing the first
#: thousand sites kept their 5 s interval: 660 heartbeats/s at 10,000 sites. Each
#: heartbeat costs the loop ~0.26 ms (grpc.aio's read, measured with benchmarks/swarm.py
#: at 3,000 idle sites: 5.9% of a core at 200/s, 2.0% at 50/s), so the rate is kept
#: low: at 10,000 sites a site beats every 200 s, and a hung site whose connection
#: still answers pings is noticed after its scaled timeout (20 min with the defaults).
HEARTBEATS_PER_S = 50.0
#: A site is re-paced when the interval it should have exceeds its own by this factor.
REPACE_FACTOR = 1.25
#: A site refused for capacity waits about this long (with jitter) before it retries.
CAPACITY_RETRY_S = 30.0
#: Downloads of one session that the server cut (`cut_idle`) and whose end the site has
#: not read yet, at most: gRPC keeps such a stream, and the chunk it was writing, until
#: the site reads on or its connection closes, so a site that never reads could pile up
#: one per cut. A site back from an outage has one (its old connection's, until the
#: server's keepalive closes it), two after a second outage within that time.
UNREAD_CUTS = 3
#: With more sites connected than this, each update's arrival is logged at DEBUG, not
#: INFO: a round of 1,000 would write 1,000 lines (2% of the server's CPU at 10,000
#: sites), and audit.jsonl records every upload anyway.
UPLOAD_LINES_SITES = 100


class EndedEarly(FedtrainError):
    """An upload's stream ended before the whole update arrived (kept for a resume)."""


def heartbeat_interval(configured_s: float, connected: int) -> float:
    """The heartbeat period a site is told on joining (see `HEARTBEATS_PER_S`)."""
    return max(configured_s, connected / HEARTBEATS_PER_S)


class FedtrainServicer:
    """Implements the Fedtrain service on top of a `Coordinator` (see the module doc)."""

    def __init__(
        self,
        config: ServerConfig,
        coordinator: Coordinator,
        registry: SessionRegistry,
        audit: AuditLog,
        *,
        verifier: PeerVerifier | None,
        spool_dir: Path,
        cpu: Executor,
        max_sites: int,
    ) -> None:
        self.config = config
        self.coordinator = coordinator
        self.registry = registry
        self.audit = audit
        #: Checks a peer's certificate and proof; None: no TLS (--insecure).
        self.verifier = verifier
        self.secure = verifier is not None
        self.spool_dir = spool_dir
        #: Challenges and checks peers on this port's event loop, audits refusals.
        self.peers = PeerCheck(verifier, audit)
        #: Status on this port (the status port and the socket answer with their own).
        self.status = StatusService(
            lambda page: server_state(coordinator, registry, page), peers=self.peers
        )
        self.cpu = cpu
        self.max_sites = max_sites
        self.journal_memory = MemoryBudget(config.upload_memory_mb << 20)
        self.codec = config.compression.build()  # decodes uploads (stateless at the server)
        self.weights = WeightPolicy(config.weights)
        #: `max_transfers` slots; a transfer's parallel streams share one.
        self.transfer_slots: TransferSlots[TransferMeter] = TransferSlots(config.max_transfers)
        #: What model downloads send: the encoding each site gets, made once per version.
        self.downloads = SharedDownloads(config.chunk_bytes, config.download)
        #: Instructions with a small model inside (no download call per site and round).
        self.push = ModelPush(
            self.downloads,
            min(config.transfers.inline_model_bytes, config.chunk_bytes),
            config.max_transfers,
            config.chunk_bytes + wire.HEADER_ALLOWANCE,
            coordinator.links,
            lambda nbytes: coordinator.transfers.add(sent=nbytes),
            current=lambda: coordinator.global_model,
            run=self._run,
        )
        #: Uploads in flight or broken off, kept `upload_grace_s` for the site to resume.
        self.held = HeldUploads(config.upload_grace_s)
        registry.on_leave(self.site_gone)
        coordinator.deadlines.on_drop(self.site_dropped)
        coordinator.deadlines.server_saturated = lambda: self.transfer_slots.saturated
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the CPU pool (it may take the round's locks or the CPU)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.cpu, functools.partial(fn, *args))

    # -- Control ----------------------------------------------------------------------------
    async def Control(
        self, request_iterator: AsyncIterator[pb.SiteMessage], context: grpc.aio.ServicerContext
    ) -> None:
        """A site's session: challenge, join, then messages both ways until it ends."""
        peer = context.peer()
        first, nonce, refusal = await self.peers.opening(
            context, lambda c: pb.ServerMessage(challenge=c)
        )
        if refusal is None and first.WhichOneof("kind") != "join":
            refusal = Refusal("no_join", "the first message on the control stream must be a Join")
        admitted = refusal or await self._run(self._admit, first.join, nonce)
        if isinstance(admitted, Refusal):
            await self._refuse_join(context, peer, admitted)
            return
        site, certificate = admitted
        identity = certificate.audit_fields() if certificate else {}
        if first.join.attach_to:
            await self._serve_connection(context, site, certificate, first.join.attach_to)
            return
        if self.coordinator.finished.is_set():
            await context.write(pb.ServerMessage(shutdown=pb.Shutdown(reason=wire.RUN_COMPLETE)))
            return
        pem = certificate.pem if certificate else b""
        session = None
        if first.join.resume_token:
            session = await self._run(
                self.registry.rejoin, first.join.resume_token, site, pem, peer
            )
            if session is None:
                other = self.registry.by_token(first.join.resume_token)
                if other is not None and other.site != site:
                    self.peers.refuse(
                        "rejoin_refused",
                        peer,
                        Refusal(
                            "other_session",
                            f"site {site!r} asked to continue the session of site "
                            f"{other.site!r}; it gets a session of its own",
                            site=site,
                            details=identity,
                        ),
                    )
                log.info("site %r asked to continue a session that is gone; a new one", site)
        resumed = session is not None
        if session is not None:
            if session.handler is not None:  # its old stream still looked open: end it
                session.handler.cancel()
            log.info("site %r rejoined its session from %s", site, peer)
            self.audit.record("rejoin", site=site, peer=peer, **identity)
            self.cpu.submit(self.coordinator.rejoined, session)
        else:
            interval = heartbeat_interval(self.config.heartbeat.interval_s, len(self.registry) + 1)
            session = Session(
                site,
                peer,
                timeout_s=self._silence_allowed(interval),
                heartbeat_interval_s=interval,
                certificate=pem,
                capabilities=frozenset(first.join.capabilities),
            )
            session.open_outbox()  # before it is registered: instructions may follow at once
            try:
                replaced = await self._run(self.registry.add, session, self.max_sites)
            except AtCapacity:  # checked here, atomically, so racing joins cannot overfill
                await self._refuse_join(context, peer, self._at_capacity(site, identity))
                return
            if replaced is not None:
                await self._run(
                    self.registry.remove,
                    replaced,
                    "replaced by a new connection from the same site",
                )
            log.info("site %r joined from %s", site, peer)
            self.audit.record(
                "join", site=site, peer=peer, fingerprint=first.join.task_fingerprint, **identity
            )
        session.open_outbox()
        session.handler = asyncio.current_task()
        welcome = pb.Welcome(
            run_id=self.coordinator.run_id,
            session_token=session.token,
            site_name=site,
            heartbeat_interval_s=session.heartbeat_interval_s,
            chunk_bytes=self.config.chunk_bytes,
            secagg=self.config.secagg.enabled,
            resumed=resumed,
            grace_s=self.config.heartbeat.grace_s,
        )
        if self.codec.name != "none":  # sites encode their updates with it
            wire.config_to_proto(dataclasses.asdict(self.config.compression), welcome.compression)
        if self.downloads.serves(session.capabilities):  # and decode their downloads with it
            wire.config_to_proto(dataclasses.asdict(self.config.download), welcome.download)
        reader = asyncio.create_task(self._read(session, context, asyncio.current_task()))
        broke = False
        try:
            await context.write(pb.ServerMessage(welcome=welcome))
            while (message := await session.next_message()) is not None:
                await self.push.send(session, message, context.write)
        except grpc.RpcError:
            broke = True
            raise
        except asyncio.CancelledError:
            broke = True
            if session.handler is not asyncio.current_task() or session.detached_at is not None:
                # Ended here (a rejoin took over, or the site was silent): say so, since
                # a cancelled handler alone ends nothing the site could see.
                await _end_cut_stream(
                    context,
                    f"site {session.site!r}: this control stream is replaced or the site was "
                    "silent; rejoin the session (Join.resume_token)",
                )
            raise
        finally:  # the site left, the stream broke (keepalive), or the server stops
            reader.cancel()
            if session.handler is asyncio.current_task():  # not taken over by a rejoin
                session.handler = None
                if broke:
                    self._lost(session, "control stream broke")
                else:
                    self._leave(session, "control stream closed")

    async def _serve_connection(
        self,
        context: grpc.aio.ServicerContext,
        site: str,
        certificate: PeerCertificate | None,
        token: str,
    ) -> None:
        """A connection that carries the parallel streams of session `token` (it proved
        the session's own certificate at its Join): its bulk requests count as the
        session's while this stream is open (until the site closes it, the connection
        dies or the session ends)."""
        peer = context.peer()
        pem = certificate.pem if certificate else b""
        session = self.registry.by_token(token)
        if (
            session is None
            or (session.site, session.certificate) != (site, pem)
            or len(session.connections) >= wire.MAX_TRANSFER_STREAMS
            or not self.registry.add_connection(session, peer)
        ):
            refusal = Refusal(
                "other_session",
                f"site {site!r} asked to carry the transfers of a session that is not its "
                "own or has ended (it must join or rejoin first), or that has "
                f"{wire.MAX_TRANSFER_STREAMS} connections already",
                site=site,
                details=certificate.audit_fields() if certificate else {},
            )
            await self._refuse_join(context, peer, refusal)
            return
        try:
            welcome = pb.Welcome(
                run_id=self.coordinator.run_id,
                session_token=token,
                site_name=site,
                chunk_bytes=self.config.chunk_bytes,
            )
            await context.write(pb.ServerMessage(welcome=welcome))
            while await context.read() is not grpc.aio.EOF:
                pass  # nothing is expected: the site only keeps the stream open
        except grpc.RpcError:
            pass
        finally:
            self.registry.drop_connection(session, peer)

    def _silence_allowed(self, interval_s: float) -> float:
        """A site's heartbeat timeout, scaled with the interval it was told."""
        hb = self.config.heartbeat
        return hb.timeout_s * interval_s / hb.interval_s

    def repace(self) -> int:
        """Tell sites that joined a smaller federation a longer heartbeat interval (on
        the loop, from the watchdog); returns how many were told."""
        sessions = self.registry.sessions()
        target = heartbeat_interval(self.config.heartbeat.interval_s, len(sessions))
        told = 0
        for session in sessions:
            if session.heartbeat_interval_s * REPACE_FACTOR < target:
                # The longer timeout first: the site may go quiet as soon as it is told.
                session.timeout_s = self._silence_allowed(target)
                session.heartbeat_interval_s = target
                session.send(pb.ServerMessage(pace=pb.Pace(heartbeat_interval_s=target)))
                told += 1
        if told:
            log.info("%d site(s) told to send heartbeats every %.0fs", told, target)
        return told

    def _admit(self, join: pb.Join, nonce: bytes) -> tuple[str, PeerCertificate | None] | Refusal:
        """(site name, its verified certificate) if the site may join, else the refusal.
        On the CPU pool: it verifies a signature and a certificate chain."""
        if join.protocol_version != wire.PROTOCOL_VERSION:
            return Refusal(
                "protocol_version",
                f"protocol version {join.protocol_version} is not supported (server speaks "
                f"{wire.PROTOCOL_VERSION}); install the same fedtrain version at site and server",
                site=join.site_name or None,
            )
        certificate = None
        if self.verifier is not None:
            certificate = self.peers.check_proof(join, "join", nonce)
            if isinstance(certificate, Refusal):
                return certificate
            site = certificate.name
            if join.site_name and join.site_name != site:
                return Refusal(
                    "site_name_mismatch",
                    f"the Join names site {join.site_name!r} but the certificate is for "
                    f"{site!r}; fix `name` in site.toml or leave it empty",
                    site=site,
                    details=certificate.audit_fields(),
                )
        else:
            try:
                site = tls.validate_site_name(join.site_name)
            except ConfigError as exc:
                return Refusal(
                    "bad_site_name",
                    f"without TLS the Join must carry a site name: {exc}",
                    site=join.site_name or None,
                )
        details = certificate.audit_fields() if certificate else {}
        refusal = self._join_rules(site, join)
        if refusal is not None:
            refusal.site, refusal.details = site, details
            return refusal
        return site, certificate

    def _join_rules(self, site: str, join: pb.Join) -> Refusal | None:
        """Why the identified `site` may not join now, or None."""
        allowed = self.config.allowed_sites
        if allowed and site not in allowed:
            return Refusal(
                "not_allowed",
                f"site {site!r} is not on this server's allowed_sites ({', '.join(allowed)}); "
                "the server operator must add it to server.toml",
            )
        if join.task_fingerprint != self.coordinator.fingerprint:
            return Refusal(
                "task_fingerprint",
                f"task fingerprint mismatch for site {site!r} (task = {self.config.task!r}): "
                + fingerprint_mismatch(join.task_fingerprint, self.coordinator.fingerprint),
            )
        if self.config.secagg.enabled and wire.SECAGG_CAPABILITY not in join.capabilities:
            return Refusal(
                "secagg_unsupported",
                f"site {site!r} does not speak the secure aggregation this server runs "
                f"({wire.SECAGG_CAPABILITY}; secagg.enabled in server.toml): it runs another "
                "fedtrain version; install the same fedtrain version as the server at the site",
            )
        return None

    def _at_capacity(self, site: str, details: dict[str, Any]) -> Refusal:
        return Refusal(
            "capacity",
            f"the server is at capacity ({self.max_sites} sites connected); retry later. "
            "The operator can raise max_sites in server.toml, or the server's file limit "
            "(LimitNOFILE in its service unit)",
            retry_after_s=CAPACITY_RETRY_S,
            site=site,
            details=details,
        )

    async def _refuse_join(
        self, context: grpc.aio.ServicerContext, peer: str, refusal: Refusal
    ) -> None:
        """Audit (throttled) and log a refused join, and tell the site why."""
        self.peers.refuse("join_refused", peer, refusal)
        await context.write(_reject(refusal.reason, refusal.retry_after_s))

    async def _read(self, session: Session, context: grpc.aio.ServicerContext, owner: Any) -> None:
        """Consume a site's control messages (a task beside `owner`, the handler that
        sends); once a rejoin has taken the session over, this stream's end is no news."""
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                session.touch()
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    session.leaving = message.heartbeat.leaving
                    session.reconnecting = message.heartbeat.reconnecting
                    continue
                if kind == "error":
                    err = message.error
                    log.warning(
                        "site %r reports for round %d: %s", session.site, err.round, err.message
                    )
                    self.audit.record(
                        "site_error", site=session.site, round=err.round, message=err.message
                    )
                    await self._run(self.coordinator.site_failed, session, err.round, err.message)
                elif kind == "secagg":
                    await self._run(self._secagg, session, message.secagg)
                elif kind == "evaluation":
                    await self._run(
                        self.coordinator.evaluation_received, session, message.evaluation
                    )
                else:
                    reason = f"protocol error: unexpected {kind or 'empty'} message after joining"
                    log.warning("site %r: %s", session.site, reason)
                    self._leave(session, reason)
                    return
        except grpc.RpcError:
            if session.handler is owner:
                self._lost(session, "control stream broke")
            return
        if session.handler is owner:
            # gRPC ends the reads of a stream whose connection died with EOF too, so the
            # end alone does not say whether the site left or its link failed.
            self._lost(session, "control stream ended by the site")

    def _secagg(self, session: Session, message: pb.SecAggMessage) -> None:
        """Hand a stage reply to the round in progress; a refusal is logged, never fatal."""
        exchange = self.coordinator.secagg_exchange()
        try:
            if exchange is None:
                raise ProtocolError(
                    f"site {session.site!r} sent a secure-aggregation message for round "
                    f"{message.round}, but no secure-aggregation round or evaluation is in "
                    "progress; ignored"
                )
            exchange.receive(session, message)
        except FedtrainError as exc:
            log.warning("%s", exc)
            self.audit.record(
                "secagg_refused", site=session.site, round=message.round, reason=str(exc)
            )

    def _lost(self, session: Session, reason: str) -> None:
        """The site's control stream ended or broke. A site that said it is leaving
        (Heartbeat.leaving), or whose stream ended while it was talking (its process
        exited or was killed), is gone at once; after a silence, or when the site said
        it rejoins on a new connection (Heartbeat.reconnecting), it is an outage: the
        site is kept `heartbeat.grace_s` (`detach`).

        A silence is two heartbeat periods, or the keepalive period if that is shorter:
        the server's keepalive notices a cut link only after `keepalive_s` without an
        answer, so every outage it finds has been silent that long, even at 10,000 sites
        where a site beats only every 200 s (then a killed site that had been quiet that
        long waits out the grace, as an outage would)."""
        if session.closed or session.detached_at is not None:
            return
        quiet_s = time.monotonic() - session.last_seen
        silence_s = min(2 * session.heartbeat_interval_s, self.config.heartbeat.keepalive_s)
        quiet = quiet_s > silence_s or session.reconnecting
        outage = quiet and not (session.leaving or self.coordinator.stopped)
        if self.config.heartbeat.grace_s > 0 and outage:
            why = "to reconnect" if session.reconnecting else f"after {quiet_s:.0f}s of silence"
            self.detach(session, f"{reason} {why}")
        else:
            self._leave(session, reason)

    def detach(self, session: Session, reason: str) -> None:
        """Keep an unreachable site's session and round for `heartbeat.grace_s` (from the
        loop or any thread): its streams are ended (they are dead or stuck), its upload
        is kept for a resume, its messages queue until it rejoins."""
        if not self.registry.detach(session):
            return
        grace = self.config.heartbeat.grace_s
        log.warning(
            "site %r is unreachable (%s); kept %gs for it to rejoin", session.site, reason, grace
        )
        self.audit.record("site_away", site=session.site, reason=reason, grace_s=grace)
        loop = self._loop or session._loop
        held = self.held.of_site(session.site)
        streams = [session.handler, *(held.tasks() if held is not None else ()), *session.streams]
        for task in streams:
            if task is not None and loop is not None:
                loop.call_soon_threadsafe(task.cancel)

    def _leave(self, session: Session, reason: str) -> None:
        """End the session (idempotent; the server audits every leave). Not awaited: it
        runs on the pool (leave listeners reach the round's state) even while the
        stream's handler is being torn down."""
        if not session.closed:
            self.cpu.submit(self.registry.remove, session, reason)

    # -- bulk transfers ----------------------------------------------------------------------
    async def _session(self, token: str, context: grpc.aio.ServicerContext, what: str) -> Session:
        """The live session a bulk request belongs to: its token names it and, with TLS,
        the request travels on the connection that session authenticated."""
        session = self.registry.by_token(token)
        if session is None:
            await self._deny(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "unknown_session",
                f"{what} from {context.peer()}: unknown session token (the session ended or "
                "the server restarted); the site must rejoin on its control stream first",
            )
        if session.detached_at is not None:
            await self._deny(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "session_away",
                f"{what}: the session of site {session.site!r} lost its control stream; the "
                "site must rejoin it (Join.resume_token) before it transfers again",
                site=session.site,
            )
        if self.secure and context.peer() not in (session.peer, *session.connections):
            await self._deny(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "other_connection",
                f"{what}: the session of site {session.site!r} was authenticated on another "
                "connection; bulk requests must travel on the channel of the control stream",
                site=session.site,
            )
        session.touch()
        return session

    async def _require_session_connection(
        self, context: grpc.aio.ServicerContext, what: str
    ) -> None:
        """With TLS, refuse a stream before reading from it unless its connection holds a
        session: an unauthenticated peer gets nothing read or buffered here."""
        if self.secure and self.registry.by_peer(context.peer()) is None:
            await self._deny(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "no_session",
                f"{what} from {context.peer()}: this connection has not joined (a site must "
                "prove its identity on its control stream first, then use the same channel)",
            )

    async def _deny(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        cause: str,
        message: str,
        *,
        site: str | None = None,
    ) -> NoReturn:
        """Refuse a bulk request that belongs to no (valid) session: log, audit, abort."""
        peer = context.peer()
        if self.audit.refusal(
            "request_refused", peer=peer, cause=cause, code=code.name, site=site, reason=message
        ):
            log.warning("refused: %s", message)
        await abort(context, code, message)

    async def DownloadModel(
        self, request: pb.ModelRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Write the model's manifest and chunks (`context.write`, not a generator: a
        write the site does not read can then be cut by `cut_idle`, which a generator
        blocked in gRPC's own write never sees)."""
        session = await self._session(request.session_token, context, "model download")
        if len(session.unread_cuts) >= UNREAD_CUTS:
            await self._deny(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "unread_cuts",
                f"site {session.site!r}: {len(session.unread_cuts)} model downloads the server "
                "cut for moving no bytes are still unread on this site's connections; read "
                "them to their end (or cancel them) before downloading again",
                site=session.site,
            )
        model = await self._run(self.coordinator.model_for_download, session, request.version)
        if model is None:
            current = self.coordinator.global_model
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {session.site!r} asked for model {request.version[:12]}, but the current "
                f"global model is {current.version[:12]} (after round {current.round})",
            )
        log.debug(
            "site %r downloads model %s [%d, %s)",
            session.site,
            model.version[:12],
            request.offset,
            request.end or "end",
        )
        if request.offset and not request.end:  # a range of parallel streams starts anywhere
            log.info("site %r: model download resumes at byte %d", session.site, request.offset)
            self.audit.record(
                "download_resumed",
                site=session.site,
                model_version=model.version,
                offset=request.offset,
            )
        round_state = self.coordinator.current
        if not (
            isinstance(round_state, RoundState)
            and session.site in round_state.plan
            and round_state.model_version == model.version
        ):
            round_state = None  # not a download for a training round's deadline
        elif (
            round_state.tokens.get(session.site) == session.token
            and round_state.outcomes.get(session.site) is Outcome.DROPPED
        ):
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {session.site!r} was dropped from round {round_state.round} (its "
                "deadline passed; see the server's log); no download for it",
            )
        task = asyncio.current_task()
        session.streams.add(task)  # cancelled if the site goes away meanwhile
        cut: TransferMeter | None = None
        try:
            # One slot for all of a session's downloads at a time, whatever they name:
            # keyed by what the site chooses (a version, a held reference) one site
            # could take every slot with downloads it never reads.
            key = session.token
            training = round_state is not None
            async with self._transfer(
                session, "down", key, training=training, moves=(model.version, request.held_version)
            ) as meter:
                try:
                    await self._send_model(context, session, request, model, round_state, meter)
                except asyncio.CancelledError:
                    if not meter.cut:
                        raise
                    cut = meter  # its slot is free already
        finally:
            session.streams.discard(task)
        if cut is not None:
            session.unread_cuts[cut] += 1  # until the site reads the status (UNREAD_CUTS)
            try:
                await _end_cut_stream(
                    context,
                    f"site {session.site!r}: the server cut this download of model "
                    f"{model.version[:12]}: {cut.cut}. Continue it from the bytes received "
                    "(ModelRequest.offset; the site daemon does so by itself while its "
                    "instruction's deadline allows)",
                )
            finally:
                session.unread_cuts[cut] -= 1
                if not session.unread_cuts[cut]:
                    del session.unread_cuts[cut]

    async def _send_model(
        self,
        context: grpc.aio.ServicerContext,
        session: Session,
        request: pb.ModelRequest,
        model: GlobalModel,
        round_state: RoundState | None,
        meter: TransferMeter,
    ) -> None:
        """With the download's slot: its manifest, then the chunks of the request's range."""
        with meter.on_server():  # encoding a version may take a while: not the site's
            manifest, pieces = await self.downloads.prepare(
                model,
                encoded=self.downloads.serves(session.capabilities),
                current=model is self.coordinator.global_model,
                held=request.held_version,
                run=self._run,
                ranged=request.end > 0,
            )
        end = min(request.end or manifest.total_bytes, manifest.total_bytes)
        if not meter.total:  # the first of its streams: what the transfer moves
            meter.expect(manifest.total_bytes, 0 if request.end else request.offset)
        if request.offset > end:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"site {session.site!r}: a download of bytes [{request.offset}, "
                f"{end}), but this download of model {model.version[:12]} has "
                f"{manifest.total_bytes} bytes",
            )
        await context.write(pb.ModelPiece(manifest=manifest))
        # A resumed download (or a range that starts further on) skips the chunks
        # before its offset. A single stream resumes at a chunk boundary; a range takes
        # the chunks that start in it.
        position, remaining = pieces.from_offset(request.offset)
        if not request.end and position != request.offset:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"site {session.site!r}: a download from byte "
                f"{request.offset}, which is not a chunk boundary of this "
                "download; download the model again",
            )
        for piece, size in remaining:
            start, position = position, position + size
            if start >= end:
                break  # a parallel stream's range ends here
            if (
                round_state is not None
                and round_state.closed
                and self.coordinator.global_model.version != model.version
            ):
                # The round it was for is over and its model superseded: every
                # further byte is spent on a model the site can no longer train for
                # (a retried attempt trains from the same model: that one goes on).
                await abort(
                    context,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"site {session.site!r}: round {round_state.round} closed and its "
                    "model was superseded while it downloaded; download stopped (the "
                    "site gets the next instruction)",
                )
            self.coordinator.transfers.add(sent=size)
            meter.add(size)
            session.touch()
            await context.write(piece)  # bytes or a Chunk: wire.serialize_stream_item
        meter.completed()

    @contextlib.asynccontextmanager
    async def _transfer(
        self,
        session: Session,
        direction: str,
        key: Any,
        *,
        training: bool = True,
        moves: Any = None,
    ) -> AsyncIterator[TransferMeter]:
        """A transfer slot (shared by the parallel streams of transfer `key`), and the
        link's rate measured while the transfer holds it (all its streams together;
        `moves`: what it moves, so that its ranges in a row are measured as one)."""
        self._loop = asyncio.get_running_loop()

        def opened() -> TransferMeter:
            received = session.bytes_received
            counted = (lambda: session.bytes_received - received) if direction == "up" else None
            return self.coordinator.links.meter(
                session.site, direction, counted, training=training, transfer=moves
            )

        session.queued += 1  # until the slot is granted: the server's wait, not the site's
        granted = False
        try:
            async with self.transfer_slots.hold(
                (direction, key), opened, TransferMeter.close
            ) as meter:
                session.queued -= 1
                granted = True
                task = asyncio.current_task()
                meter.streams.add(task)  # cut by `cut_idle`
                try:
                    yield meter
                finally:
                    meter.streams.discard(task)
        finally:
            if not granted:
                session.queued -= 1

    async def UploadUpdate(
        self, request_iterator: AsyncIterator[pb.UpdateChunk | Chunk], context: Any
    ) -> pb.UploadReceipt:
        await self._require_session_connection(context, "upload")
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            await self._deny(
                context, grpc.StatusCode.INVALID_ARGUMENT, "no_header", "empty upload: no header"
            )
        except grpc.RpcError:
            return pb.UploadReceipt()  # the site cancelled before sending anything
        if isinstance(first, Chunk) or first.WhichOneof("kind") != "header":
            await self._deny(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "no_header",
                "an upload must start with its header",
            )
        header = first.header
        session = await self._session(
            header.session_token, context, f"upload for round {header.round}"
        )
        state = self.coordinator.current
        where = f"site {session.site!r}, round {header.round}"
        try:
            if state is None:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: no round is in progress; update dropped",
                )
            self._check_header(state, header, where)
            if header.resume_id:
                held = await self._run(self.held.claim, header.resume_id, session, header, state)
            else:
                await self._run(self._restart_and_admit, state, session, header)
        except UploadRefused as exc:
            await self._refuse(context, session, header.round, exc.code, str(exc))
        assert state is not None
        if not header.resume_id:
            self.coordinator.links.upload_started(session.site, count_compute=not header.masked)
            weight = None if header.masked else await self._weigh(state, session, header, context)
            held = self._new_upload(state, session, header, weight)
        try:
            async with self._transfer(session, "up", held.id, moves=held.id) as meter:
                if not meter.total:  # the first of its streams: what the transfer moves
                    meter.expect(held.sink.expected_bytes, held.offset)
                whole = await self._stream_upload(
                    context, state, session, header, held, request_iterator, meter
                )
                if whole:
                    meter.completed()
        except asyncio.CancelledError:  # e.g. the site went away while its upload waited
            held.abandoned_before_start()
            raise
        if not whole:  # one of parallel streams: its range is in, the update not yet
            log.debug("%s: bytes [%d, %d) in", where, header.range_start, header.range_end)
            return pb.UploadReceipt(round=header.round, partial=True)
        received = held.offset
        weight = held.weight
        log.log(
            logging.INFO if len(self.registry) <= UPLOAD_LINES_SITES else logging.DEBUG,
            "%s: %s update of %d bytes aggregated",
            where,
            "masked" if header.masked else "plain",
            received,
        )
        self.audit.record(
            "upload",
            site=session.site,
            round=header.round,
            bytes=received,
            num_examples=header.num_examples,
            masked=header.masked,
            **({} if weight is None else {"num_examples_counted": weight.weight}),
        )
        return pb.UploadReceipt(
            round=header.round,
            bytes_received=received,
            num_examples_counted=0 if weight is None else weight.weight,
            notice="" if weight is None else weight.reason,
        )

    async def _stream_upload(
        self,
        context: grpc.aio.ServicerContext,
        state: RoundState | BufferedRounds,
        session: Session,
        header: pb.UploadHeader,
        held: HeldUpload,
        request_iterator: AsyncIterator[pb.UpdateChunk | Chunk],
        meter: TransferMeter,
    ) -> bool:
        """With a transfer slot: tell the site to go (and from which byte), receive the
        rest of the stream's range of the upload and fold it once whole (True: this
        stream completed it); a broken stream, or one cut idle (`cut_idle`), leaves it
        held for a resume."""
        where = f"site {session.site!r}, round {header.round}"
        try:
            with meter.on_server():
                lane, generation, offset, superseded = await self._run(
                    held.attach, asyncio.current_task(), header.range_start, header.range_end
                )
        except Superseded:  # discarded (grace, round closed, site dropped) meanwhile
            await self._refuse(
                context,
                session,
                header.round,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: the upload was discarded before it could resume",
            )
        except UploadRefused as exc:  # a range that overlaps another or runs past the end
            # The upload stays for its other ranges, but its grace runs if none feeds
            # it (a refused first range left it held, with no grace, until the round closed).
            held.abandoned_before_start()
            await self._refuse(context, session, header.round, exc.code, f"{where}: {exc}")
        if superseded is not None:  # its connection looked open, but the site moved on
            superseded.cancel()
        if offset > lane.start:
            log.info("%s: upload resumes at byte %d", where, offset)
            self.audit.record(
                "upload_resumed", site=session.site, round=header.round, offset=offset
            )
        await context.send_initial_metadata(
            (
                (wire.UPLOAD_GO_AHEAD, "1"),
                (wire.UPLOAD_ID, held.id),
                (wire.UPLOAD_OFFSET, str(offset)),
            )
        )
        try:
            return await self._receive(
                state, session, header, held, lane, generation, request_iterator, meter
            )
        except (grpc.RpcError, asyncio.CancelledError, Superseded):
            await self._broke_off(context, session, header, held, lane, generation, meter.cut)
        except EndedEarly as exc:
            self._pause(session, header, held, lane, generation)
            await self._refuse(
                context, session, header.round, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            )
        except UploadRefused as exc:
            await self._run(self.discard, held, "refused", asyncio.current_task())
            await self._refuse(context, session, header.round, exc.code, str(exc))
        except FedtrainError as exc:  # TensorStreamError, UpdateRejected from the checks
            await self._run(self.discard, held, "rejected", asyncio.current_task())
            await self._refuse(
                context,
                session,
                header.round,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: update rejected: {exc}",
            )
        except Exception as exc:  # e.g. the spool's disk is full: the server must carry on
            await self._run(self.discard, held, "failed on the server", asyncio.current_task())
            log.exception("%s: the upload failed on the server", where)
            await self._refuse(
                context,
                session,
                header.round,
                grpc.StatusCode.INTERNAL,
                f"{where}: the server failed to store the update ({exc}); it may be retried",
            )

    def _pause(
        self,
        session: Session,
        header: pb.UploadHeader,
        held: HeldUpload,
        lane: Lane,
        generation: int,
        *,
        quiet: bool = False,
    ) -> bool:
        """Keep an upload whose stream `generation` ended short (on the loop, not awaited:
        a cancelled handler may be cancelled again); False if another stream feeds its
        range now or it was discarded. `quiet`: the cut that ended it logged it."""
        if not held.detach(lane, generation):
            return False
        if not quiet:
            log.warning(
                "site %r, round %d: the upload stream broke off at byte %d; kept %gs for the "
                "site to resume",
                session.site,
                header.round,
                held.offset,
                self.held.grace_s,
            )
        self.audit.record(
            "upload_paused", site=session.site, round=header.round, offset=held.offset
        )
        return True

    async def _broke_off(
        self,
        context: grpc.aio.ServicerContext,
        session: Session,
        header: pb.UploadHeader,
        held: HeldUpload,
        lane: Lane,
        generation: int,
        cut: str = "",
    ) -> NoReturn:
        """The stream broke, was superseded by the site's resume, or was cut here (the
        site is away, was dropped, or `cut` idle): keep the upload if it is still the
        site's, and tell the site, if it can still hear us, what to do."""
        where = f"site {session.site!r}, round {header.round}"
        paused = self._pause(session, header, held, lane, generation, quiet=bool(cut))
        if not paused and held.discarded:
            await _end_cut_stream(
                context,
                f"{where}: the upload was discarded ({held.discarded}); do not resume it",
                grpc.StatusCode.ABORTED,
            )
        why = f"the server cut the upload: {cut}" if cut else "the upload stream was cut"
        await _end_cut_stream(
            context,
            f"{where}: {why}. The server keeps the {held.offset} bytes it received for "
            f"{self.held.grace_s:g}s (upload_grace_s): resume the upload to send the rest "
            "(the site daemon does so by itself)",
        )

    def _new_upload(
        self,
        state: RoundState | BufferedRounds,
        session: Session,
        header: pb.UploadHeader,
        weight: WeightDecision | None,
    ) -> HeldUpload:
        """A new upload's journal, registered so that a broken stream can resume it."""
        sink: UpdateSpool | MaskedUpload
        if weight is None:
            assert isinstance(state, SecureRoundState)
            sink = MaskedUpload(
                state.layout.length + 1,
                self.config.chunk_bytes,
                lambda offset, values: state.fold_masked(session, offset, values),
            )
        else:
            specs = self.coordinator.global_model.state.specs
            sink = (
                UpdateSpool(specs, self.spool_dir, self.config.chunk_bytes, self.journal_memory)
                if self.codec.name == "none"
                else DecodingSpool(
                    self.codec, specs, self.spool_dir, self.config.chunk_bytes, self.journal_memory
                )
            )
        held = HeldUpload(
            site=session.site,
            token=session.token,
            certificate=session.certificate,
            state=state,
            terms=header_terms(header),
            sink=sink,
            weight=weight,
        )
        self.held.add(held)
        return held

    def _restart_and_admit(
        self, state: RoundState | BufferedRounds, session: Session, header: pb.UploadHeader
    ) -> None:
        """A new upload (one trip to the pool): one the site left broken off is
        discarded (the site lost its id, or restarts on purpose); one still streaming
        stays, and the round's admission refuses the second."""
        held = self.held.of_site(session.site)
        if held is not None and not held.attached:
            self.discard(held, "the site started a new upload")
        state.admit(session, header.round, header.model_version)

    def discard(self, held: HeldUpload, reason: str, by: Any = None) -> None:
        """Throw an upload away (on the pool): out of the round's sum and off the disk,
        the streams that still feed it cancelled at once, except `by`: the handler task
        that refuses it (and logs and audits why itself)."""
        live, tasks = held.end(reason)
        self.held.forget(held)
        if not live:
            return
        for task in tasks:
            if task is not by and self._loop is not None:
                self._loop.call_soon_threadsafe(task.cancel)
        cancel = by is None
        held.state.abandon(held.site)
        self.coordinator.transfers.settle(discarded=held.offset)
        self.held.lost(held)
        if isinstance(held.sink, UpdateSpool):
            held.sink.close()
        if cancel:  # a refusal is logged and audited by the handler that refuses
            log.warning(
                "site %r, round %s: upload of %d bytes discarded: %s",
                held.site,
                held.terms[0],
                held.offset,
                reason,
            )
            self.audit.record(
                "upload_discarded",
                site=held.site,
                round=held.terms[0],
                bytes=held.offset,
                reason=reason,
            )

    def sweep_uploads(self) -> int:
        """Discard uploads not resumed within their grace or whose round closed (the
        watchdog calls it); returns how many."""
        expired = self.held.expired()
        for held, reason in expired:
            self.cpu.submit(self.discard, held, reason)
        return len(expired)

    def site_gone(self, session: Session, reason: str) -> None:
        """A leave listener: the upload of a site that left is discarded at once, its
        stream cancelled (the round's retry must not wait on it)."""
        held = self.held.of_site(session.site)
        if held is not None and held.token == session.token:
            self.discard(held, f"the site left ({reason})")

    def site_dropped(self, session: Session, reason: str) -> None:
        """A listener of `SiteDeadlines`: a site dropped from the round at its own
        deadline moves no more bytes for it (its upload discarded, its download cut)."""
        held = self.held.of_site(session.site)
        if held is not None and held.token == session.token:
            self.discard(held, f"dropped from the round: {reason}")
        loop = self._loop or session._loop
        for task in list(session.streams):
            if loop is not None:
                loop.call_soon_threadsafe(task.cancel)

    def cut_idle(self, meter: TransferMeter, idle_s: float) -> bool:
        """A listener of `TransferWatch` (on the loop): a transfer that holds a slot and
        moved no byte for `transfer_watch.idle_cut_s` gives it back as soon as another
        transfer waits for one (True: cut), and each of its streams ends with
        UNAVAILABLE and what to do (an upload is kept `upload_grace_s` for a resume, a
        download continues from its offset: a site that was only in an outage loses
        nothing). Logged once and audited `transfer_cut`."""
        waiting = self.transfer_slots.waiting
        if not waiting:
            return False  # nobody needs the slot: a slow chunk may still be on its way
        if not self.transfer_slots.free(meter, TransferMeter.close):
            return True  # it ended meanwhile
        moved = "from" if meter.direction == "up" else "to"
        meter.cut = (
            f"no bytes moved {moved} the site for {idle_s:.0f}s while it held one of the "
            f"server's max_transfers slots ({IDLE_CUT_STALLS:g} x transfers.stall_s)"
        )
        kept = (
            f"its {meter.done} bytes are kept {self.held.grace_s:g}s for it to resume"
            if meter.direction == "up"
            else "it may continue from the bytes it received"
        )
        log.warning(
            "transfer cut: no bytes %s site %r for %.0fs (%s) while %d transfer(s) waited "
            "for a slot; its slot is free for them, %s",
            moved,
            meter.site,
            idle_s,
            describe(meter),
            waiting,
            kept,
        )
        self.audit.record(
            "transfer_cut",
            site=meter.site,
            direction=meter.direction,
            idle_s=round(idle_s, 1),
            bytes=meter.done,
            total_bytes=meter.total,
            waiting=waiting,
        )
        for task in list(meter.streams):
            task.cancel()
        return True

    async def _weigh(
        self,
        state: RoundState | BufferedRounds,
        session: Session,
        header: pb.UploadHeader,
        context: grpc.aio.ServicerContext,
    ) -> WeightDecision:
        """What a plain update's declared example count may count for (`weights.py`),
        decided before any of its chunks is received; a refusal or a clip is audited."""
        try:
            decision = self.weights.admit(session.site, header.num_examples)
        except WeightRefused as exc:
            await self._run(state.abandon, session.site)
            self._audit_weight("weight_refused", session, header.round, exc.decision)
            await self._refuse(
                context,
                session,
                header.round,
                grpc.StatusCode.PERMISSION_DENIED,
                f"site {session.site!r}, round {header.round}: {exc}",
            )
        if decision.over:
            log.warning("site %r, round %d: %s", session.site, header.round, decision.reason)
            self._audit_weight("weight_clipped", session, header.round, decision)
        return decision

    def _audit_weight(
        self, event: str, session: Session, server_round: int, decision: WeightDecision
    ) -> None:
        self.audit.record(
            event,
            site=session.site,
            round=server_round,
            num_examples=decision.declared,
            limit=decision.limit,
            rule=decision.rule.value,
            reason=decision.reason,
        )

    def _check_header(self, state: Any, header: pb.UploadHeader, where: str) -> None:
        """Refuse a header that cannot belong to the round in progress."""
        secure = isinstance(state, SecureRoundState)
        if header.masked != secure:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: "
                + (
                    "this round runs secure aggregation; a plain (unmasked) update is refused"
                    if secure
                    else "a masked update, but this round does not run secure aggregation"
                ),
            )
        if not header.masked and (header.codec or "none") != self.codec.name:
            raise UploadRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: update encoded with codec {header.codec or 'none'!r}, but this "
                f"server decodes compression.codec = {self.codec.name!r} (sites learn it "
                "when they join: a site that joined another server must reconnect)",
            )
        if not header.masked and header.num_examples < 1:
            raise UploadRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: num_examples must be >= 1 (it weights the update), got "
                f"{header.num_examples}",
            )

    async def _receive(
        self,
        state: RoundState | BufferedRounds,
        session: Session,
        header: pb.UploadHeader,
        held: HeldUpload,
        lane: Lane,
        generation: int,
        request_iterator: AsyncIterator[pb.UpdateChunk | Chunk],
        meter: TransferMeter,
    ) -> bool:
        """Validate and journal the chunks of a stream's range as they arrive (after
        those the server held already), and once the update is whole fold a plain
        update from its journal with the weight the policy let through (a masked vector
        was folded chunk by chunk); returns whether this stream completed the update
        (False: its range is in, other streams still carry theirs).

        An upload that fails on the way was never folded, so it leaves no trace in the
        round's sum. An encoded upload (`[compression]`) is journaled as its codec's
        parts and folded decoded.
        """
        sink = held.sink

        def still_open() -> None:
            if state.closed:  # e.g. the deadline passed: stop receiving at once
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"site {session.site!r}, round {header.round}: the round closed "
                    "while the update was being received; update dropped",
                )

        def journal(chunk: Chunk) -> None:
            again = held.add(lane, generation, chunk, still_open)
            if again:
                self.coordinator.transfers.settle(resent=again)

        def commit() -> None:
            try:
                sink.finish()
                if isinstance(sink, UpdateSpool):
                    weight = held.weight.weight
                    state.commit(session, sink, weight, dict(header.metrics))
            except BaseException:
                self.held.forget(held)
                state.abandon(session.site)
                self.coordinator.transfers.settle(discarded=held.offset)
                self.held.lost(held)
                raise
            finally:
                if isinstance(sink, UpdateSpool):
                    sink.close()
            self.held.forget(held)
            self.coordinator.transfers.settle(accepted=held.offset)

        async for chunk in self._chunks(session, header, request_iterator):
            with meter.on_server():  # the pool's queue is not the site's silence
                await self._run(journal, chunk)
        if not lane.done:
            # gRPC may end a cut stream's requests as if the site had closed them, so an
            # upload that ends short is kept for a resume, like one that broke off.
            raise EndedEarly(
                f"site {session.site!r}, round {header.round}: the upload's stream ended "
                f"early, after {lane.received} of its {lane.end - lane.start} bytes "
                f"({sink.bytes_received} of the update's {sink.expected_bytes} held); the "
                f"server keeps them for upload_grace_s ({self.held.grace_s:g}s): resume the "
                "upload to send the rest"
            )

        def finish() -> bool:  # one trip to the pool for the last range and the fold
            if not held.finish(lane, generation):
                return False  # the other streams' ranges are still on their way
            commit()
            return True

        with meter.on_server():
            return await self._run(finish)

    async def _chunks(
        self,
        session: Session,
        header: pb.UploadHeader,
        request_iterator: AsyncIterator[pb.UpdateChunk | Chunk],
    ) -> AsyncIterator[Chunk]:
        """The chunks after an upload's header (counted as received); a second header is refused."""
        async for message in request_iterator:
            chunk = wire.stream_chunk(message)
            if chunk is None:
                raise UploadRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"site {session.site!r}, round {header.round}: a second header in one upload",
                )
            self.coordinator.transfers.add(received=len(chunk.data))
            session.bytes_received += len(chunk.data)
            session.touch()
            yield chunk

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        session: Session,
        server_round: int,
        code: grpc.StatusCode,
        message: str,
    ) -> NoReturn:
        log.warning("upload refused: %s", message)
        self.audit.record(
            "upload_rejected", site=session.site, round=server_round, code=code.name, reason=message
        )
        await abort(context, code, message)


def _reject(reason: str, retry_after_s: float = 0.0) -> pb.ServerMessage:
    return pb.ServerMessage(reject=pb.Reject(reason=reason, retry_after_s=retry_after_s))


async def _end_cut_stream(
    context: grpc.aio.ServicerContext,
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
) -> NoReturn:
    """End a stream whose handler was cancelled with a status the peer can read (a
    cancelled handler alone leaves a peer that can still hear the server waiting)."""
    task = asyncio.current_task()
    while task is not None and task.uncancel():
        pass
    await abort(context, code, message)


def generic_handler(servicer: FedtrainServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with model chunks serialized without protobuf's extra copy."""
    handlers = {
        "Control": grpc.stream_stream_rpc_method_handler(
            servicer.Control,
            request_deserializer=pb.SiteMessage.FromString,
            response_serializer=wire.serialize_stream_item,  # an instruction with its model
        ),
        "DownloadModel": grpc.unary_stream_rpc_method_handler(
            servicer.DownloadModel,
            request_deserializer=pb.ModelRequest.FromString,
            response_serializer=wire.serialize_stream_item,
        ),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            servicer.UploadUpdate,
            request_deserializer=wire.chunk_stream_deserializer(pb.UpdateChunk),
            response_serializer=pb.UploadReceipt.SerializeToString,
        ),
        "Status": servicer.status.method(),
    }
    return grpc.method_handlers_generic_handler(wire.SERVICE, handlers)
