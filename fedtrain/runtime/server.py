"""The aggregation server: gRPC service + coordinator thread + heartbeat watchdog.

It also owns the observers of the run: Prometheus metrics (fed by the audit log and
the per-round records; served when `metrics_port` is set) and, with `tensorboard =
true`, a TensorBoard writer for the per-round records.

`AggregationServer` owns everything it starts (gRPC threads, the round loop, the
watchdog) and stops all of it in `stop()`, so the CLI, the demo and tests can run
it in-process or as a process and leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc

from fedtrain.errors import ConfigError
from fedtrain.observability.metrics import ServerMetrics
from fedtrain.observability.tensorboard import TensorBoardWriter
from fedtrain.run_dir import RunDir
from fedtrain.runtime import tls, wire
from fedtrain.runtime.audit import AuditLog
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.coordinator import Coordinator, RoundCallback
from fedtrain.runtime.peer_auth import PeerVerifier
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.servicer import FedtrainServicer, generic_handler
from fedtrain.runtime.sessions import Session, SessionRegistry
from fedtrain.runtime.status import server_state
from fedtrain.runtime.upload import remove_stale_spools
from fedtrain.strategy import Strategy
from fedtrain.task import Task, load_task

log = logging.getLogger(__name__)

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
        self.run_dir = RunDir(config.run_dir)
        if not resume:
            self.run_dir.write_config(dataclasses.asdict(config))
        self.spool_dir = self.run_dir.path / "spool"
        remove_stale_spools(self.spool_dir)
        self.registry = SessionRegistry()
        self.audit = AuditLog(self.run_dir.path / "audit.jsonl")
        self.registry.on_leave(self._audit_leave)
        self.metrics = ServerMetrics(
            lambda: server_state(self.coordinator, self.registry), self._bytes_transferred
        )
        self.audit.subscribe(self.metrics.on_audit)
        self._tensorboard = TensorBoardWriter(self.run_dir.path) if config.tensorboard else None
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
        )
        self._grpc: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.port: int | None = None
        #: The Prometheus endpoint's port once started (None: metrics_port = 0, off).
        self.metrics_port: int | None = None

    @property
    def finished(self) -> threading.Event:
        """Set when the run completed, failed, or was stopped."""
        return self.coordinator.finished

    def start(self) -> int:
        """Listen, start the round loop and the watchdog; returns the bound port."""
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.config.max_workers, thread_name_prefix="fedtrain-rpc"
            ),
            options=wire.channel_options(self.config.max_message_bytes),
        )
        server.add_generic_rpc_handlers((generic_handler(self.servicer),))
        address = self.config.address
        try:
            if self.insecure:
                port = server.add_insecure_port(address)
                log.warning(INSECURE_WARNING, address.rsplit(":", 1)[0] + f":{port}")
            else:
                port = server.add_secure_port(address, self._credentials)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on address = {address!r}: {exc}") from None
        if port == 0:
            raise ConfigError(f"cannot listen on address = {address!r} (in use or not local?)")
        if self.config.metrics_port:
            try:
                self.metrics_port = self.metrics.serve(
                    self.config.metrics_address, self.config.metrics_port
                )
            except ConfigError:
                server.stop(None)
                raise
        server.start()
        self._grpc = server
        self.port = port
        for target, name in (
            (self.coordinator.run, "fedtrain-coordinator"),
            (self._watch_heartbeats, "fedtrain-heartbeats"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "serving run %s on port %d (%s), rounds %d..%d, run dir %s",
            self.coordinator.run_id,
            port,
            _transport(self.insecure, self.config.tls.verify_sites_in_handshake),
            self.coordinator.global_model.round + 1,
            self.config.rounds,
            self.run_dir.path,
        )
        return port

    def _watch_heartbeats(self) -> None:
        """Disconnect sites that went silent (a crashed host may never close its TCP
        stream); also write the counts of repeated refusals whose window has passed."""
        hb = self.config.heartbeat
        while not self._stopping.wait(hb.interval_s):
            self.audit.flush_refusals()
            for session in self.registry.silent_for(hb.timeout_s):
                log.warning(
                    "site %r sent nothing for %.0fs (heartbeat.timeout_s); disconnecting it",
                    session.site,
                    hb.timeout_s,
                )
                self.registry.remove(session, "heartbeat timeout")

    def _observe_round(self, record: dict[str, Any]) -> None:
        for observe in self._round_observers:
            observe(record)

    def _bytes_transferred(self) -> tuple[int, int]:
        transfers = self.coordinator.transfers
        return transfers.total_in, transfers.total_out

    def _audit_leave(self, session: Session, reason: str) -> None:
        log.info("site %r left: %s", session.site, reason)
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
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        for thread in self._threads:
            thread.join(timeout=grace + 5.0)
            if thread.is_alive():  # pragma: no cover - a stuck evaluation or checkpoint
                log.warning("thread %s did not stop within %.0fs", thread.name, grace + 5.0)
        self.metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self.audit.close()

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
