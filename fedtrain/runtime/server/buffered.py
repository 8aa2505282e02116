"""FedBuff in the server: sites train continuously, every K updates make a new version.

Instead of rounds, each site holds one *job* at a time: train from the model version
current when the job was handed out, upload the delta. The job travels as an
ordinary TRAIN instruction (`round` = the job's number, `model_version` = its base
version's digest), so site daemons need nothing new. When a site's update has been
folded, or it failed, dropped out or ran past `round_timeout_s`, its job ends and it
gets the next one at once, from the newest version: fast sites never wait for slow
ones (`strategy.concurrency` caps how many sites hold a job; 0: all of them).

Uploads are received as in rounds (validated chunk by chunk and spooled, see
`uploads.py`) and folded into the strategy's `StalenessBuffer`, weighted by how many
versions the model moved since the job's base version. An update staler than
`max_staleness` is refused with that reason, logged, audited (`update_stale` and the
servicer's `upload_rejected`) and counted in the version's metrics. The K-th update
swaps in a fresh buffer at once (uploads keep folding while the full one is applied),
and the coordinator thread turns the full buffer into the next version: publish,
hand the waiting sites their next jobs, evaluate, checkpoint (with the version's
metrics record, as a round's), log. A federated evaluation (every `eval_every`
versions) asks the chosen sites between their jobs: the site runs it before its
next job, while the updates of jobs under way keep folding; its instruction's
`round` is a fresh job number (`instruction_number`). The buffer that makes the
run's last version is the last one: once it is full the run is closed to uploads, so an update that
arrives while that version is being made is refused (`upload_rejected`) instead of
being folded into a buffer no version would apply.

All decisions about jobs and the buffer happen under one lock, shared by the upload
handlers, the control streams (joins, leaves, errors) and the coordinator thread.
A version a site was told to train from stays downloadable until that site fetched
it (or its job ended), even after the model moved on. The buffer is not
checkpointed: a server restarted with `--resume` continues from the last version,
and updates buffered towards the next one are lost (at most K - 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from fedtrain.errors import ConfigError
from fedtrain.round_record import RoundRecord
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.runtime.server.rounds import Outcome, UploadRefused, refuse_second_upload
from fedtrain.runtime.server.sessions import (
    Session,
    SessionRegistry,
    instruct,
    own_upload_room,
)
from fedtrain.runtime.server.uploads import UpdateSpool
from fedtrain.strategy import FedBuff, StalenessBuffer, StaleUpdate, Strategy
from fedtrain.strategy.aggregate import Aggregator
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What FedBuff's loop uses of the coordinator that runs it: the run's settings and
    sites, and the steps every new global model goes through. Declared here so that this
    module need not import the coordinator (which imports it)."""

    config: ServerConfig
    strategy: Strategy
    registry: SessionRegistry
    audit: AuditLog
    rng: np.random.Generator
    global_model: GlobalModel

    @property
    def stopped(self) -> bool: ...

    def finalize(self, server_round: int, aggregate: Aggregator) -> ModelState: ...

    def publish(self, server_round: int, state: ModelState) -> GlobalModel: ...

    def transfer_metrics(self) -> dict[str, int]: ...

    def record_round(
        self, record: dict[str, Any], started: float, model: GlobalModel, **audit: Any
    ) -> None: ...


@dataclass(eq=False)
class Job:
    """One site's training from one model version."""

    number: int  # the instruction's `round`; unique in this server's run
    site: str
    token: str  # the session it was handed to
    version: int  # the model version it trains from
    digest: str  # that version's ModelState digest
    deadline: float  # time.monotonic()
    fetched: bool = False  # the site started downloading its model


@dataclass(eq=False)
class Filling:
    """A buffer being filled, and what happened to jobs while it was."""

    buffer: StalenessBuffer
    started: float = field(default_factory=time.perf_counter)
    contributors: list[str] = field(default_factory=list)  # in fold order; repeats allowed
    results: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class BufferedRounds:
    """FedBuff's live state (see the module docstring); `coordinator.current` for a run."""

    def __init__(self, coordinator: Owner) -> None:
        if not isinstance(coordinator.strategy, FedBuff):
            raise ConfigError(
                f"strategy {coordinator.strategy.name!r} is asynchronous, but the server's "
                "asynchronous loop runs FedBuff's buffer only"
            )
        self.coordinator = coordinator
        self.strategy: FedBuff = coordinator.strategy
        self.timeout_s = coordinator.config.round_timeout_s
        self.jobs: dict[str, Job] = {}  # site -> its outstanding job
        self.uploading: dict[str, Job] = {}  # site -> the job whose upload is being received
        self.retained: dict[str, GlobalModel] = {}  # digest -> older version still to fetch
        self.filling = self._new_buffer(coordinator.global_model.round + 1)
        self.full: deque[Filling] = deque()  # waiting for the coordinator thread
        self.numbered = 0
        self.active = False  # handing out jobs (after min_available_clients joined)
        self.closed = False  # the run is complete or stopping: no more jobs or folds
        self._cond = threading.Condition()
        coordinator.registry.on_join(self._joined)

    @property
    def round(self) -> int:
        """The version being built (what `Status` and log lines call the round)."""
        return self.filling.buffer.version + 1

    # -- the coordinator thread ------------------------------------------------------------
    def run(self) -> bool:
        """Hand out jobs and make versions until `config.rounds`; False if stopped first."""
        coordinator = self.coordinator
        if coordinator.registry.wait_for(self.strategy.min_available_clients) is None:
            return False
        log.info(
            "FedBuff: sites train continuously; every %d update(s) make a version (%s)",
            self.strategy.buffer_size,
            f"at most {self.strategy.concurrency} sites at once"
            if self.strategy.concurrency
            else "every connected site trains",
        )
        with self._cond:
            self.active = True
            self._assign_idle()
        while True:
            with self._cond:
                while not self.full and not coordinator.stopped:
                    self._cond.wait(self._expire_overdue())
                if coordinator.stopped:
                    self.closed = True
                    return False
                filling = self.full[0]  # stays queued until applied: sites wait for it
            if self._make_version(filling):
                return True

    def _make_version(self, filling: Filling) -> bool:
        """Apply a full buffer: the next version, published, checkpointed, logged.

        True once the run's last version exists."""
        coordinator = self.coordinator
        old = coordinator.global_model
        version = filling.buffer.version + 1
        new_state = coordinator.finalize(version, filling.buffer)
        model = coordinator.publish(version, new_state)
        last = version >= coordinator.config.rounds
        with self._cond:
            self.full.popleft()
            if any(j.digest == old.version and not j.fetched for j in self.jobs.values()):
                self.retained[old.version] = old
            if last:
                self.closed = True
            else:
                self._assign_idle()  # the sites that waited for this version
        record = RoundRecord.buffered(
            version,
            filling.contributors,
            filling.dropped,
            filling.failed,
            {
                **self.strategy.round_metrics(),
                **coordinator.transfer_metrics(),
                **self.strategy.aggregate_metrics(filling.results),
            },
        ).to_json()
        coordinator.record_round(
            record,
            filling.started,
            model,
            contributors=filling.contributors,
            dropped=filling.dropped,
            failed=filling.failed,
            stale_dropped=record["stale_dropped"],
        )
        return last

    def _expire_overdue(self) -> float | None:
        """End jobs past their deadline (not mid-upload); seconds until the next one."""
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.deadline <= now]:
            if job.site not in self.uploading:
                log.warning(
                    "site %r did not deliver job %d within round_timeout_s (%.0fs); it counts "
                    "as dropped",
                    job.site,
                    job.number,
                    self.timeout_s,
                )
                self.coordinator.audit.record(
                    "job_expired", site=job.site, job=job.number, base_version=job.version
                )
                self._end(job, Outcome.DROPPED)
        self._assign_idle()
        pending = [j.deadline for j in self.jobs.values() if j.site not in self.uploading]
        return max(0.0, min(pending) - now) if pending else None

    # -- jobs ------------------------------------------------------------------------------
    def _assign_idle(self) -> None:
        """Give jobs to connected sites without one, up to `concurrency` (under the lock).

        While a full buffer waits to be applied, the sites wait too (briefly), so that
        they start from the version it makes rather than from one already superseded."""
        if not self.active or self.closed or self.full:
            return
        idle = sorted(
            (s for s in self.coordinator.registry.sessions() if s.site not in self.jobs),
            key=lambda s: s.site,
        )
        slots = len(idle)
        if self.strategy.concurrency:
            slots = min(slots, self.strategy.concurrency - len(self.jobs))
        if slots <= 0:
            return
        chosen = self.coordinator.rng.choice(len(idle), size=slots, replace=False)
        for index in sorted(chosen.tolist()):
            if not idle[index].closed:
                self._hand_out(idle[index])

    def instruction_number(self) -> int:
        """A fresh instruction `round` for an EVALUATE: from the jobs' numbers, so that a
        site's error report (which names only that number) is one job's or one
        evaluation's, never both."""
        with self._cond:
            self.numbered += 1
            return self.numbered

    def _hand_out(self, session: Session) -> None:
        model = self.coordinator.global_model
        self.numbered += 1
        job = Job(
            self.numbered,
            session.site,
            session.token,
            model.round,
            model.version,
            time.monotonic() + self.timeout_s,
        )
        self.jobs[session.site] = job
        config = self.strategy.job_config(job.number, model.round, session.site)
        room = own_upload_room(self.coordinator.config, len(self.coordinator.registry))
        instruct(
            session,
            job.number,
            model.version,
            config,
            time.time() + self.timeout_s,
            own_upload_connection=len(self.jobs) <= room,  # (this job's is counted)
        )
        log.debug("job %d: site %r trains from version %d", job.number, session.site, model.round)
        self._cond.notify_all()  # the coordinator thread watches its deadline

    def _end(self, job: Job, outcome: Outcome | None) -> None:
        """A job is over (under the lock); its site may get the next one. A dropout or
        failure is listed in the version's metrics (None: counted elsewhere, e.g. stale)."""
        if self.jobs.get(job.site) is job:
            del self.jobs[job.site]
        if not self.closed:  # after the last buffer filled, no version is left to list it
            if outcome is Outcome.DROPPED:
                self.filling.dropped.append(job.site)
            elif outcome is Outcome.FAILED:
                self.filling.failed.append(job.site)
        self._release_fetched()
        self._cond.notify_all()

    def _release_fetched(self) -> None:
        """Let go of older versions that no job still has to download."""
        needed = {j.digest for j in self.jobs.values() if not j.fetched}
        self.retained = {d: m for d, m in self.retained.items() if d in needed}

    def _joined(self, session: Session) -> None:
        with self._cond:
            old = self.jobs.get(session.site)
            if old is not None and old.token != session.token:  # it reconnected
                self._end(old, Outcome.DROPPED)
            self._assign_idle()

    def model_for(self, session: Session, version: str) -> GlobalModel | None:
        """The model a site downloads for its job: current, or a retained older version."""
        with self._cond:
            job = self.jobs.get(session.site)
            if job is not None and job.token == session.token and job.digest == version:
                job.fetched = True
            current = self.coordinator.global_model
            if not version or version == current.version:
                return current
            model = self.retained.get(version)
            self._release_fetched()
            return model

    # -- the servicer's side (the same calls as a round's `RoundState`) ----------------------
    def admit(self, session: Session, server_round: int, model_version: str) -> None:
        """Check an upload header against the site's job; marks the site as uploading."""
        where = f"site {session.site!r}, job {server_round}"
        with self._cond:
            job = self._job_of(session, server_round, where)
            if model_version and model_version != job.digest:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: update computed against model {model_version[:12]}, but the job "
                    f"was to train from version {job.version} ({job.digest[:12]})",
                )
            refuse_second_upload(self.uploading, session.site, where)
            self._check_staleness(job, where, stage=False)  # refuse before the bytes travel
            self.uploading[session.site] = job

    def abandon(self, site: str) -> None:
        """An admitted upload failed; the job stays open until the site reports or times out."""
        with self._cond:
            self.uploading.pop(site, None)

    def commit(
        self, session: Session, spool: UpdateSpool, num_examples: int, metrics: Mapping[str, float]
    ) -> None:
        """Fold a complete, validated update into the buffer, weighted by its staleness."""
        with self._cond:
            job = self.uploading.pop(session.site, None)
            where = f"site {session.site!r}"
            if job is None or self.jobs.get(session.site) is not job:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: the job ended while its update was being received (deadline "
                    "passed or the run completed); update dropped",
                )
            where += f", job {job.number}"
            if self.closed:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{where}: the run is over; update dropped"
                )
            filling = self.filling
            staleness, weight = self._check_staleness(job, where, stage=True)
            try:
                spool.fold_into(filling.buffer, float(num_examples))
            except BaseException as exc:
                log.error("%s: folding failed halfway (%s); the buffer is discarded", where, exc)
                self.filling = self._new_buffer(filling.buffer.version + 1)
                self._end(job, Outcome.FAILED)
                self._assign_idle()
                raise
            filling.contributors.append(session.site)
            filling.results.append((num_examples, dict(metrics)))
            self.coordinator.audit.record(
                "update_buffered",
                site=session.site,
                job=job.number,
                base_version=job.version,
                version=filling.buffer.version + 1,
                staleness=staleness,
                weight=weight,
                num_examples=num_examples,
            )
            if self.strategy.buffer_full(filling.buffer):
                self.full.append(filling)
                if filling.buffer.version + 1 >= self.coordinator.config.rounds:
                    # The run's last version is now decided: no buffer follows it, so
                    # an update arriving before the coordinator thread made it is
                    # refused rather than folded into a buffer no version would apply.
                    self.closed = True
                else:
                    self.filling = self._new_buffer(filling.buffer.version + 2)
            self._end(job, Outcome.DONE)
            self._assign_idle()

    def _check_staleness(self, job: Job, where: str, *, stage: bool) -> tuple[int, float]:
        """The job's (staleness, weight), staged for folding if `stage`; a job too stale
        ends there, counted by the buffer, and its site gets the next one."""
        buffer = self.filling.buffer
        try:
            return buffer.stage(job.version) if stage else buffer.check(job.version)
        except StaleUpdate as exc:
            reason = f"{where}: {exc}"
            log.warning("%s", reason)
            self.coordinator.audit.record(
                "update_stale",
                site=job.site,
                job=job.number,
                base_version=job.version,
                staleness=buffer.version - job.version,
                max_staleness=self.strategy.max_staleness,
            )
            self._end(job, None)
            self._assign_idle()
            raise UploadRefused(grpc.StatusCode.FAILED_PRECONDITION, reason) from None

    def _job_of(self, session: Session, number: int, where: str) -> Job:
        job = self.jobs.get(session.site)
        if self.closed:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"{where}: the run is over; update dropped"
            )
        if job is None or job.token != session.token:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: this session holds no training job (it ended: deadline passed, or "
                "the site reconnected); update dropped",
            )
        if job.number != number:
            raise UploadRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: the site's current job is {job.number}; update dropped",
            )
        return job

    # -- other ways a job ends ---------------------------------------------------------------
    def settle(self, session: Session, outcome: Outcome) -> bool:
        """The site's session ended: its job (if any) is a dropout; True if it had one."""
        with self._cond:
            job = self.jobs.get(session.site)
            if job is None or job.token != session.token:
                return False
            self.uploading.pop(session.site, None)
            if self.closed:  # the run is over: sessions end, nothing drops out
                del self.jobs[session.site]
                return False
            self._end(job, outcome)
            self._assign_idle()
            return True

    def job_failed(self, session: Session, number: int) -> None:
        """The site reported that it cannot deliver job `number`; it gets another."""
        with self._cond:
            job = self.jobs.get(session.site)
            if job is None or job.token != session.token or job.number != number:
                return  # an older job, ended already (e.g. refused as stale)
            self.uploading.pop(session.site, None)
            self._end(job, Outcome.FAILED)
            self._assign_idle()

    def wake(self) -> None:
        """Let the coordinator thread re-check whether it was stopped."""
        with self._cond:
            self._cond.notify_all()

    def _new_buffer(self, version: int) -> Filling:
        return Filling(self.strategy.begin_round(version, self.coordinator.global_model.state))
