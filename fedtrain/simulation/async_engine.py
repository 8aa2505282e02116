"""The simulation's asynchronous loop (FedBuff): a virtual clock instead of rounds.

`concurrency` clients train at once, each from the model version current when it
started. A training job takes its client's simulated time (`heterogeneity.job_duration`:
slowdown x epochs x examples), and the server folds results into the strategy's
buffer in the order the jobs finish on that clock; every `buffer_size` arrivals make
a new version. A finished client's slot goes at once to a client drawn (seeded) from
the idle ones, which starts from the version current at that moment.

Nothing depends on real time or on the backend: a job's update is a function of its
client, its config and its base version only, so jobs need not train in clock order.
When the next arrival's update is missing, every running job not trained yet is
trained in one batch, one backend round per base version (in parallel on the
process and Ray backends, with the same `ClientRunner` as synchronous rounds), and
the results wait for their turn on the clock. Memory: the models of versions that
untrained jobs start from, and the updates of at most `concurrency` trained jobs
still "in flight".
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedtrain.compression.downlink import SiteModels
from fedtrain.compression.settings import DownloadSettings
from fedtrain.errors import ConfigError, SimulationError, UpdateRejected
from fedtrain.evaluation import evaluation_now, server_record
from fedtrain.round_record import RoundRecord, finished
from fedtrain.simulation.backends import Backend, open_backend
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.events import ClientResult
from fedtrain.simulation.federated_eval import (
    clients_hold_out,
    evaluate_clients,
    where_to_evaluate_sim,
)
from fedtrain.simulation.heterogeneity import Heterogeneity
from fedtrain.simulation.plan import ClientWork, RoundPlan
from fedtrain.simulation.population import ClientPopulation
from fedtrain.simulation.run import (
    ProgressCallback,
    SimulationResult,
    evaluate,
    finish,
    prepare,
)
from fedtrain.strategy import FedBuff, StalenessBuffer, StaleUpdate, Strategy
from fedtrain.task import Task
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)

#: Arrivals without a version bump, per buffered update needed, before giving up.
MAX_ARRIVALS_PER_UPDATE = 100


@dataclass(eq=False)
class Job:
    """One client's training from one model version, placed on the virtual clock."""

    number: int  # 1, 2, ...: also the `round` in its config, so each job shuffles afresh
    client_id: str
    version: int  # the model version it trains from
    config: dict[str, Any]
    finish: float  # virtual time its update arrives
    dropped: bool  # it never reports (heterogeneity.dropout_rate)
    result: ClientResult | None = None


@dataclass
class Interval:
    """What happened between two versions, for the version's metrics line."""

    started: float = field(default_factory=time.perf_counter)
    train_seconds: float = 0.0
    trained: int = 0
    downloads: int = 0  # jobs started: each fetches the model
    arrivals: int = 0  # updates that reached the server (buffered, stale or rejected)
    contributors: list[str] = field(default_factory=list)  # in fold order
    dropped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    results: list[tuple[int, dict[str, float]]] = field(default_factory=list)


class VirtualClients:
    """The running jobs on the virtual clock, the idle clients, and the models jobs need."""

    def __init__(
        self,
        strategy: Strategy,
        population: ClientPopulation,
        heterogeneity: Heterogeneity,
        backend: Backend,
        seed: int,
        global_state: ModelState,
        sites: SiteModels | None = None,
    ) -> None:
        self.strategy = strategy
        #: What jobs train from: each version as a deployed site decodes it (`[download]`).
        self.sites = sites if sites is not None else SiteModels(DownloadSettings())
        self.population = population
        self.heterogeneity = heterogeneity
        self.backend = backend
        self.rng = np.random.default_rng(seed)
        self.idle = list(population.ids)  # kept sorted: draws depend on the seed only
        self.running: list[tuple[float, int, Job]] = []  # heap by (finish, number)
        self.models = {0: self.sites.model("0", global_state)}
        self.version = 0
        self.clock = 0.0
        self.jobs = 0
        self.interval = Interval()

    def start(self, count: int) -> None:
        """Start `count` jobs on clients drawn from the idle ones, from the current version."""
        for _ in range(min(count, len(self.idle))):
            client_id = self.idle.pop(int(self.rng.integers(len(self.idle))))
            self.jobs += 1
            index = self.population.index(client_id)
            config = self.strategy.job_config(self.jobs, self.version, client_id)
            config = self.heterogeneity.client_config(index, config)
            duration = self.heterogeneity.job_duration(
                index, self.population.size(client_id), config
            )
            job = Job(
                self.jobs,
                client_id,
                self.version,
                config,
                self.clock + duration,
                self.heterogeneity.job_dropped(self.jobs),
            )
            heapq.heappush(self.running, (job.finish, job.number, job))
            self.interval.downloads += 1

    def next_arrival(self) -> Job:
        """The job that finishes next: the clock moves to it and its client is idle again."""
        _, _, job = heapq.heappop(self.running)
        if not job.dropped and job.result is None:
            self._train([job, *(j for _, _, j in self.running)])
        self.clock = job.finish
        self.idle.insert(int(np.searchsorted(self.idle, job.client_id)), job.client_id)
        return job

    def publish(self, version: int, state: ModelState) -> None:
        """A new current version; models that no untrained job needs are let go."""
        self.version = version
        needed = {j.version for _, _, j in self.running if j.result is None and not j.dropped}
        self.models = {v: m for v, m in self.models.items() if v in needed}
        self.models[version] = self.sites.model(str(version), state)

    def _train(self, jobs: Iterable[Job]) -> None:
        """Train every given job that still needs it, one backend round per base version."""
        by_version: dict[int, list[Job]] = {}
        for job in jobs:
            if job.result is None and not job.dropped:
                by_version.setdefault(job.version, []).append(job)
        started = time.perf_counter()
        for version, group in sorted(by_version.items()):
            waiting = {job.client_id: job for job in group}  # a client runs one job at a time
            for event in self.backend.run_round(self._plan(version, group), self.models[version]):
                if isinstance(event, ClientResult):
                    waiting.pop(event.client_id).result = event
                    self.interval.trained += 1
            if waiting:
                raise SimulationError(f"the backend returned no update for {sorted(waiting)}")
        self.interval.train_seconds += time.perf_counter() - started
        self.models = {self.version: self.models[self.version]}  # every job is trained now

    def _plan(self, version: int, jobs: list[Job]) -> RoundPlan:
        """The jobs as a backend round: each client on worker index % workers, as in rounds."""
        workers = self.backend.num_workers
        shares: list[list[ClientWork]] = [[] for _ in range(workers)]
        for job in sorted(jobs, key=lambda j: j.client_id):
            shares[self.population.index(job.client_id) % workers].append(
                (job.client_id, job.config)
            )
        return RoundPlan(
            version,
            tuple(sorted(j.client_id for j in jobs)),
            (),
            tuple(tuple(s) for s in shares),
            fold_in_workers=False,
        )


def fold(buffer: StalenessBuffer, job: Job, interval: Interval) -> bool:
    """Fold an arrived job's update into the buffer; False if dropped, stale or rejected."""
    if job.dropped:
        interval.dropped.append(job.client_id)
        return False
    result = job.result
    assert result is not None
    interval.arrivals += 1
    try:
        if result.delta is None:
            raise UpdateRejected(result.rejected or "the worker returned no update")
        buffer.stage(job.version)
        buffer.add(result.delta, float(result.num_examples))
    except StaleUpdate:
        return False  # counted by the buffer, reported in the version's metrics
    except UpdateRejected as exc:
        interval.rejected.append(job.client_id)
        log.warning("update of %s (job %d) rejected: %s", job.client_id, job.number, exc)
        return False
    interval.contributors.append(job.client_id)
    interval.results.append((result.num_examples, result.metrics))
    return True


def run_buffered(
    config: SimConfig,
    task: Task,
    strategy: Strategy,
    on_round: Callable[[dict[str, Any]], None] | None,
    on_progress: ProgressCallback | None,
) -> SimulationResult:
    """Run until `config.rounds` model versions exist; one metrics record per version."""
    if not isinstance(strategy, FedBuff):
        raise ConfigError(
            f"strategy {strategy.name!r} is asynchronous, but the simulation's asynchronous "
            "loop runs FedBuff's buffer only"
        )
    prepared = prepare(config, task)
    hold_out = clients_hold_out(config, task, prepared.train, prepared.population)
    where = where_to_evaluate_sim(config, prepared.test is not None, hold_out)
    eval_rng = np.random.default_rng([config.seed, 1])  # its own: never changes who trains
    global_state = prepared.global_state
    result = SimulationResult(global_state)
    concurrency = min(strategy.concurrency or len(prepared.population), len(prepared.population))
    with open_backend(config, prepared.setup, (prepared.train, prepared.population)) as backend:
        log.info(
            "simulating %d clients asynchronously (FedBuff: %d at once, buffer of %d) on the "
            "%s backend with %d workers",
            len(prepared.population),
            concurrency,
            strategy.buffer_size,
            config.backend,
            backend.num_workers,
        )
        clients = VirtualClients(
            strategy,
            prepared.population,
            prepared.heterogeneity,
            backend,
            config.seed,
            global_state,
            SiteModels(config.download),
        )
        clients.start(concurrency)
        buffer = strategy.begin_round(1, global_state)
        updates = 0
        arrivals_since_version = 0
        limit = MAX_ARRIVALS_PER_UPDATE * max(strategy.buffer_size, concurrency)
        while clients.version < config.rounds:
            version = clients.version + 1
            job = clients.next_arrival()
            arrivals_since_version += 1
            if fold(buffer, job, clients.interval):
                updates += 1
                if on_progress is not None:
                    on_progress(version, buffer.count, strategy.buffer_size)
            if strategy.buffer_full(buffer):
                global_state = strategy.finalize_round(version, global_state, buffer)
                clients.publish(version, global_state)
                record = version_record(strategy, clients, updates)
                due = evaluation_now(
                    version, config.eval_every, config.rounds, where, prepared.test is not None
                )
                if due == "server" and prepared.test is not None:
                    record.update(
                        server_record(
                            evaluate(task, prepared.model, global_state, prepared.test, config)
                        )
                    )
                elif due == "sites":  # between jobs, as a deployment's sites do
                    record.update(
                        evaluate_clients(
                            backend,
                            strategy,
                            prepared.population,
                            version,
                            clients.models[version],  # as the clients decode it
                            eval_rng,
                            per_site=config.site_metrics,
                            personalize_epochs=config.personalize_epochs,
                        )
                    )
                finished(record, time.perf_counter() - clients.interval.started)
                clients.interval = Interval()
                arrivals_since_version = 0
                prepared.run_dir.log_metrics(record)
                result.history.append(record)
                if on_round is not None:
                    on_round(record)
                buffer = strategy.begin_round(version + 1, global_state)
            elif arrivals_since_version > limit:
                raise SimulationError(
                    f"{arrivals_since_version} updates arrived without making version "
                    f"{version} (each was dropped, too stale or rejected); raise "
                    "strategy.max_staleness or lower heterogeneity.dropout_rate"
                )
            clients.start(1)  # the finished client's slot, from the current version
    finish(config, task, prepared.run_dir, global_state, result.history)
    result.model = global_state
    return result


def version_record(strategy: Strategy, clients: VirtualClients, updates: int) -> dict[str, Any]:
    """The metrics line of the version just made ("round" = model version)."""
    interval = clients.interval
    nbytes = clients.models[clients.version].nbytes
    return RoundRecord.buffered(
        clients.version,
        interval.contributors,
        interval.dropped,
        interval.rejected,
        {
            "client_updates": updates,
            "sim_time": clients.clock,
            # what would cross the wire: a download per job started, an upload per arrival
            "bytes": nbytes * (interval.downloads + interval.arrivals),
            "train_seconds": interval.train_seconds,
            "clients_per_s": (
                interval.trained / interval.train_seconds if interval.train_seconds > 0 else None
            ),
            **strategy.aggregate_metrics(interval.results),
            **strategy.round_metrics(),
        },
    ).to_json()
