"""The unit every backend replicates: one process's worth of virtual clients.

A `ClientRunner` builds the task, its data, the client partition and one model
once, then trains the clients of each share it is handed one after another,
loading the global model into the same model object each time. Inline it runs in
the driver; the process and Ray backends run one per worker. Keeping the training
path in one place is what makes the backends agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from fedtrain.datasources import holdout
from fedtrain.errors import UpdateRejected
from fedtrain.evaluation import check_eval_result, eval_metrics
from fedtrain.personalize import epochs_to_spend, personalized_evaluation, with_personalized
from fedtrain.simulation.client_state import ClientStateStore
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.events import ClientResult, ClientsDone, ShareDone, WorkerEvent
from fedtrain.simulation.plan import ClientWork
from fedtrain.simulation.population import ClientPopulation
from fedtrain.strategy import RoundConfig, WeightedSum, compute_delta
from fedtrain.task import (
    SiteData,
    Task,
    TaskContext,
    federated_names,
    model_for,
    resolve_device,
)
from fedtrain.tensors import ModelState, TensorSpec

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.25


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to build its clients once: small and picklable (no data)."""

    task: Task
    config: SimConfig
    specs: tuple[TensorSpec, ...]
    torch_threads: int = 0  # 0: leave torch's default; workers sharing a machine set it
    #: Device of worker i is devices[i % len]; empty: `config.device` for every worker.
    devices: tuple[str, ...] = ()

    def device_of(self, worker: int) -> str:
        return self.devices[worker % len(self.devices)] if self.devices else self.config.device


class ClientRunner:
    """Trains virtual clients in turn; owns their data and, if any, their state."""

    def __init__(
        self,
        setup: WorkerSetup,
        data: tuple[Dataset, ClientPopulation] | None = None,
        worker: int = 0,
    ) -> None:
        """`data`: the training set and population when the caller has them already
        (the inline backend shares the driver's); otherwise they are built here.
        `worker`: this runner's index, which picks its device (`WorkerSetup.devices`)."""
        if setup.torch_threads > 0:
            torch.set_num_threads(setup.torch_threads)
        self.task = setup.task
        self.specs = setup.specs
        self.seed = setup.config.seed
        self.eval_fraction = setup.config.eval_fraction
        self.device = resolve_device(setup.device_of(worker))
        if data is None:
            train, _ = self.task.datasets()
            data = (train, ClientPopulation.build(self.task, train, setup.config))
        self.train_data, self.population = data
        self.model = model_for(self.task, self.seed).to(self.device)
        #: The tensors that travel (None: all); a frozen base stays in this worker's
        #: one model, shared by every client it runs.
        self.federated = federated_names(self.task, self.model)
        self.states = ClientStateStore()
        self.codec = setup.config.compression.build()
        self.codec_states = ClientStateStore()  # e.g. top-k residuals, apart from the task's
        self.current_client: str | None = None  # for error reports
        warm_up_torch()

    def run_share(
        self,
        worker: int,
        share: tuple[ClientWork, ...],
        global_state: ModelState,
        fold: bool,
        evaluate: bool = False,
    ) -> Iterator[WorkerEvent]:
        """Train `share` from `global_state`: progress ticks, results, then `ShareDone`.

        With `fold`, updates go into one partial sum in client order and the results
        ride on `ShareDone`; otherwise each result carries its update. With `evaluate`,
        each client evaluates `global_state` instead (`evaluate_client`).
        """
        if evaluate:
            for client_id, config in share:
                yield self.evaluate_client(client_id, config, global_state)
            yield ShareDone(worker)
            return
        partial = WeightedSum(self.specs) if fold else None
        folded: list[ClientResult] = []
        last_tick = time.monotonic()
        for done, (client_id, config) in enumerate(share, 1):
            result = self.train_client(client_id, config, global_state)
            if partial is None:
                yield result
            else:
                folded.append(fold_into(partial, result))
            now = time.monotonic()
            if now - last_tick >= PROGRESS_INTERVAL_S:
                last_tick = now
                yield ClientsDone(worker, done)
        if partial is None:
            yield ShareDone(worker)
        else:
            yield ShareDone(
                worker, tuple(folded), dict(partial.sums), partial.total_weight, partial.count
            )

    def train_client(
        self, client_id: str, config: RoundConfig, global_state: ModelState
    ) -> ClientResult:
        """One client's local training from the global model; returns its update."""
        self.current_client = client_id
        global_state.load_into(self.model, self.federated)
        state = self.states.get(client_id)
        context = TaskContext(
            device=self.device, client_id=client_id, seed=self.seed, client_state=state
        )
        data = self.client_data(client_id).train
        result = self.task.train(self.model, data, config, context)
        self.states.put(client_id, state)
        delta = compute_delta(ModelState.from_module(self.model, self.federated), global_state)
        delta, upload_bytes = self.over_the_wire(client_id, delta)
        return ClientResult(
            client_id, result.num_examples, dict(result.metrics), delta, upload_bytes=upload_bytes
        )

    def client_data(self, client_id: str) -> SiteData:
        """A client's training set and held-out set: a seeded `eval_fraction` of its
        share held out (never trained on), else what the task's `client_test_data`
        says (a Flower client evaluates on its own data), else none."""
        share = self.population.dataset(self.train_data, client_id)
        if self.eval_fraction:
            seed = self.seed * 1_000_003 + self.population.index(client_id)
            return SiteData(*holdout(share, self.eval_fraction, seed))
        return SiteData(share, self.task.client_test_data(share))

    def evaluate_client(
        self, client_id: str, config: RoundConfig, global_state: ModelState
    ) -> ClientResult:
        """One client's evaluation of the global model on its held-out data, as a
        result whose metrics hold `loss` (rejected: the client holds none), and its
        personalized figures when `config` asks (`fedtrain.personalize`: a copy trained
        on the client's training split, its client state lent as a copy)."""
        self.current_client = client_id
        data = self.client_data(client_id)
        test = data.test
        if test is None or len(test) == 0:  # type: ignore[arg-type]
            return ClientResult(client_id, 0, rejected="holds no held-out examples")
        global_state.load_into(self.model, self.federated)
        context = TaskContext(device=self.device, client_id=client_id, seed=self.seed)
        result = self.task.evaluate(self.model, test, config, context)
        epochs = epochs_to_spend(config, sys.maxsize, f"client {client_id}")
        if epochs:
            mine = personalized_evaluation(
                self.task,
                self.model,
                data.train,
                test,
                config,
                dataclasses.replace(context, client_state=self.states.get(client_id)),
                epochs,
            )
            result = with_personalized(result, mine)
        try:
            check_eval_result(result, f"client {client_id}")
        except ValueError as exc:  # e.g. a Flower client whose evaluate() reports 0 examples
            return ClientResult(client_id, 0, rejected=str(exc))
        return ClientResult(client_id, result.num_examples, eval_metrics(result))

    def over_the_wire(self, client_id: str, delta: ModelState) -> tuple[ModelState, int]:
        """(the update as the server decodes it, the bytes its upload takes).

        The client encodes with the configured codec (its error-feedback residual is
        kept per client here, as a site keeps its own) and the server's decode runs
        right away, in this worker: the codec models the wire, so what is folded (here
        or in the driver) is exactly what a server would fold after decoding, while
        partial sums keep their O(model) memory per worker.
        """
        if self.codec.name == "none":
            return delta, delta.nbytes
        self.codec.load_site_state(self.codec_states.get(client_id))
        encoded = self.codec.encode(delta)
        self.codec_states.put(client_id, self.codec.site_state())
        return self.codec.decode(encoded, self.specs), encoded.nbytes


def fold_into(partial: WeightedSum, result: ClientResult) -> ClientResult:
    """Add a result's update to `partial`; returns the result without its update.

    A rejected update (NaN/Inf after a diverged step, say) is left out of the sum
    and reported, as the deployment's server does, instead of failing the run.
    """
    assert result.delta is not None
    try:
        partial.add(result.delta, float(result.num_examples))
    except UpdateRejected as exc:
        log.warning("update of %s rejected: %s", result.client_id, exc)
        return dataclasses.replace(result, delta=None, rejected=str(exc))
    return dataclasses.replace(result, delta=None)


def warm_up_torch() -> None:
    """Pay torch's lazy imports now (the first optimizer imports ~800 modules, ~1.5 s),
    so that start-up, not the first round, carries that cost and round times compare."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
