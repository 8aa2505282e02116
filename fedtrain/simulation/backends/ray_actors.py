"""The `ray` backend: the same workers as Ray actors, on one machine or a cluster.

Each actor holds one `ClientRunner` (task, data and partition built once, where the
actor runs). Per round the driver puts the global model into Ray's object store
once; every actor reads it from its node's shared memory, so a node's actors
share one copy. Actors stream their events back (Ray generators), so progress and
per-client updates arrive while the round runs.

Cluster use: start a head node with `ray start --head --port=6379`, join others with
`ray start --address=HEAD_IP:6379`, and set `[ray] address = "auto"` (on the head)
or `"HEAD_IP:6379"`. Every node needs fedtrain and the task's package installed,
and the task's data where its workers run. Without an address the run starts a
private local Ray instance and stops it at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from fedtrain.errors import ConfigError, SimulationError
from fedtrain.simulation.backends.cpus import machine_cpus
from fedtrain.simulation.backends.pool import WorkerPool
from fedtrain.simulation.config import RayConfig
from fedtrain.simulation.events import WorkerEvent
from fedtrain.simulation.plan import ClientWork, RoundPlan
from fedtrain.simulation.transport import EventTransport
from fedtrain.simulation.worker import ClientRunner, WorkerSetup
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """Ray, or a ConfigError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            'backend = "ray" needs Ray: pip install "fedtrain[ray]"; or use backend = "process"'
        ) from None
    return ray


class RayWorker:
    """A Ray actor's body: one `ClientRunner`; events leave as (event, flat buffer)."""

    def __init__(self, setup: WorkerSetup) -> None:
        self.transport = EventTransport(setup.specs)
        self.runner = ClientRunner(setup)

    def pid(self) -> int:
        return os.getpid()

    def run_share(
        self,
        worker: int,
        model: np.ndarray,
        share: tuple[ClientWork, ...],
        fold: bool,
        evaluate: bool = False,
    ) -> Iterator[tuple[WorkerEvent, np.ndarray | None]]:
        """A Ray generator: `model` arrives zero-copy from the node's object store."""
        global_state = self.transport.model.unpack(model)
        for event in self.runner.run_share(worker, share, global_state, fold, evaluate):
            yield self.transport.detach(event)


class RayActorsBackend(WorkerPool):
    """`num_workers` actors (0: one per `cpus_per_worker` CPUs of the cluster)."""

    def __init__(self, setup: WorkerSetup, num_workers: int, config: RayConfig) -> None:
        self.setup = setup
        self.config = config
        self.num_workers = num_workers
        self.transport = EventTransport(setup.specs)
        self._ray: Any = None
        self._owns_ray = False
        self._actors: list[Any] = []

    def _start(self) -> None:
        ray = self._ray = import_ray()
        per_worker = self.config.cpus_per_worker
        if not ray.is_initialized():
            options: dict[str, Any] = {}
            if not self.config.address:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private instance
                # As with the process backend, more workers than cores is allowed here:
                # declare enough CPUs that every actor gets scheduled.
                wanted = math.ceil(self.num_workers * per_worker)
                options["num_cpus"] = max(machine_cpus(), wanted)
            ray.init(
                address=self.config.address or None,
                include_dashboard=False,
                logging_level=logging.WARNING,
                **options,
            )
            self._owns_ray = True
        cpus = float(ray.cluster_resources().get("CPU", 0))
        if self.num_workers == 0:
            self.num_workers = max(1, int(cpus // per_worker))
        elif self.num_workers * per_worker > cpus:
            # Ray would keep the extra actors pending forever: refuse instead of hanging.
            raise ConfigError(
                f"workers = {self.num_workers} at ray.cpus_per_worker = {per_worker} need "
                f"{self.num_workers * per_worker:g} CPUs, but the Ray cluster has {cpus:g}; "
                "lower workers (0: one per CPU) or cpus_per_worker, or add nodes"
            )
        threads = max(1, int(self.config.cpus_per_worker))
        setup = dataclasses.replace(self.setup, torch_threads=threads)
        actor = ray.remote(RayWorker).options(
            num_cpus=self.config.cpus_per_worker, num_gpus=self.config.gpus_per_worker
        )
        self._actors = [actor.remote(setup) for _ in range(self.num_workers)]
        try:
            pids = ray.get([a.pid.remote() for a in self._actors])
        except ray.exceptions.RayError as exc:
            raise SimulationError(f"a Ray simulation worker failed while starting: {exc}") from None
        log.info("started %d Ray simulation workers (pids %s)", self.num_workers, pids)

    def close(self) -> None:
        """Kill the actors; stop Ray if this backend started it."""
        ray = self._ray
        if ray is None:
            return
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception as exc:  # an actor that already died
                log.debug("killing a Ray worker: %s", exc)
        self._actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        self._ray = None

    def run_round(self, plan: RoundPlan, global_state: ModelState) -> Iterator[WorkerEvent]:
        ray = self._ray
        if ray is None:
            raise RuntimeError("RayActorsBackend used outside its `with` block")
        model_ref = ray.put(self.transport.model.pack(global_state).numpy())
        streams = {
            worker: self._actors[worker].run_share.remote(
                worker, model_ref, share, plan.fold_in_workers, plan.evaluate
            )
            for worker, share in enumerate(plan.shares)
            if share
        }
        while streams:
            ready, _ = ray.wait(list(streams.values()), num_returns=1)
            for stream in ready:
                worker = next(w for w, s in streams.items() if s is stream)
                try:
                    event, payload = ray.get(next(stream))
                except StopIteration:
                    del streams[worker]
                    continue
                except ray.exceptions.RayError as exc:
                    raise SimulationError(
                        f"Ray simulation worker {worker} failed in round {plan.server_round}: {exc}"
                    ) from None
                yield self.transport.attach(event, payload)
