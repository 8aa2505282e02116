"""The aggregation server: the gRPC service on an event loop, the round loop's thread.

Threads, whatever the number of sites: one runs the asyncio event loop that serves
every connection and stream (`grpc.aio`) and watches heartbeats, one the round loop
(`Coordinator`), `cpu_threads` the CPU work handlers hand off (`servicer.py`), one
writes checkpoints, one answers Status on the run dir's socket and one on the status
port when there is one (`status_listener.py`), and gRPC's core keeps a few of its
own. The number of sites is bounded by memory and by file descriptors: the server
raises its soft file limit to the hard one at start and admits at most as many sites
as leave room for transfers and files (`max_sites`), refusing the rest with a
retry-after hint.

It also owns the observers of the run: Prometheus metrics (fed by the audit log and
the per-round records; served when `metrics_port` is set) and, with `tensorboard =
true`, a TensorBoard writer for the per-round records.

`AggregationServer` owns everything it starts (the loop, the threads, the gRPC
server) and stops all of it in `stop()`, so the CLI, the demo and tests can run it
in-process or as a process and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import threading
import time
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc
import torch

from fedtrain.errors import ConfigError
from fedtrain.observability.metrics import ServerMetrics
from fedtrain.observability.tensorboard import TensorBoardWriter
from fedtrain.run_dir import RunDir
from fedtrain.runtime import rpc, tls, wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.loop_thread import LoopThread
from fedtrain.runtime.peer_auth import PeerVerifier
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.coordinator import RUN_COMPLETE_LEAVE, Coordinator, RoundCallback
from fedtrain.runtime.server.grpc_log import quiet_peer_gone
from fedtrain.runtime.server.heap import FrozenHeap
from fedtrain.runtime.server.local_status import LocalStatus
from fedtrain.runtime.server.peer_check import PeerCheck
from fedtrain.runtime.server.servicer import FedtrainServicer, generic_handler
from fedtrain.runtime.server.sessions import FILES_RESERVED, Session, SessionRegistry
from fedtrain.runtime.server.status import server_state
from fedtrain.runtime.server.status_listener import StatusListener, StatusPort
from fedtrain.runtime.server.status_service import StatusService
from fedtrain.runtime.server.transfer_watch import TICK_S as TRANSFER_TICK_S
from fedtrain.runtime.server.transfer_watch import TransferWatch
from fedtrain.runtime.server.uploads import remove_stale_spools
from fedtrain.strategy import Strategy
from fedtrain.task import Task, load_task

log = logging.getLogger(__name__)

#: The event loop notes that it runs this often; one that has not for `LOOP_STALL_S`
#: is hung (a busy loop still runs every fraction of a second), and the status socket
#: and status port say so, which fails a liveness probe.
LOOP_TICK_S = 1.0
LOOP_STALL_S = 60.0


def raise_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the soft limit now.

    A service manager starts a process with a soft limit of 1024 whatever the hard one
    is, and every connected site holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # pragma: no cover - a restricted sandbox
            log.warning("could not raise the file limit from %d to %d: %s", soft, target, exc)
    return soft


def site_capacity(config: ServerConfig, file_limit: int) -> int:
    """How many sites may be connected at once: `max_sites`, within the file limit."""
    room = file_limit - FILES_RESERVED - config.max_transfers
    if room < 1:
        raise ConfigError(
            f"the file limit ({file_limit}) leaves no room for sites beside "
            f"{FILES_RESERVED} files and max_transfers = {config.max_transfers}; raise the "
            "limit (LimitNOFILE in the service unit, `ulimit -n`) or lower max_transfers"
        )
    if config.max_sites and config.max_sites > room:
        log.warning(
            "max_sites = %d, but the file limit (%d) leaves room for %d; admitting %d (raise "
            "LimitNOFILE in the service unit, or `ulimit -Hn`)",
            config.max_sites,
            file_limit,
            room,
            room,
        )
    return min(config.max_sites, room) if config.max_sites else room


INSECURE_WARNING = (
    "RUNNING WITHOUT TLS (--insecure): anyone who can reach %s can join as any site, "
    "read the global model and submit updates. Use this only on a trusted machine for tests."
)


class AggregationServer:
    """Serve one federated run; see the module docstring.

    `resume=True` continues the run in `config.run_dir` from its last checkpoint.
    `task`/`strategy` override the ones the config names (tests, custom embeddings).
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        insecure: bool = False,
        resume: bool = False,
        task: Task | None = None,
        strategy: Strategy | None = None,
        on_round: RoundCallback | None = None,
    ) -> None:
        self.config = config
        self.insecure = insecure
        self._verifier: PeerVerifier | None = None
        self._credentials: grpc.ServerCredentials | None = None  # None: --insecure
        secagg_verifier = None
        if not insecure:
            ca, cert, key = config.tls.require("server.toml")
            info, self._credentials = tls.server_credentials(
                cert, key, ca, require_client_auth=config.tls.verify_sites_in_handshake
            )
            self._verifier = PeerVerifier(ca, (*info.dns_names, *info.ip_addresses))
            if not config.allowed_sites:
                raise ConfigError(
                    "allowed_sites is empty: with TLS the server admits only the sites named "
                    "there (a certificate from the federation CA alone is not enough); list "
                    "them in server.toml"
                )
            secagg_verifier = CertificateVerifier.from_file(ca)
        elif config.secagg.enabled and config.secagg.consistency_check:
            log.warning(
                "secure aggregation without TLS (--insecure): sites have no certificates to "
                "sign with, so the consistency check (secagg.consistency_check) is off and a "
                "server that lied about dropouts could unmask a site's update"
            )
        self.task = task or load_task(config.task, config.task_options)
        # One fixed torch thread count: each thread that runs tensor work would otherwise
        # grow its own team of helper threads.
        torch.set_num_threads(config.cpu_threads)
        self.max_sites = site_capacity(config, raise_file_limit())
        self._cpu = futures.ThreadPoolExecutor(
            config.cpu_threads, thread_name_prefix="fedtrain-cpu"
        )
        self.run_dir = RunDir(config.run_dir)
        if not resume:
            self.run_dir.write_config(dataclasses.asdict(config))
        self.spool_dir = self.run_dir.path / "spool"
        remove_stale_spools(self.spool_dir)
        self.registry = SessionRegistry()
        self.audit = AuditLog(self.run_dir.path / "audit.jsonl")
        self.registry.on_leave(self._audit_leave)
        self.heap = FrozenHeap(submit=self._cpu.submit)
        self.metrics = ServerMetrics(
            lambda: server_state(self.coordinator, self.registry), self._bytes_transferred
        )
        self.audit.subscribe(self.metrics.on_audit)
        self._tensorboard = (
            TensorBoardWriter(self.run_dir.path, sites=config.tensorboard_sites)
            if config.tensorboard
            else None
        )
        self._round_observers = [
            o for o in (self.metrics.on_round, self._tensorboard, on_round) if o is not None
        ]
        self.coordinator = Coordinator(
            config,
            self.task,
            strategy or config.build_strategy(),
            self.run_dir,
            self.registry,
            self.audit,
            resume=resume,
            on_round=self._observe_round,
            secagg_verifier=secagg_verifier,
        )
        self.servicer = FedtrainServicer(
            config,
            self.coordinator,
            self.registry,
            self.audit,
            verifier=self._verifier,
            spool_dir=self.spool_dir,
            cpu=self._cpu,
            max_sites=self.max_sites,
        )
        #: Progress and stall lines of the transfers in flight, sampled once a second;
        #: a transfer idle too long is cut (`transfer_watch.IDLE_CUT_STALLS`).
        self.transfer_watch = TransferWatch(
            self.coordinator.links, config.transfers, self.servicer.cut_idle
        )
        self._enforcing = threading.Lock()
        self._grpc: grpc.aio.Server | None = None
        self._local_status: LocalStatus | None = None
        self._status_port: StatusPort | None = None
        self._loop_tick = time.monotonic()
        self._loop_thread: LoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.port: int | None = None
        #: The status port once started (None: status_address empty, off).
        self.status_port: int | None = None
        #: The Prometheus endpoint's port once started (None: metrics_port = 0, off).
        self.metrics_port: int | None = None

    @property
    def finished(self) -> threading.Event:
        """Set when the run completed, failed, or was stopped."""
        return self.coordinator.finished

    def start(self) -> int:
        """Listen, start the round loop and the watchdog; returns the bound port."""
        quiet_peer_gone()
        self._loop_thread = LoopThread("fedtrain-loop")
        self._loop = self._loop_thread.start()
        try:
            port = self._loop_thread.run(self._listen())
            if self.config.status_address:
                peers = PeerCheck(self._verifier, self.audit)  # its own loop, its own gate
                self._status_port = StatusPort(
                    self.config.status_address, self._status_service(peers), self._credentials
                )
                self.status_port = self._status_port.start()
        except BaseException:
            self.stop()
            raise
        self.port = port
        if self.config.status_socket:
            local = LocalStatus(self.run_dir.path, self._status_service(peers=None))
            self._local_status = local if local.start() else None
        coordinator = threading.Thread(
            target=self.coordinator.run, name="fedtrain-coordinator", daemon=True
        )
        coordinator.start()
        self._threads.append(coordinator)
        log.info(
            "serving run %s on port %d (%s), rounds %d..%d, up to %d sites, run dir %s",
            self.coordinator.run_id,
            port,
            _transport(self.insecure, self.config.tls.verify_sites_in_handshake),
            self.coordinator.global_model.round + 1,
            self.config.rounds,
            self.max_sites,
            self.run_dir.path,
        )
        return port

    async def _listen(self) -> int:
        """On the loop: the gRPC server, listening, and the heartbeat watchdog."""
        server = grpc.aio.server(
            options=wire.server_options(
                self.config.max_message_bytes, self.config.heartbeat.keepalive_s, self.max_sites
            )
        )
        server.add_generic_rpc_handlers((generic_handler(self.servicer),))
        address = self.config.address
        port = rpc.add_port(server, address, self._credentials, key="address")
        if self.insecure:
            log.warning(INSECURE_WARNING, address.rsplit(":", 1)[0] + f":{port}")
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve(
                self.config.metrics_address, self.config.metrics_port
            )
        await server.start()
        self._grpc = server
        self._watchdog = asyncio.create_task(self._watch_heartbeats())
        self._ticker = asyncio.create_task(self._tick())
        self._transfers_task = asyncio.create_task(self._watch_transfers())
        return port

    async def _tick(self) -> None:
        """Note, once a second, that the loop runs (`_loop_health`); keep the garbage
        collector off the long-lived objects (`heap.py`)."""
        while True:
            self._loop_tick = time.monotonic()
            self.heap.tick(in_round=self.coordinator.current is not None)
            await asyncio.sleep(LOOP_TICK_S)

    async def _watch_transfers(self) -> None:
        """Once a second: sample the transfers in flight (progress, stalls), and have the
        CPU pool judge the sites past their own deadline (it takes the round's lock)."""
        while True:
            await asyncio.sleep(TRANSFER_TICK_S)
            try:
                self.transfer_watch.tick()
                if self.coordinator.deadlines.due() and not self._enforcing.locked():
                    self._cpu.submit(self._enforce_deadlines)
            except Exception:  # what the operator sees must never stop what it watches
                log.exception("watching the transfers in flight failed; trying again")

    def _enforce_deadlines(self) -> None:
        with self._enforcing:
            self.coordinator.deadlines.enforce()

    def _status_service(self, peers: PeerCheck | None) -> StatusService:
        """Status for a listener of its own (`status_listener.py`): it also says when
        the main loop hangs, which it can, answering from another thread."""
        return StatusService(
            lambda page: server_state(self.coordinator, self.registry, page),
            peers=peers,
            health=self._loop_health,
        )

    def _loop_health(self) -> str | None:
        """Why the server cannot serve its sites now (its event loop has not run for
        `LOOP_STALL_S`), or None: what a liveness probe on the status socket or the
        status port checks."""
        stalled = time.monotonic() - self._loop_tick
        if stalled <= LOOP_STALL_S:
            return None
        return (
            f"the server's event loop, which serves every site, has not run for {stalled:.0f}s "
            "(hung): restart the server with --resume"
        )

    async def _watch_heartbeats(self) -> None:
        """Disconnect sites that went silent past their timeout (a host whose process
        hangs may keep answering keepalive pings, which gRPC's C core does, for ever);
        re-pace sites' heartbeats as the federation grows; write the counts of repeated
        refusals whose window has passed."""
        while True:
            await asyncio.sleep(self.config.heartbeat.interval_s)
            self.audit.flush_refusals()
            self.servicer.repace()
            self.servicer.sweep_uploads()
            grace = self.config.heartbeat.grace_s
            for session in self.registry.silent():
                if grace > 0:  # an outage, presumably: kept for the grace (servicer.detach)
                    self.servicer.detach(session, f"silent for {session.timeout_s:.0f}s")
                    continue
                log.warning(
                    "site %r sent nothing for %.0fs (its heartbeat timeout); disconnecting it",
                    session.site,
                    session.timeout_s,
                )
                self._cpu.submit(self.registry.remove, session, "heartbeat timeout")
            for session in self.registry.away(grace):
                log.warning("site %r did not rejoin within %gs; dropping it", session.site, grace)
                self._cpu.submit(
                    self.registry.remove,
                    session,
                    f"unreachable for longer than heartbeat.grace_s ({grace:g}s)",
                )

    def _observe_round(self, record: dict[str, Any]) -> None:
        for observe in self._round_observers:
            observe(record)

    def _bytes_transferred(self) -> tuple[int, int]:
        transfers = self.coordinator.transfers
        return transfers.total_in, transfers.total_out

    def _audit_leave(self, session: Session, reason: str) -> None:
        self.heap.site_left()
        level = logging.DEBUG if reason == RUN_COMPLETE_LEAVE else logging.INFO
        log.log(level, "site %r left: %s", session.site, reason)
        self.audit.record("leave", site=session.site, reason=reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ends (complete, failed or stopped); False on timeout."""
        return self.finished.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        """Stop everything this server started (idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.coordinator.stop()
        for session in self.registry.sessions():
            self.registry.remove(session, "server shutting down")
        if self._loop_thread is not None:
            self._loop_thread.stop(self._shutdown(grace), grace + 10)
        listeners: tuple[StatusListener | None, ...] = (self._local_status, self._status_port)
        for listener in listeners:
            if listener is not None:
                listener.stop()
        for thread in self._threads:
            thread.join(timeout=grace + 5.0)
            if thread.is_alive():  # pragma: no cover - a stuck evaluation or checkpoint
                log.warning("thread %s did not stop within %.0fs", thread.name, grace + 5.0)
        self._cpu.shutdown(wait=True, cancel_futures=True)
        self.metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self.audit.close()
        self.heap.close()

    async def _shutdown(self, grace: float) -> None:
        tasks = ("_watchdog", "_ticker", "_transfers_task")
        for task in (getattr(self, name, None) for name in tasks):
            if task is not None:
                task.cancel()
        if self._grpc is not None:
            await self._grpc.stop(grace)

    def __enter__(self) -> AggregationServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _transport(insecure: bool, handshake: bool) -> str:
    if insecure:
        return "insecure"
    both = "mutual TLS" if handshake else "TLS"
    return f"{both}, sites prove their certificates at join"
