"""The site daemon: dial out, join, and train whenever the server pushes an instruction.

One control stream carries the join, heartbeats (a timer thread: liveness, not a
poll for work) and errors up, and instructions down. Work runs on a trainer thread
so the control stream stays responsive: download the global model (skipped when
the version is cached), train with the task, upload the delta in chunks. Anything
that breaks the connection sends the daemon back to reconnecting with exponential
backoff and jitter, forever, until `stop()` (SIGTERM/SIGINT in the CLI); a server
that restarts with `--resume` is simply rejoined. After a broken control stream the
daemon asks the server to continue its session (Join.resume_token): if the server
kept it (`heartbeat.grace_s`), the round in progress goes on, and a transfer that
broke off continues on the new connection, an upload from the offset the server
holds. When the server says the run is complete the site waits for its next run,
or, with `exit_when_done`, leaves (for scripts, CI and Kubernetes Jobs).

A site with `devices`/`nproc` (or launched by torchrun) trains on a DDP worker group
instead of in this process (see `workers.py`). The group is started before the
first join and kept across rounds and reconnects, because starting workers costs
seconds per round otherwise; a failed group round fails that round only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from fedtrain.compression import Codec, downlink
from fedtrain.compression.settings import CompressionSettings, DownloadSettings
from fedtrain.config import from_dict
from fedtrain.errors import (
    ConfigError,
    FedtrainError,
    ProtocolError,
    SecAggError,
    WorkerGroupError,
)
from fedtrain.evaluation import (
    EVALUATE_CAPABILITY,
    SHARE_LOCAL_MODEL_CAPABILITY,
    check_eval_result,
)
from fedtrain.parallel import TorchrunGroup
from fedtrain.personalize import epochs_to_spend, personalized_evaluation, with_personalized
from fedtrain.runtime import rpc, secagg_identity, tls, wire
from fedtrain.runtime.config import FILE_SOURCES, SiteConfig
from fedtrain.runtime.peer_auth import ClientIdentity, client_identity, dialled_host
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.site.data import site_data
from fedtrain.runtime.site.model_download import DigestMismatch, receive_inline, receive_model
from fedtrain.runtime.site.outage_watch import DIAL_TIMEOUT_S, OutageWatch
from fedtrain.runtime.site.secagg import RoundSuperseded, SiteSecAgg
from fedtrain.runtime.site.streams import (
    PARALLEL_CHUNK_BYTES,
    PROBE_MIN_BYTES,
    CallSwitch,
    RangeCutter,
    SharedUpload,
    StreamCount,
    StreamMemory,
    UpdateChunks,
    chunk_positions,
    completed,
    merged,
    run_ranges,
)
from fedtrain.runtime.site.workers import train_timeout_s, worker_group
from fedtrain.strategy import RoundConfig, compute_delta
from fedtrain.task import (
    EvalResult,
    Task,
    TaskContext,
    TrainResult,
    federated_names,
    load_task,
    model_for,
    resolve_device,
    task_fingerprint,
)
from fedtrain.tensors import (
    Chunk,
    ModelState,
    chunk_values,
    select,
    torch_dtype,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

CAPABILITIES = ("train", wire.SECAGG_CAPABILITY, wire.INLINE_MODEL_CAPABILITY)
#: gRPC codes of a transfer whose stream or link failed (not refused): it is resumed
#: once the session's link is up again, until the round's deadline.
BROKEN_LINK = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def _link_broke(exc: Exception) -> bool:
    """A transfer failed because the link did: a broken stream, or the session's channel
    closed under it (a transfer can break before the control stream notices; the retry
    then meets the channel the control stream's end closed: grpc's ValueError)."""
    if isinstance(exc, grpc.RpcError):
        return exc.code() in BROKEN_LINK
    return isinstance(exc, ValueError) and "channel closed" in str(exc).lower()


#: Pause before a broken transfer is tried again on a link that looks up.
RESUME_PAUSE_S = 0.5
#: How long a stopping daemon waits for the server to end the control stream after it
#: said it is leaving (one round trip on a live link).
LEAVE_S = 2.0
#: How long a daemon that rejoins its session on a new connection (`OutageWatch`)
#: waits for the server to end the old control stream (a stalled link: it never does).
RECONNECT_S = 1.0
#: How long a stopping daemon waits for a job in flight to notice. A round training in
#: this process cannot be interrupted, and its update is lost either way (the server
#: counts this site as a dropout), so the daemon does not wait for it to finish.
TRAINER_GRACE_S = 0.5


class JoinRefused(FedtrainError):
    """The server refused this site (allow-list, fingerprint, protocol version, ...).

    `retry_after_s > 0` marks a temporary refusal (the server is at capacity): the site
    then waits at least that long, so thousands of refused sites cannot hammer it."""

    def __init__(self, reason: str, retry_after_s: float = 0.0) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class Backoff:
    """Exponential reconnect delays with full jitter between min_s and the current cap.

    The jitter is deliberately unseeded: its job is to keep many sites that lost the
    same server from reconnecting in lockstep.
    """

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._cap = min_s
        self._rng = np.random.default_rng()

    def next(self, at_least_s: float = 0.0) -> float:
        """The next delay; with `at_least_s` (a server's retry-after hint), that long plus
        up to half as much again of jitter, if that is longer."""
        delay = float(self._rng.uniform(self.min_s, self._cap))
        self._cap = min(self.max_s, self._cap * 2)
        if at_least_s > delay:
            delay = float(self._rng.uniform(at_least_s, 1.5 * at_least_s))
        return delay

    def reset(self) -> None:
        self._cap = self.min_s


@dataclass
class StreamConnection:
    """A parallel stream's connection: its channel, what closes it, and whether it may
    still carry the session's transfers."""

    channel: grpc.Channel
    close: Callable[[], None] = lambda: None
    alive: Callable[[], bool] = lambda: True


@dataclass(eq=False)
class Link:
    """One joined session: its channel, token and the queue that feeds the control stream."""

    channel: grpc.Channel
    token: str
    run_id: str
    chunk_bytes: int
    outbox: queue.SimpleQueue[pb.SiteMessage | None]
    closed: threading.Event = field(default_factory=threading.Event)
    #: The server's update codec (told in Welcome); `Codec()` sends plain deltas.
    codec: Codec = field(default_factory=Codec)
    #: The codec model downloads may be encoded with (told in Welcome); None: the
    #: server sends the model in its own dtypes.
    download_codec: Codec | None = None
    #: Seconds between heartbeats: told in Welcome, lengthened by Pace as sites join.
    heartbeat_interval_s: float = 5.0
    #: How long the server keeps the session when its link fails (Welcome.grace_s).
    grace_s: float = 0.0
    #: Set while a control stream serves the session; cleared while the link is down
    #: and the daemon tries to rejoin it (Join.resume_token), so that transfers wait.
    up: threading.Event = field(default_factory=threading.Event)
    #: Makes a connection of its own for a parallel stream (`StreamConnection`).
    dial: Callable[[Link], StreamConnection] | None = None
    #: The parallel streams' connections beyond the control stream's (`stream_channel`;
    #: None: not dialled yet).
    extra_channels: list[StreamConnection | None] = field(default_factory=list)
    #: The connections of transfers on connections of their own (`own_connection`).
    _own: dict[int, StreamConnection] = field(default_factory=dict)
    _channels_lock: threading.Lock = field(default_factory=threading.Lock)
    #: One per parallel stream: its connection is dialled once, beside the others' (a
    #: count grown from 16 to 64 dials 48 at once, not one TLS join after another).
    _dial_locks: dict[int, threading.Lock] = field(default_factory=dict)

    def stream_channel(self, number: int) -> grpc.Channel:
        """The channel of parallel stream `number`: the control stream's for 0, else one
        of its own, dialled at first use and kept for the session (its connection's
        congestion window then carries over from one transfer to the next). One whose
        session stream ended (with TLS: its connection was lost) is dialled again; one
        that cannot be dialled is the control stream's (the stream then shares it)."""
        if number == 0 or self.dial is None:
            return self.channel
        with self._channels_lock:
            while len(self.extra_channels) < number:
                self.extra_channels.append(None)
            dialling = self._dial_locks.setdefault(number, threading.Lock())
        with dialling:
            with self._channels_lock:
                held = self.extra_channels
                connection = held[number - 1] if len(held) >= number else None
            if connection is not None and connection.alive():
                return connection.channel
            if connection is not None:
                _close_soon(connection.close)
            connection = self._dial()
            with self._channels_lock:
                if len(self.extra_channels) < number:  # the session's were closed meanwhile
                    connection.close()
                    return self.channel
                self.extra_channels[number - 1] = connection
            return connection.channel

    def _dial(self) -> StreamConnection:
        assert self.dial is not None
        try:
            return self.dial(self)
        except (grpc.RpcError, FedtrainError) as exc:
            log.warning("a parallel stream shares the control connection: %s", exc)
            return StreamConnection(self.channel)

    @contextlib.contextmanager
    def own_connection(self) -> Iterator[Callable[[int], grpc.Channel]]:
        """Channels for one transfer on a connection of its own, closed after it
        (Instruction.own_upload_connection): each call, i.e. each attempt after an
        outage, dials a fresh connection and closes the one before."""
        held: list[StreamConnection] = []

        def channel(number: int) -> grpc.Channel:
            release()
            if self.dial is None:
                return self.channel
            connection = self._dial()
            held.append(connection)
            with self._channels_lock:
                self._own[id(connection)] = connection
            return connection.channel

        def release() -> None:
            while held:
                connection = held.pop()
                with self._channels_lock:
                    self._own.pop(id(connection), None)
                _close_soon(connection.close)

        try:
            yield channel
        finally:
            release()

    def close_channels(self) -> None:
        """Close the parallel streams' connections (they are dialled again when needed)
        and those of transfers on connections of their own (their next try dials anew)."""
        with self._channels_lock:
            connections, self.extra_channels = self.extra_channels, []
            connections += self._own.values()
        for connection in connections:
            if connection is not None:
                _close_soon(connection.close)

    def report(self, server_round: int, message: str) -> None:
        """Tell the server this round failed here, so it need not wait for the deadline."""
        if not self.closed.is_set():
            self.outbox.put(pb.SiteMessage(error=pb.SiteError(round=server_round, message=message)))


class SiteDaemon:
    """A site's long-running client; `run()` blocks until `stop()`."""

    def __init__(
        self,
        config: SiteConfig,
        *,
        insecure: bool = False,
        task: Task | None = None,
        data: Dataset | None = None,
    ) -> None:
        self.config = config
        self.insecure = insecure
        #: With TLS: the certificate and key that answer the server's challenge at join.
        self._identity: ClientIdentity | None = None
        self.name = site_name(config, insecure=insecure)
        #: This site's secure-aggregation rounds; with TLS, its keys are bound to its
        #: certificate (`fedtrain.runtime.secagg_identity`).
        self.secagg = SiteSecAgg()
        if insecure:
            log.warning("connecting WITHOUT TLS (--insecure): use this only for local tests")
        else:
            ca, cert, key = config.tls.require("site.toml")
            self._identity = client_identity(cert, key, ca)
            self.secagg = SiteSecAgg(
                identity=secagg_identity.load_identity(cert, key),
                verifier=secagg_identity.CertificateVerifier.from_file(ca),
                require_consistency_check=config.require_consistency_check,
            )
        self.task = task or load_task(config.task, config.task_options)
        #: DDP workers that train every round, kept across rounds and reconnects (started
        #: by `run()`); None: the daemon trains in its own process.
        self.group = worker_group(config, self.name)
        if self.group is not None and (task is not None or data is not None):
            raise ConfigError(
                "this site trains in worker processes (devices/nproc/torchrun), which build "
                "the task and data from site.toml: pass neither task= nor data="
            )
        #: Set when the server said its run is complete; with `exit_when_done` the
        #: daemon then stops, and connection failures after it are no news.
        self.run_complete = False
        #: Set when the site cannot train any more (a torchrun group broke): `run()`
        #: returns and the CLI exits non-zero, so torchrun can restart the site.
        self.fatal: str | None = None
        #: Per direction, where the automatic count of parallel streams starts.
        self._streams = StreamMemory()
        self.device = resolve_device(config.device)
        # With a worker group the ranks hold the data and the model, not the daemon.
        self.data: Dataset | None = None
        #: The held-out set (data.eval_path / eval_fraction / the hook's SiteData.test):
        #: the server's EVALUATE instructions are answered on it.
        self.eval_data: Dataset | None = None
        self.model: nn.Module | None = None
        if self.group is None:
            if data is None:
                log.info("building this site's training data (%s)", _data_source(config))
                mine = site_data(self.task, config.data, self.name)
                self.data, self.eval_data = mine.train, mine.test
            else:
                self.data = data
            self.model = model_for(self.task, config.seed).to(self.device)
        # Over the model this site trains: its frozen base (if any) is what must match.
        self.fingerprint = task_fingerprint(
            self.task, self.model if self.model is not None else model_for(self.task, config.seed)
        )
        #: The tensors that travel (None: all of them; see `Task.federated`).
        self.federated = None if self.model is None else federated_names(self.task, self.model)
        self.context = TaskContext(device=self.device, client_id=self.name, seed=config.seed)
        #: Models received (downloaded, or inside their instruction); cache hits are not.
        self.downloads = 0
        #: Of those, the models that came inside their instruction (no download call).
        self.inline_models = 0
        self.rounds_trained = 0
        self._cache: tuple[str, ModelState] | None = None
        #: The cached version when it is the server's reference model of that version
        #: (from a delta download): the next download may then be only the change.
        self._reference = ""
        #: ((model version, personalization epochs), its held-out metrics): a version
        #: is evaluated once.
        self._evaluated: tuple[tuple[str, int], EvalResult] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _call, which stop() ends from any thread
        self._call: grpc.Call | None = None
        self._call_began = 0.0  # when _call was made (time.monotonic)
        #: Set to end a reconnect's back-off early (the link is back; the daemon stops).
        self._reconnect_now = threading.Event()
        #: Set while the control stream is ended to rejoin on a new connection.
        self._replacing = threading.Event()
        self._outbox: queue.SimpleQueue[pb.SiteMessage | None] | None = None
        #: The next TRAIN and the next EVALUATE not yet started, each replaced by a newer
        #: one of its kind (under FedBuff an evaluation arrives while a job is pending).
        self._jobs: dict[int, tuple[Link, pb.Instruction]] = {}
        self._job_ready = threading.Condition()
        # the codec the server asked for, kept across reconnects (top-k's residual)
        self._compression: tuple[CompressionSettings, Codec] | None = None
        #: The session whose control stream broke: the next Join asks to continue it.
        self._away: Link | None = None
        #: The last instruction received (serialized): a repeat of it is not work.
        self._instructed = b""
        #: Replaces the session's connections when an outage left them backing off.
        self.outages = OutageWatch(self._dial_server, self._replace_connections)

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Start the worker group (if any), join and serve instructions; reconnect with
        backoff until `stop()`. The group is closed on the way out, however it goes."""
        if self.group is not None:
            try:
                self.group.start()  # before joining: a site that cannot train stays away
            except BaseException as exc:
                self._close_group()
                if isinstance(exc, WorkerGroupError):
                    raise WorkerGroupError(
                        f"site {self.name!r} cannot train: {exc}", exc.failures, restarting=False
                    ) from None
                raise
        trainer = threading.Thread(target=self._train_loop, name="fedtrain-trainer", daemon=True)
        trainer.start()
        backoff = Backoff(self.config.reconnect.min_s, self.config.reconnect.max_s)
        last_failure = ""
        log.info(
            "connecting to the server at %s (%s)",
            self.config.server,
            "no TLS" if self.insecure else "mutual TLS",
        )
        try:
            while not self._stop.is_set():
                retry_after = 0.0
                try:
                    self._session(backoff)
                    last_failure = ""
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        break
                    failure = rpc.describe_rpc_error(exc)
                    # Warn once per kind of failure; a server that stays down is one story,
                    # and one that went away after completing its run is no news at all.
                    quiet = failure == last_failure or self.run_complete
                    level = logging.INFO if quiet else logging.WARNING
                    log.log(level, "connection to %s failed: %s", self.config.server, failure)
                    last_failure = failure
                except JoinRefused as exc:
                    retry_after = exc.retry_after_s
                    if retry_after:
                        log.warning("the server cannot take this site now: %s", exc)
                    else:
                        log.error("the server refused this site: %s", exc)
                except FedtrainError as exc:  # e.g. the server broke the protocol
                    log.error("session with %s failed: %s", self.config.server, exc)
                if self._stop.is_set():
                    break
                delay = backoff.next(retry_after)
                log.info("reconnecting to %s in %.1fs", self.config.server, delay)
                self._reconnect_now.wait(delay)
                self._reconnect_now.clear()
        finally:
            self.stop()
            self._close_group()  # first: it cuts a round in training short
            trainer.join(timeout=TRAINER_GRACE_S)
        log.info("site %r stopped", self.name)

    def _close_group(self) -> None:
        """Stop every worker; on the way out, so a failure is logged, not raised."""
        if self.group is None:
            return
        try:
            self.group.close()
        except Exception as exc:  # e.g. a torchrun peer already gone: nothing left to tell
            log.warning("closing the worker group: %s: %s", type(exc).__name__, exc)

    def stop(self) -> None:
        """Leave: cancel the control stream and end the threads (idempotent, signal-safe)."""
        self._stop.set()
        self._reconnect_now.set()
        away = self._away
        if away is not None:
            away.closed.set()
            away.up.set()
        with self._lock:
            call, outbox = self._call, self._outbox
            self._call = None
        if call is not None and outbox is not None:
            # a site that stops on purpose is dropped at once, not kept for the grace
            _end_stream(call, outbox, pb.Heartbeat(leaving=True), LEAVE_S)
        with self._job_ready:
            self._job_ready.notify_all()
        self.secagg.close("the site is stopping")

    # -- the control stream ------------------------------------------------------------------
    def _channel(self) -> grpc.Channel:
        options = wire.site_channel_options(self.config.max_message_bytes)
        if self._identity is None:
            return grpc.insecure_channel(self.config.server, options=options)
        if self.config.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.config.tls.server_name))
        return grpc.secure_channel(self.config.server, self._identity.credentials, options=options)

    def _dial_server(self, timeout_s: float) -> bool:
        """Whether a new connection reaches the server within `timeout_s` (with TLS:
        its handshake done). It is closed at once; the server sees no call."""
        channel = self._channel()
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            return True
        except grpc.FutureTimeoutError:
            return False
        finally:
            _close_soon(channel.close)

    def _replace_connections(self, since: float) -> bool:
        """The link is back after an outage, and the transfers, stalled since `since`,
        still do not move (`OutageWatch`): end the control stream, if it carried them,
        as if its link broke (the daemon rejoins its session on a new connection, and
        the transfers continue on it); a reconnect waiting out its back-off goes now.
        Whether the session's connections were replaced."""
        with self._lock:
            call, outbox, began = self._call, self._outbox, self._call_began
        if self._stop.is_set():
            return False
        if call is None:  # a reconnect waits out its back-off: the link is back, go now
            self._reconnect_now.set()
            return False
        if began > since:  # dialled since they stalled
            if self._away is not None and time.monotonic() - began > DIAL_TIMEOUT_S:
                # a rejoin dialled during the outage, its connection attempt backed off
                # (a join takes a few round trips): dial again now
                log.info("the link to the server is back; rejoining on a new connection")
                self._replacing.set()
                call.cancel()
            return False
        if outbox is None:
            return False
        log.warning(
            "the link to the server is back, but this site's transfers still do not move "
            "after the outage (their connections wait out TCP's backed-off retransmission "
            "timer); rejoining the session on new connections, and continuing the "
            "transfers where the server holds them"
        )
        self._replacing.set()
        _end_stream(call, outbox, pb.Heartbeat(reconnecting=True), RECONNECT_S)
        return True

    def _dial_stream(self, link: Link) -> StreamConnection:
        """A connection of its own for one of `link`'s parallel streams. With TLS the
        server takes bulk requests only on connections that proved the session's
        certificate: this one joins the session first (Join.attach_to) and keeps that
        stream open while it is used."""
        channel = self._channel()
        if self._identity is None:
            return StreamConnection(channel, channel.close)
        outbox: queue.SimpleQueue[pb.SiteMessage | None] = queue.SimpleQueue()
        control = channel.stream_stream(
            wire.method_path("Control"),
            request_serializer=pb.SiteMessage.SerializeToString,
            response_deserializer=pb.ServerMessage.FromString,
        )
        call = control(_drain(outbox))

        def close() -> None:
            outbox.put(None)
            call.cancel()
            channel.close()

        try:
            for message in call:
                kind = message.WhichOneof("kind")
                if kind == "challenge":
                    outbox.put(self._join_message(message.challenge, attach_to=link.token))
                elif kind == "welcome":
                    return StreamConnection(channel, close, lambda: not call.done())
                elif kind == "reject":
                    raise JoinRefused(message.reject.reason)
            raise ProtocolError("the server closed a parallel stream's connection at once")
        except BaseException:
            close()
            raise

    def _join_message(
        self, challenge: pb.Challenge | None = None, attach_to: str = ""
    ) -> pb.SiteMessage:
        """The Join; with TLS it answers the server's challenge with this site's proof.
        With `attach_to`: the Join of a parallel stream's connection to that session."""
        cached = self._cache[0] if self._cache is not None else ""
        join = pb.Join(
            site_name=self.name if (self.insecure or self.config.name) else "",
            task_fingerprint=self.fingerprint,
            protocol_version=wire.PROTOCOL_VERSION,
            capabilities=self.capabilities,
            cached_model_version=cached,
            resume_token="" if attach_to or self._away is None else self._away.token,
            attach_to=attach_to,
        )
        if challenge is not None and self._identity is not None:
            server_name = self.config.tls.server_name or dialled_host(self.config.server)
            join.proof.CopyFrom(self._identity.proof("join", challenge.nonce, server_name))
        return pb.SiteMessage(join=join)

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What this site tells the server it can do: the download encodings it accepts
        (`download_codecs`); `evaluate` only with a held-out set in this process (a
        worker-group site does not evaluate yet); `share_local_model` when it consents
        to cross-site validation of its local model."""
        downloads = tuple(downlink.capability(c) for c in self.config.download_codecs)
        consent = (SHARE_LOCAL_MODEL_CAPABILITY,) if self.config.share_local_model else ()
        if self.eval_data is None or self.group is not None:
            return (*CAPABILITIES, *consent, *downloads)
        return (*CAPABILITIES, EVALUATE_CAPABILITY, *consent, *downloads)

    def _session(self, backoff: Backoff) -> None:
        """One connection: join, then dispatch server messages until the stream ends."""
        self._replacing.clear()
        channel = self._channel()
        outbox: queue.SimpleQueue[pb.SiteMessage | None] = queue.SimpleQueue()
        if self._identity is None:
            outbox.put(self._join_message())  # with TLS: once the server's challenge is in
        control = channel.stream_stream(
            wire.method_path("Control"),
            request_serializer=pb.SiteMessage.SerializeToString,
            response_deserializer=pb.ServerMessage.FromString,
        )
        call = control(_drain(outbox))
        with self._lock:
            self._call, self._outbox, self._call_began = call, outbox, time.monotonic()
        if self._stop.is_set():
            call.cancel()
        link: Link | None = None
        broke = False
        try:
            for message in call:
                self.outages.heard()
                kind = message.WhichOneof("kind")
                if kind == "challenge":
                    if self._identity is None or link is not None:
                        raise ProtocolError("the server sent an unexpected challenge")
                    outbox.put(self._join_message(message.challenge))
                elif kind == "welcome":
                    link = self._welcome(channel, outbox, message.welcome)
                    backoff.reset()
                elif kind == "instruction":
                    if link is None:
                        raise ProtocolError("the server sent an instruction before Welcome")
                    self._submit(link, message.instruction)
                elif kind == "secagg":
                    if link is None:
                        raise ProtocolError(
                            "the server sent a secure-aggregation stage before Welcome"
                        )
                    self.secagg.handle(link, message.secagg)
                elif kind == "pace":
                    if link is not None and message.pace.heartbeat_interval_s > 0:
                        link.heartbeat_interval_s = message.pace.heartbeat_interval_s
                elif kind == "reject":
                    raise JoinRefused(message.reject.reason, message.reject.retry_after_s)
                elif kind == "shutdown":
                    self._shutdown(message.shutdown.reason)
                    return
                else:
                    log.warning("ignoring a %s message this site does not handle", kind)
            if not self._replacing.is_set():
                log.info("the server ended the control stream")
        except grpc.RpcError:
            broke = not self._stop.is_set()
            if not self._replacing.is_set():
                raise
        finally:
            if self._replacing.is_set():  # ended to rejoin on a new connection: now
                self._replacing.clear()
                broke = not self._stop.is_set()
                self._reconnect_now.set()
            if link is not None and broke:  # an outage, maybe: try to continue it
                link.up.clear()
                self._away = link
                log.warning(
                    "the control stream broke; rejoining the session (the server keeps it for %gs)",
                    link.grace_s,
                )
            elif link is not None:
                self._end_link(link)
            outbox.put(None)
            call.cancel()
            _close_soon(channel.close)
            with self._lock:
                self._call = self._outbox = None

    def _shutdown(self, reason: str) -> None:
        """The server ended the session on purpose; a complete run may end the daemon."""
        if reason != wire.RUN_COMPLETE:
            log.info("the server closed the session: %s", reason)
            return
        self.run_complete = True
        if self.config.exit_when_done:
            log.info("the server's run is complete; exiting (exit_when_done)")
            self.stop()
        else:
            log.info(
                "the server's run is complete; waiting for its next run (set "
                "exit_when_done = true in site.toml, or pass --exit-when-done, to exit instead)"
            )

    def _welcome(
        self, channel: grpc.Channel, outbox: queue.SimpleQueue[pb.SiteMessage | None], w: pb.Welcome
    ) -> Link:
        if self.config.require_secagg and not w.secagg:
            raise SecAggError(
                "this site requires secure aggregation (require_secagg = true in site.toml), "
                f"but the server at {self.config.server} (run {w.run_id}) does not run it; "
                "refusing to train for it. The server operator must enable [secagg] in "
                "server.toml"
            )
        away, self._away = self._away, None
        if away is not None and w.resumed and w.session_token == away.token:
            away.channel, away.outbox = channel, outbox
            away.close_channels()  # their connections failed too: dialled (and proven) anew
            away.heartbeat_interval_s = w.heartbeat_interval_s
            away.up.set()  # transfers waiting for the link continue on the new channel
            log.info("site %r rejoined its session of run %s", w.site_name, w.run_id)
            return away
        if away is not None:
            log.warning("the server did not keep this site's session; work in flight is lost")
            self._end_link(away)
        link = Link(channel, w.session_token, w.run_id, int(w.chunk_bytes), outbox)
        link.dial = self._dial_stream
        link.codec = self._codec(w)
        link.download_codec = self._download_codec(w)
        link.heartbeat_interval_s = w.heartbeat_interval_s
        link.grace_s = w.grace_s
        link.up.set()
        self.run_complete = False  # a new run, or the same one resumed
        log.info("site %r joined run %s", w.site_name, w.run_id)
        threading.Thread(
            target=_heartbeat,
            args=(link,),
            name="fedtrain-heartbeat",
            daemon=True,
        ).start()
        return link

    def _end_link(self, link: Link) -> None:
        """The session is over for good: transfers waiting for it give up."""
        link.closed.set()
        link.up.set()  # wake waiters; they see `closed`
        link.close_channels()
        self.secagg.close("the session ended")

    def _codec(self, w: pb.Welcome) -> Codec:
        """The codec the server asks for; the same object as before if nothing changed,
        so that top-k's error-feedback residual survives a reconnect."""
        settings = from_dict(
            CompressionSettings, dict(wire.config_from_proto(w.compression)), "compression"
        )
        if self._compression is None or self._compression[0] != settings:
            self._compression = (settings, settings.build())
            if settings.enabled:
                log.info("the server asks for updates encoded with %s", settings.codec)
        return self._compression[1]

    def _download_codec(self, w: pb.Welcome) -> Codec | None:
        """The codec the server encodes this site's downloads with; it must be one this
        site announced (`download_codecs`), or the server broke the negotiation."""
        if not w.download:
            return None
        settings = from_dict(DownloadSettings, dict(wire.config_from_proto(w.download)), "download")
        wanted = downlink.required_capabilities(settings.codec, settings.delta)
        if not wanted <= set(self.capabilities):
            raise ProtocolError(
                f"the server encodes downloads with {settings.codec} (delta = "
                f"{settings.delta}), which this site did not accept (download_codecs = "
                f"{self.config.download_codecs} in site.toml)"
            )
        log.info(
            "the server sends the model encoded with %s%s",
            settings.codec,
            " (changes from the version this site holds)" if settings.delta else "",
        )
        return settings.build()

    # -- work ----------------------------------------------------------------------------------
    def _submit(self, link: Link, instruction: pb.Instruction) -> None:
        """Hand an instruction to the trainer; a newer one replaces one not yet started.
        One the site has already (the server repeats it after a rejoin) is ignored."""
        key = instruction.SerializeToString(deterministic=True)
        if key == self._instructed:
            log.debug("round %d: instruction already in hand", instruction.round)
            return
        self._instructed = key
        evaluate = instruction.kind == pb.EVALUATE
        if not (
            instruction.kind == pb.TRAIN or (evaluate and EVALUATE_CAPABILITY in self.capabilities)
        ):
            log.warning(
                "ignoring a %s instruction (this site does not do it)",
                pb.InstructionKind.Name(instruction.kind),
            )
            return
        if instruction.secagg:
            self.secagg.expect(instruction)  # its stage messages follow on this stream
        elif self.config.require_secagg:
            asked, refused = (
                ("a plain evaluation report", "evaluate")
                if evaluate
                else ("a plain update", "train")
            )
            refusal = (
                f"round {instruction.round}: the server asks for {asked}, but this site "
                f"requires secure aggregation (require_secagg = true); refusing to {refused}"
            )
            log.error("%s", refusal)
            link.report(instruction.round, refusal)
            return
        with self._job_ready:
            self._jobs[instruction.kind] = (link, instruction)
            self._job_ready.notify()

    def _train_loop(self) -> None:
        while True:
            with self._job_ready:
                while not self._jobs and not self._stop.is_set():
                    self._job_ready.wait()
                if self._stop.is_set():
                    return
                # an evaluation first: it is short, and the server waits for it
                kind = pb.EVALUATE if pb.EVALUATE in self._jobs else pb.TRAIN
                link, instruction = self._jobs.pop(kind)
            if instruction.kind != pb.EVALUATE:
                self._run_instruction(link, instruction)
            elif instruction.deadline_unix and time.time() > instruction.deadline_unix:
                log.info(
                    "round %d: evaluation not started: its deadline passed while this site "
                    "trained (the server has closed it)",
                    instruction.round,
                )
            else:
                self._run_evaluation(link, instruction)

    def _run_instruction(self, link: Link, instruction: pb.Instruction) -> None:
        server_round = instruction.round
        if link.closed.is_set():
            return
        try:
            clock = _PhaseClock()
            deadline = instruction.deadline_unix
            global_state = self.fetch_model(
                link, instruction.model_version, deadline, inline=instruction.model
            )
            clock.mark("model")
            config = wire.config_from_proto(instruction.config)
            local, result = self._train(global_state, config, instruction.deadline_unix)
            clock.mark("train")
            if instruction.secagg:  # the update leaves the site only masked
                header, chunks = self.secagg.masked_update(
                    link, instruction, local, global_state, result
                )
            else:
                header = _plain_header(link, instruction, result)
                chunks = update_chunks(link, local, global_state)
                header.codec = link.codec.name
            receipt = self._upload(
                link, header, chunks, deadline, own_connection=instruction.own_upload_connection
            )
            clock.mark("upload")
            if receipt.notice:  # the server's weight policy clipped this site's weight
                log.warning("round %d: the server says: %s", server_round, receipt.notice)
            self.rounds_trained += 1
            log.info(
                "round %d: trained on %d examples, uploaded %d bytes (%s)",
                server_round,
                result.num_examples,
                receipt.bytes_received,
                clock,
            )
        except grpc.RpcError as exc:
            if link.closed.is_set() or self._stop.is_set():
                log.info("round %d abandoned: the session ended", server_round)
                return
            log.warning(
                "round %d: the server refused or lost the transfer: %s",
                server_round,
                rpc.describe_rpc_error(exc),
            )
            link.report(server_round, rpc.describe_rpc_error(exc))
        except RoundSuperseded as exc:
            log.info("round %d abandoned: %s", server_round, exc)
        except WorkerGroupError as exc:  # the ranks' tracebacks are logged already
            if self._stop.is_set():
                log.info("round %d abandoned: the site is stopping", server_round)
                return
            log.error("round %d failed at site %r: %s", server_round, self.name, exc)
            link.report(server_round, f"{type(exc).__name__}: {exc}")
            if isinstance(self.group, TorchrunGroup):  # it cannot restart its own ranks
                self.fatal = f"round {server_round}: {exc}"
                self.stop()
        except Exception as exc:  # the task's code may raise anything; the daemon survives it
            log.exception("round %d failed at this site", server_round)
            link.report(server_round, f"{type(exc).__name__}: {exc}")

    def _run_evaluation(self, link: Link, instruction: pb.Instruction) -> None:
        """Answer an EVALUATE: the model version on the held-out set, as an EvalReport on
        the control stream. A failure is reported (the server leaves this site out of the
        round's evaluation); it never ends the daemon."""
        server_round = instruction.round
        if link.closed.is_set():
            return
        try:
            global_state = self.fetch_model(
                link, instruction.model_version, inline=instruction.model
            )
            assert self.model is not None
            global_state.load_into(self.model, self.federated)
            ev = self._held_out(
                wire.config_from_proto(instruction.config), instruction.model_version, server_round
            )
            assert ev is not None  # the capability is advertised only with a held-out set
            check_eval_result(ev, f"site {self.name!r}, round {server_round}")
            if instruction.secagg:  # the evaluation leaves the site only masked
                self.secagg.send_masked_evaluation(link, instruction, ev)
                return
            report = pb.EvalReport(
                round=server_round,
                model_version=instruction.model_version,
                num_examples=ev.num_examples,
                loss=ev.loss,
                metrics={k: float(v) for k, v in ev.metrics.items()},
            )
            if not link.closed.is_set():
                link.outbox.put(pb.SiteMessage(evaluation=report))
        except grpc.RpcError as exc:
            if link.closed.is_set() or self._stop.is_set():
                return
            log.warning("round %d: evaluation: model download failed: %s", server_round, exc)
            link.report(server_round, f"evaluation: {rpc.describe_rpc_error(exc)}")
        except RoundSuperseded as exc:
            log.info("round %d: evaluation abandoned: %s", server_round, exc)
        except Exception as exc:  # the task's code may raise anything; the daemon survives it
            log.exception("round %d: evaluation failed at this site", server_round)
            link.report(server_round, f"evaluation: {type(exc).__name__}: {exc}")

    def _held_out(
        self, config: RoundConfig, version: str, server_round: int = 0
    ) -> EvalResult | None:
        """The loaded model (version `version`) on the held-out set, with its
        personalized figures when `config` asks and the site allows it
        (`fedtrain.personalize`); once per (version, personalization)."""
        if self.eval_data is None or self.model is None:
            return None
        where = f"round {server_round}: evaluation"
        epochs = epochs_to_spend(config, self.config.personalize_max_epochs, where)
        done = self._evaluated
        if done is not None and done[0] == (version, epochs):
            return done[1]
        ev = self.task.evaluate(self.model, self.eval_data, config, self.context)
        log.info(
            "model %s on the held-out set (%d examples): loss %r %s",
            version[:12],
            ev.num_examples,
            ev.loss,
            ev.metrics,
        )
        if epochs:
            assert self.data is not None
            context = replace(self.context, seed=fresh_training_seed())
            mine = personalized_evaluation(
                self.task, self.model, self.data, self.eval_data, config, context, epochs
            )
            log.info(
                "model %s personalized (%d epochs) on the held-out set (%d examples): loss %r %s",
                version[:12],
                epochs,
                mine.num_examples,
                mine.loss,
                mine.metrics,
            )
            ev = with_personalized(ev, mine)
        self._evaluated = ((version, epochs), ev)
        return ev

    def _train(
        self, global_state: ModelState, config: RoundConfig, deadline_unix: float
    ) -> tuple[ModelState, TrainResult]:
        """One round's local training: (trained state, result), in this process or on
        the worker group. The state may be views of the live weights (no copy on the
        CPU); the delta is computed chunk by chunk from it while it streams out."""
        seed = fresh_training_seed()
        if self.group is not None:
            return self.group.train_round(
                global_state, config, timeout_s=train_timeout_s(deadline_unix), seed=seed
            )
        assert self.model is not None and self.data is not None
        global_state.load_into(self.model, self.federated)
        result = self.task.train(self.model, self.data, config, replace(self.context, seed=seed))
        return ModelState(select(self.model.state_dict(), self.federated)), result

    def fetch_model(
        self,
        link: Link,
        version: str,
        deadline_unix: float = 0.0,
        inline: Sequence[pb.ModelPiece] = (),
    ) -> ModelState:
        """The global model of `version`: from the cache, from its instruction (`inline`:
        a small model the server sent inside it), or downloaded in chunks (only the
        change, when the server sends changes and this site holds the reference version
        they start from). With a deadline, a download that breaks off continues on the
        rejoined session from the bytes received (ModelRequest.offset)."""
        cached = self._cache
        if cached is not None and cached[0] == version:
            log.debug("model %s is cached; no download", version[:12])
            return cached[1]
        previous = cached[1] if cached is not None else None
        held = cached[0] if cached is not None and cached[0] == self._reference else ""
        if inline or not held:  # the old version's memory receives the new one
            self._cache = cached = None
            self._reference = ""
        # else it stays untouched, and cached, until a change is added into it: a download
        # that breaks off before leaves the reference for the next one to start from.
        if inline:
            state, reference = receive_inline(version, inline, link.download_codec, previous)
            self.inline_models += 1
            log.debug("model %s came inside its instruction (%d bytes)", version[:12], state.nbytes)
        else:
            try:
                state, reference = self._download(link, version, previous, held, deadline_unix)
            except DigestMismatch as exc:
                self._cache, self._reference = None, ""
                log.warning("%s; downloading it whole", exc)
                state, reference = self._download(link, version, None, "", deadline_unix)
        self._cache = (version, state)
        self._reference = version if reference else ""
        self.downloads += 1
        return state

    def _download(
        self,
        link: Link,
        version: str,
        previous: ModelState | None,
        held: str,
        deadline_unix: float = 0.0,
    ) -> tuple[ModelState, bool]:
        """One download (continued across broken streams until `deadline_unix`): (the
        model, whether it is the server's reference)."""

        def request(
            offset: int, end: int = 0, number: int = 0
        ) -> tuple[pb.Manifest, Iterator[Any]]:
            download = link.stream_channel(number).unary_stream(
                wire.method_path("DownloadModel"),
                request_serializer=pb.ModelRequest.SerializeToString,
                response_deserializer=wire.chunk_stream_deserializer(pb.ModelPiece),
            )
            pieces = download(
                pb.ModelRequest(
                    version=version,
                    session_token=link.token,
                    held_version=held,
                    offset=offset,
                    end=end,
                )
            )
            head = next(pieces, None)
            if head is None or isinstance(head, Chunk) or head.WhichOneof("kind") != "manifest":
                raise ProtocolError("a model download must start with its manifest")
            if head.manifest.model_version != version:
                raise ProtocolError(
                    f"asked for model {version[:12]}, got {head.manifest.model_version[:12]}"
                )
            return head.manifest, pieces

        # Parallel streams (when this link may use them from the start): the first asks
        # for the first chunk's worth, and its manifest says how large the rest is to
        # share out (the model held says how large it will be: a small one goes in one
        # call). Else one plain call, which the automatic count may cut for ranges.
        expected = previous.nbytes if previous is not None else PROBE_MIN_BYTES
        plan = self._stream_plan(link, expected, "down")
        first_end = min(link.chunk_bytes, PARALLEL_CHUNK_BYTES) if plan.parallel else 0
        if deadline_unix:
            manifest, pieces = self._through_outages(
                link, deadline_unix, "download", lambda: request(0, first_end)
            )
        else:
            manifest, pieces = request(0, first_end)
        total = manifest.total_bytes
        if first_end and total <= first_end:  # all of it in the first range's call
            count = StreamCount.fixed(1)
        else:
            count = self._stream_plan(link, total, "down")
        if first_end and count.parallel:
            cutter = RangeCutter.over_download(0, total, first_end)
            chunks = self._ranged_download(
                link, deadline_unix, manifest, request, count, cutter, pieces
            )
        else:
            chunks = self._plain_download(link, deadline_unix, manifest, pieces, request, count)
        # (a download without a deadline does not continue on a rejoined session)
        with self.outages.watching(count) if deadline_unix else contextlib.nullcontext():
            model = receive_model(manifest, chunks, link.download_codec, previous, held)
        self._streams_used(count, "down", f"model {version[:12]}: downloaded")
        return model

    def _plain_download(
        self,
        link: Link,
        deadline_unix: float,
        manifest: pb.Manifest,
        pieces: Iterator[Any],
        request: Callable[[int, int, int], tuple[pb.Manifest, Iterator[Any]]],
        count: StreamCount,
    ) -> Iterator[Chunk]:
        """A download's chunks from one call; with the automatic count the call is
        watched, and cut where it stands once more streams should take over
        (`CallSwitch`): the rest then comes in ranges."""
        received = 0
        piece = functools.partial(_plain_piece, link.chunk_bytes, count.total)
        with CallSwitch(count, piece) as switch:
            for chunk in self._resumed(
                link, deadline_unix, manifest, pieces, request, switch=switch
            ):
                received += len(chunk.data)
                count.moved(len(chunk.data))
                yield chunk
        if switch.switched and received < manifest.total_bytes:
            log.debug("model %s: one call cut at byte %d", manifest.model_version[:12], received)
            cutter = RangeCutter.over_download(received, manifest.total_bytes)
            yield from self._ranged_download(link, deadline_unix, manifest, request, count, cutter)

    def _ranged_download(
        self,
        link: Link,
        deadline_unix: float,
        manifest: pb.Manifest,
        request: Callable[[int, int, int], tuple[pb.Manifest, Iterator[Any]]],
        count: StreamCount,
        cutter: RangeCutter,
        opened: Iterator[Any] | None = None,
    ) -> Iterator[Chunk]:
        """A download's chunks in the ranges of `cutter`, on `count` streams (`opened`:
        the first range's call, open already)."""
        positions = chunk_positions(manifest)
        first = [] if opened is None else [opened]

        def fetch(number: int, byte_range: tuple[int, int]) -> Iterator[Chunk]:
            pieces = first.pop() if first and byte_range[0] == 0 else None
            return _counted(
                self._resumed(
                    link, deadline_unix, manifest, pieces, request, byte_range, positions, number
                ),
                count.moved,
            )

        log.debug(
            "model %s: downloading over %d streams", manifest.model_version[:12], count.current
        )
        return merged(cutter, count, fetch)

    def _resumed(
        self,
        link: Link,
        deadline_unix: float,
        manifest: pb.Manifest,
        pieces: Iterator[Any] | None,
        request: Callable[[int, int, int], tuple[pb.Manifest, Iterator[Any]]],
        byte_range: tuple[int, int] = (0, 0),
        positions: dict[str, int] | None = None,
        number: int = 0,
        switch: CallSwitch | None = None,
    ) -> Iterator[Chunk]:
        """A download's chunks (those of `byte_range` on parallel stream `number`; with
        `positions`, where each tensor starts in the download); when its stream breaks
        (and a deadline allows), the rest, asked for from the bytes received, on the
        rejoined session: what the site holds is not sent again. With `switch`, a call
        it cut ends the chunks there."""
        received, end = byte_range
        broke = False
        while True:
            try:
                if pieces is None:
                    again, pieces = request(received, end, number)
                    if again != manifest:
                        raise ProtocolError("the server's download changed while it was resumed")
                    if broke:
                        log.info("model download continues from byte %d", received)
                if switch is not None:
                    switch.follow(pieces)
                for chunk in _download_chunks(pieces):
                    if positions is None:
                        received += len(chunk.data)
                    elif chunk.name in positions:
                        received = positions[chunk.name] + chunk.offset + len(chunk.data)
                    else:
                        raise ProtocolError(f"a download's chunk of {chunk.name!r}: not listed")
                    yield chunk
                return
            except (grpc.RpcError, ValueError) as exc:
                self.outages.heard()
                if switch is not None and switch.switched:
                    return  # cut for more streams: they move the rest
                if not deadline_unix or not _link_broke(exc):
                    raise
                if not self._await_link(link, deadline_unix):
                    raise
                log.warning(
                    "the download broke off after %d bytes (%s); continuing it on the "
                    "rejoined session",
                    received,
                    rpc.describe_rpc_error(exc),
                )
                pieces, broke = None, True

    def _through_outages(
        self, link: Link, deadline_unix: float, what: str, transfer: Callable[[], _T]
    ) -> _T:
        """`transfer()`, tried again when the link fails until the round's deadline: the
        daemon rejoins the session meanwhile (`Link.up`). Refusals are not retried."""
        while True:
            try:
                return transfer()
            except (grpc.RpcError, ValueError) as exc:
                self.outages.heard()  # (or the channel closed under it: no stalled one)
                if not _link_broke(exc) or not self._await_link(link, deadline_unix):
                    raise
                log.warning(
                    "the %s broke off (%s); continuing it on the rejoined session",
                    what,
                    rpc.describe_rpc_error(exc) if isinstance(exc, grpc.RpcError) else exc,
                )

    def _await_link(self, link: Link, deadline_unix: float) -> bool:
        """Wait until the session's link is up again (rejoined); False if the session
        ended, the daemon stops or the round's deadline passes first."""
        end = deadline_unix or time.time() + link.grace_s
        while not self._stop.is_set() and not link.closed.is_set():
            left = end - time.time()
            if left <= 0:
                return False
            if link.up.wait(min(left, 1.0)):
                if link.closed.is_set():
                    return False
                # A stream may break while the control stream still looks fine (or
                # before its break is noticed): do not spin on a dead channel.
                self._stop.wait(RESUME_PAUSE_S)
                return not (self._stop.is_set() or link.closed.is_set())
        return False

    def _stream_plan(self, link: Link, nbytes: int, direction: str) -> StreamCount:
        """Parallel streams for a transfer of `nbytes` on `link` (`transfer_streams`);
        the automatic choice starts in each direction where the previous transfer
        stayed (`StreamMemory`: a lossy link's many streams are not probed for anew
        every time; a clean one's transfers are one plain call)."""
        if link.dial is None:
            return StreamCount.fixed(1)
        return self._streams.plan(self.config.transfer_streams, nbytes, direction)

    def _streams_used(self, count: StreamCount, direction: str, what: str) -> None:
        if count.adaptive:
            self._streams.ended(direction, count)
            log.info("%s over %s", what, count.describe())

    def _upload(
        self,
        link: Link,
        header: pb.UploadHeader,
        chunks: Callable[[], Iterator[Chunk]],
        deadline_unix: float = 0.0,
        *,
        own_connection: bool = False,
    ) -> pb.UploadReceipt:
        """Send an update: `chunks()` makes its chunks (again for each stream). A plain
        update of `UpdateChunks` may go over parallel streams, a range each (see
        `streams.py`), from the start or once the automatic count cut its plain call;
        a masked one goes over one (the server folds its chunks into the secure sum in
        order). `own_connection`: a plain call goes on a connection of its own, closed
        after it (parallel streams have theirs anyway)."""
        ranged = isinstance(chunks, UpdateChunks) and not header.masked
        count = StreamCount.fixed(1)
        if ranged:
            assert isinstance(chunks, UpdateChunks)
            count = self._stream_plan(link, sum(chunks.sizes()), "up")
        with self.outages.watching(count):
            if count.parallel:
                assert isinstance(chunks, UpdateChunks)
                receipt = self._ranged_upload(link, header, chunks, count, deadline_unix)
            else:
                receipt = self._plain_upload(
                    link, header, chunks, count, deadline_unix, own_connection
                )
        self._streams_used(count, "up", f"round {header.round}: uploaded")
        return receipt

    def _plain_upload(
        self,
        link: Link,
        header: pb.UploadHeader,
        chunks: Callable[[], Iterator[Chunk]],
        count: StreamCount,
        deadline_unix: float,
        own_connection: bool,
    ) -> pb.UploadReceipt:
        """An upload as one call, which the automatic `count` may cut: the rest then
        goes in ranges over more streams."""
        shared = SharedUpload()
        if isinstance(chunks, UpdateChunks) and count.alone:
            chunks = chunks.with_head()
        # (a masked update's count is fixed: its call is never watched)
        in_flight = chunks.in_flight if isinstance(chunks, UpdateChunks) else lambda _: 0
        if own_connection:
            log.debug("round %d: uploading on a connection of its own", header.round)
        try:
            with (
                link.own_connection() if own_connection else contextlib.nullcontext() as via,
                CallSwitch(count, in_flight) as switch,
            ):
                return self._upload_range(
                    link, 0, header, chunks, shared, deadline_unix, count.moved, switch, via
                )
        except _CallCut as cut:
            assert isinstance(chunks, UpdateChunks) and not header.masked
            log.debug("round %d: one call cut at byte %d", header.round, cut.position)
            return self._ranged_upload(link, header, chunks, count, deadline_unix, cut, shared.id)

    def _ranged_upload(
        self,
        link: Link,
        header: pb.UploadHeader,
        chunks: UpdateChunks,
        count: StreamCount,
        deadline_unix: float,
        cut: _CallCut | None = None,
        upload_id: str = "",
    ) -> pb.UploadReceipt:
        """Send an update in ranges over `count` streams. After a plain call (of upload
        `upload_id`) was `cut`, its range is first ended where the server holds it
        (`_end_cut_call`), and the ranges take the rest, joining that upload."""
        ranged = chunks.for_ranges()
        shared = SharedUpload()
        start = 0
        if cut is not None:
            start, receipt = self._through_outages(
                link,
                deadline_unix,
                "upload",
                lambda: self._end_cut_call(link, header, upload_id, cut.in_flight_end),
            )
            if receipt is not None and not receipt.partial:  # the server had it all
                return receipt
            if start:
                shared.told(upload_id)
            # else the server held none of it: the first range opens the upload anew

        def send(number: int, byte_range: tuple[int, int]) -> pb.UploadReceipt:
            first, end = byte_range
            header_range = pb.UploadHeader()
            header_range.CopyFrom(header)
            header_range.range_start, header_range.range_end = first, end
            return self._upload_range(
                link,
                number,
                header_range,
                lambda: ranged.between(first, end),
                shared,
                deadline_unix,
                count.moved,
            )

        log.debug("round %d: uploading over %d streams", header.round, count.current)
        cutter = RangeCutter.over_chunks(ranged.sizes(), start)
        return completed(run_ranges(cutter, count, send, shared))

    def _end_cut_call(
        self, link: Link, header: pb.UploadHeader, upload_id: str, end: int
    ) -> tuple[int, pb.UploadReceipt | None]:
        """End the range of a cut plain call where the server holds it, sending nothing:
        (that byte, the receipt; 0, None: it holds nothing). The chunks gRPC had taken
        may or may not have reached the server: resumed to `end` (all it may hold), the
        go-ahead says how much it does; where that is less, the range is resumed again
        to end there (the server lets a resumed range end sooner, past what it holds),
        so that no one stream resends what the buffers lost."""
        ranged = pb.UploadHeader()
        ranged.CopyFrom(header)
        ranged.resume_id, ranged.session_token = upload_id, link.token
        upload = link.stream_channel(0).stream_unary(
            wire.method_path("UploadUpdate"),
            request_serializer=wire.serialize_stream_item,
            response_deserializer=pb.UploadReceipt.FromString,
        )
        while True:
            ranged.range_start, ranged.range_end = 0, end
            release = threading.Event()

            def items(release: threading.Event = release) -> Iterator[object]:
                yield pb.UpdateChunk(header=ranged)
                release.wait()

            call = upload.future(items())
            try:
                metadata = dict(call.initial_metadata() or ())
                if wire.UPLOAD_GO_AHEAD not in metadata:
                    return 0, call.result()  # refused: the call raises why
                held = int(metadata.get(wire.UPLOAD_OFFSET, 0))
                if held >= end:
                    release.set()  # nothing to send: the range is in
                    return end, call.result()
                call.cancel()
                if not held:
                    return 0, None
                end = held
            finally:
                release.set()

    def _upload_range(
        self,
        link: Link,
        number: int,
        header: pb.UploadHeader,
        chunks: Callable[[], Iterator[Chunk]],
        shared: SharedUpload,
        deadline_unix: float,
        moved: Callable[[int], None] | None = None,
        switch: CallSwitch | None = None,
        via: Callable[[int], grpc.Channel] | None = None,
    ) -> pb.UploadReceipt:
        """Send one stream's range of an update (the whole of it without a range) on
        parallel stream `number`'s channel; `moved(bytes)` after each chunk gRPC took
        (it asks for the next only once flow control lets the previous go). A broken
        stream is resumed: the server's go-ahead says up to where it holds the range
        (`wire.UPLOAD_OFFSET`), and only the chunks after that are sent. A call that
        `switch` cut raises `_CallCut` (with the bytes gRPC had taken, and the end of the
        chunk it was sending)."""
        position = [header.range_start, header.range_start]  # taken, and sent or in flight

        def attempt() -> pb.UploadReceipt:
            header.resume_id = shared.id
            header.session_token = link.token
            upload = (via or link.stream_channel)(number).stream_unary(
                wire.method_path("UploadUpdate"),
                request_serializer=wire.serialize_stream_item,
                response_deserializer=pb.UploadReceipt.FromString,
            )
            calls: queue.SimpleQueue[grpc.Future] = queue.SimpleQueue()

            def items() -> Iterator[object]:
                yield pb.UpdateChunk(header=header)
                # The chunks wait here for the server's go-ahead (wire.UPLOAD_GO_AHEAD);
                # a refused upload ends the call, which ends this wait too (and the update
                # is then not encoded for nothing).
                call = calls.get()
                metadata = dict(call.initial_metadata() or ())
                if call.done() or wire.UPLOAD_GO_AHEAD not in metadata:
                    return  # refused or broken before the go-ahead: the call says why
                shared.told(str(metadata.get(wire.UPLOAD_ID, "")))
                if switch is not None:
                    switch.count.began()
                offset = int(metadata.get(wire.UPLOAD_OFFSET, 0)) - header.range_start
                position[0] = position[1] = header.range_start + offset
                if offset:
                    log.info(
                        "round %d: the server holds %d bytes of this stream's; sending the rest",
                        header.round,
                        offset,
                    )
                for chunk in wire.chunks_after(chunks(), offset):
                    position[1] = position[0] + len(chunk.data)
                    yield chunk
                    position[0] = position[1]
                    if moved is not None:
                        moved(len(chunk.data))

            call = upload.future(items())
            calls.put(call)
            if switch is None:
                return call.result()
            switch.follow(call)
            try:
                return call.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                if switch.switched:
                    raise _CallCut(*position) from None
                raise

        return self._through_outages(link, deadline_unix, "upload", attempt)


class _CallCut(Exception):
    """An upload's plain call was cut for more streams after gRPC had taken `position`
    bytes; it was sending those up to `in_flight_end` (the server may hold them)."""

    def __init__(self, position: int, in_flight_end: int) -> None:
        super().__init__(f"cut at byte {position}")
        self.position = position
        self.in_flight_end = in_flight_end


def _counted(chunks: Iterator[Chunk], moved: Callable[[int], None]) -> Iterator[Chunk]:
    """`chunks`, each told to `moved` (its size) as it arrives."""
    for chunk in chunks:
        moved(len(chunk.data))
        yield chunk


def _plain_piece(chunk_bytes: int, total: int, received: int) -> int:
    """The size of the piece a plain download is moving after `received` bytes: the
    server cuts those in the first wire.HEAD_BYTES of a download the site may cut into
    range pieces, the rest are its chunk_bytes."""
    if received < wire.head_bytes(total):
        return min(chunk_bytes, wire.RANGE_CHUNK_BYTES)
    return chunk_bytes


def _download_chunks(pieces: Iterator[Any]) -> Iterator[Chunk]:
    """The chunks after a download's manifest; a second manifest is refused."""
    for piece in pieces:
        chunk = wire.stream_chunk(piece)
        if chunk is None:
            raise ProtocolError("a model download holds a second manifest")
        yield chunk


def fresh_training_seed() -> int:
    """A new seed for every training job, from the OS's CSPRNG.

    A server that retries a round (or resumes after a crash) asks the same sites to
    train from the same model again. With a fixed seed they would send bit-identical
    updates, so two secure sums over different subsets of them differ by exactly one
    site's update: fresh randomness makes every re-run a different update.
    """
    return secrets.randbits(63)


def _plain_header(link: Link, instruction: pb.Instruction, result: TrainResult) -> pb.UploadHeader:
    """The header of an unmasked update: its weight and metrics travel in the clear."""
    return pb.UploadHeader(
        round=instruction.round,
        session_token=link.token,
        num_examples=result.num_examples,
        metrics={k: float(v) for k, v in result.metrics.items()},
        model_version=instruction.model_version,
    )


def site_name(config: SiteConfig, *, insecure: bool) -> str:
    """The name this site joins as: `name` without TLS, else its certificate's name
    (which `name`, when set, must match). Every torchrun rank derives it the same way."""
    if insecure:
        if not config.name:
            raise ConfigError("site.toml: `name` is required without TLS (--insecure)")
        return tls.validate_site_name(config.name)
    ca, cert, key = config.tls.require("site.toml")
    info = tls.check_certificate(cert, ca, purpose="site", key_path=key)
    if config.name and config.name != info.common_name:
        raise ConfigError(
            f"site.toml: name = {config.name!r} but the certificate {cert} is for "
            f"{info.common_name!r}; fix `name` or leave it empty"
        )
    return str(info.common_name)


def delta_chunks(local: ModelState, global_state: ModelState, chunk_bytes: int) -> Iterator[Chunk]:
    """The update `compute_delta(local, global_state)`, produced chunk by chunk.

    Same bytes as computing the delta whole and chunking it, but the site never holds
    a third model-sized buffer (global + trained model is all): for a large model that
    is the difference between fitting in memory or not.
    """
    return map(functools.partial(delta_chunk, local), global_state.chunks(chunk_bytes))


def delta_chunk(local: ModelState, piece: Chunk) -> Chunk:
    """The update's chunk at `piece` (a chunk of the global model)."""
    start = piece.offset // torch_dtype(piece.dtype).itemsize
    values = chunk_values(piece)
    mine = local[piece.name].reshape(-1)[start : start + values.numel()]
    delta = compute_delta(ModelState({piece.name: mine}), ModelState({piece.name: values}))
    data = memoryview(delta[piece.name].view(torch.uint8).numpy())
    return Chunk(piece.name, piece.dtype, piece.shape, piece.offset, data)


def update_chunks(link: Link, local: ModelState, global_state: ModelState) -> UpdateChunks:
    """The plain update's chunks (of the server's chunk_bytes), made anew for each
    stream of its upload: the delta as it is, or encoded with the link's codec (once:
    encoding moves top-k's residual)."""
    if link.codec.name == "none":
        return UpdateChunks(
            global_state.chunks, link.chunk_bytes, functools.partial(delta_chunk, local)
        )
    encoded = link.codec.encode(compute_delta(local, global_state))
    return UpdateChunks(encoded.chunks, link.chunk_bytes)


class _PhaseClock:
    """Seconds per phase of a round, for the log line operators read when a round is slow."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases.append((phase, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self._phases)


def _data_source(config: SiteConfig) -> str:
    """Where this site's examples come from, for the start-up log."""
    data = config.data
    if data.source == "task":
        return "the task's site_data hook"
    if data.source in FILE_SOURCES:
        return f"{data.source} files under {data.path}"
    return f"part {data.partition} of {data.num_partitions}, {data.kind} split"


def _close_soon(close: Callable[[], None]) -> None:
    """Close a channel (`close`) without waiting for it: gRPC's close returns once every
    call on the channel has ended, which on a connection an outage left stalled is when
    TCP gives up on it or moves again (measured: 7 s after a 10 s outage, with the
    daemon's control loop waiting on it)."""
    threading.Thread(target=close, name="fedtrain-close", daemon=True).start()


def _end_stream(
    call: grpc.Call,
    outbox: queue.SimpleQueue[pb.SiteMessage | None],
    why: pb.Heartbeat,
    wait_s: float,
) -> None:
    """End the control stream saying `why`, then cancel it; waits at most `wait_s` for
    the server to end the stream (a dead link: it never does). A stream that ends right
    after the site talked is a site that left to the server, one after a silence an
    outage: `why` says which it is (Heartbeat.leaving, Heartbeat.reconnecting)."""
    outbox.put(pb.SiteMessage(heartbeat=why))
    outbox.put(None)
    ended = threading.Event()
    if call.add_callback(ended.set):  # False: the call has already ended
        ended.wait(wait_s)
    call.cancel()


def _drain(outbox: queue.SimpleQueue[pb.SiteMessage | None]) -> Iterator[pb.SiteMessage]:
    """The control stream's requests: whatever is queued, until the None sentinel."""
    while True:
        message = outbox.get()
        if message is None:
            return
        yield message


def _heartbeat(link: Link) -> None:
    sequence = 0
    while not link.closed.wait(link.heartbeat_interval_s):
        sequence += 1
        link.outbox.put(pb.SiteMessage(heartbeat=pb.Heartbeat(sequence=sequence)))
