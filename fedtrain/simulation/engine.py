"""The simulation's round loop: the same Task and Strategy code as a deployment.

One loop serves every backend. Each round the driver plans (the strategy samples
clients; heterogeneity sets their epochs and drops some; clients are assigned to
workers), the backend trains the shares, and the results are folded into the
strategy's streaming aggregator in a fixed order, so memory stays O(model) per
worker whatever the number of clients and the model is the same on every backend.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fedtrain.compression.downlink import SiteModels
from fedtrain.compression.settings import DownloadSettings
from fedtrain.evaluation import CROSS_SITE_FILE, evaluation_now, server_record
from fedtrain.observability.observers import observing
from fedtrain.round_record import RoundRecord, finished
from fedtrain.simulation.async_engine import run_buffered
from fedtrain.simulation.backends import Backend, open_backend
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.federated_eval import (
    clients_hold_out,
    cross_site_validation,
    evaluate_clients,
    where_to_evaluate_sim,
)
from fedtrain.simulation.fold import RoundFold
from fedtrain.simulation.plan import RoundPlan, plan_round
from fedtrain.simulation.run import ProgressCallback, SimulationResult, evaluate, finish, prepare
from fedtrain.simulation.secure import SecureAggregation
from fedtrain.strategy import Strategy, WeightedSum
from fedtrain.task import Task, load_task, task_fingerprint
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


def build_from_config(config: SimConfig) -> tuple[Task, Strategy]:
    task = load_task(config.task, config.task_options)
    return task, config.build_strategy()


def run_simulation(
    config: SimConfig,
    *,
    task: Task | None = None,
    strategy: Strategy | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_progress: ProgressCallback | None = None,
) -> SimulationResult:
    """Run `config.rounds` rounds and write the run directory; returns the final model.

    `on_round` gets each round's metrics record; `on_progress` is called while a
    round trains (a few times a second at most per worker).
    """
    if task is None or strategy is None:
        built_task, built_strategy = build_from_config(config)
        task, strategy = task or built_task, strategy or built_strategy
    chosen = task
    with observing(
        config.run_dir,
        tensorboard=config.tensorboard,
        tensorboard_sites=config.tensorboard_sites,
        tracking=config.tracking,
        params=dataclasses.asdict(config),
        tags=lambda: {
            "fedtrain.driver": "simulation",
            "fedtrain.task": config.task,
            "fedtrain.task_fingerprint": task_fingerprint(chosen),
        },
        then=on_round,
    ) as observe:
        if strategy.asynchronous:
            return run_buffered(config, task, strategy, observe, on_progress)
        return _run_rounds(config, task, strategy, observe, on_progress)


def _run_rounds(
    config: SimConfig,
    task: Task,
    strategy: Strategy,
    on_round: Callable[[dict[str, Any]], None],
    on_progress: ProgressCallback | None,
) -> SimulationResult:
    """The synchronous round loop of `run_simulation`."""
    run_dir, train, test, population, heterogeneity, model, global_state, setup = prepare(
        config, task
    )
    rng = np.random.default_rng(config.seed)
    secure = SecureAggregation(config) if config.secagg.enabled else None
    if secure is not None:
        secure.check(strategy, len(population))
    result = SimulationResult(global_state)
    where = where_to_evaluate_sim(
        config, test is not None, clients_hold_out(config, task, train, population)
    )
    # its own stream, so evaluating never changes who trains
    eval_rng = np.random.default_rng([config.seed, 1])
    sites = SiteModels(config.download)  # what the clients download and train from
    published = 0  # the round whose aggregation made the current model (its version)
    with open_backend(config, setup, (train, population)) as backend:
        log.info(
            "simulating %d clients on the %s backend with %d workers",
            len(population),
            config.backend,
            backend.num_workers,
        )
        for server_round in range(1, config.rounds + 1):
            start = time.perf_counter()
            plan = plan_round(
                server_round,
                strategy,
                population,
                heterogeneity,
                rng,
                backend.num_workers,
                # with secagg the server may only see each client's masked update
                fold_in_workers=strategy.needs_only_sum and secure is None,
            )
            global_state, record = train_round(
                backend, strategy, plan, global_state, on_progress, secure, (sites, published)
            )
            published = server_round if record["aggregated"] else published
            due = evaluation_now(
                server_round, config.eval_every, config.rounds, where, test is not None
            )
            if due == "server" and test is not None:
                record.update(server_record(evaluate(task, model, global_state, test, config)))
            elif due == "sites":
                record.update(
                    evaluate_clients(
                        backend,
                        strategy,
                        population,
                        server_round,
                        sites.model(str(published), global_state),  # as sites decode it
                        eval_rng,
                        per_site=config.site_metrics,
                        secure=secure,
                        personalize_epochs=config.personalize_epochs,
                    )
                )
            finished(record, time.perf_counter() - start)
            run_dir.log_metrics(record)
            result.history.append(record)
            on_round(record)
        if config.cross_site_validation:
            matrix = cross_site_validation(
                backend, strategy, population, config.rounds, global_state
            )
            run_dir.write_json(CROSS_SITE_FILE, matrix)
    finish(config, task, run_dir, global_state, result.history)
    result.model = global_state
    return result


def train_round(
    backend: Backend,
    strategy: Strategy,
    plan: RoundPlan,
    global_state: ModelState,
    on_progress: ProgressCallback | None,
    secure: SecureAggregation | None = None,
    downloads: tuple[SiteModels, int] | None = None,
) -> tuple[ModelState, dict[str, Any]]:
    """Train one planned round and aggregate it; returns the new model and its record.

    A round where fewer than `strategy.min_results` updates count (dropouts,
    rejected updates, clients SecAgg+ left out) changes nothing, as in a deployment:
    the model stays. With `secure`, the updates are summed by a SecAgg+ round.
    `downloads`: (the download codec's site models, the model's version): clients
    train from the model as a deployed site decodes it (`[download]`), and their
    updates are added to the server's exact `global_state`.
    """
    start = time.perf_counter()
    sites, version = downloads if downloads is not None else (SiteModels(DownloadSettings()), 0)
    sites_model = sites.model(str(version), global_state)
    bytes_down = sites.send(plan.selected)
    aggregate = strategy.begin_round(plan.server_round, global_state)
    if plan.fold_in_workers and not isinstance(aggregate, WeightedSum):
        raise TypeError(
            f"{type(strategy).__name__} says needs_only_sum but its begin_round returns a "
            f"{type(aggregate).__name__}, not a WeightedSum that partial sums can merge into"
        )
    uploads = secure.uploads(global_state.specs) if secure is not None else None
    fold = RoundFold(aggregate if uploads is None else uploads, plan)
    training = len(plan.training)
    for event in backend.run_round(plan, sites_model):
        fold.add(event)
        if on_progress is not None:
            on_progress(plan.server_round, fold.clients_done, training)
    needed = strategy.min_results(len(plan.selected))
    secagg: dict[str, Any] = {}
    if secure is not None and uploads is not None:
        secagg = secure.aggregate(plan, fold, uploads, aggregate, needed)
    train_seconds = time.perf_counter() - start
    reported = len(fold.results)
    aggregated = reported > 0 and reported >= needed
    if aggregated:
        global_state = strategy.finalize_round(plan.server_round, global_state, aggregate)
    else:
        log.warning(
            "round %d: %d of %d chosen clients reported (%d dropped, %d rejected), %d needed; "
            "the global model is unchanged",
            plan.server_round,
            reported,
            len(plan.selected),
            len(plan.dropped),
            len(fold.rejected),
            needed,
        )
    # what would cross the wire: a download per chosen client that does not hold the
    # model yet (encoded, with a download codec), an upload (encoded, with a codec) per
    # update that arrived
    # as in a deployment, a client the secure protocol left out (a stage dropout) dropped
    left_out = [] if "secagg_error" in secagg else plan_left_out(plan, fold)
    record = RoundRecord(
        round=plan.server_round,
        selected=len(plan.selected),
        contributors=list(fold.results),
        dropped=[*plan.dropped, *left_out],
        failed=list(fold.rejected),
        aggregated=aggregated,
        measurements={
            "bytes": bytes_down + fold.upload_bytes,
            "bytes_down": bytes_down,
            "bytes_up": fold.upload_bytes,
            "train_seconds": train_seconds,
            "clients_per_s": training / train_seconds if train_seconds > 0 else None,
            **strategy.aggregate_metrics(fold.train_metrics()),
            **(strategy.round_metrics() if aggregated else {}),
            **secagg,
        },
    ).to_json()
    return global_state, record


def plan_left_out(plan: RoundPlan, fold: RoundFold) -> list[str]:
    """Clients that trained but are neither counted nor refused: a secure round's stage
    dropouts."""
    return [c for c in plan.training if c not in fold.results and c not in fold.rejected]
