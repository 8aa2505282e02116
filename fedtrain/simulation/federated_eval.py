"""Federated evaluation in a simulation: the chosen virtual clients evaluate the model.

The same strategy hooks as a deployment (`configure_evaluate`, `aggregate_evaluate`)
and the same record keys (`fedtrain.evaluation.federated_record`). The clients
evaluate on the workers that own them, through the backend's ordinary round path
(an evaluation `RoundPlan`), on their held-out data: a seeded `eval_fraction` of
each client's share, or what the task's `client_test_data` gives (a Flower client's
own evaluation). Heterogeneity's dropouts do not apply to evaluation. FedBuff's
virtual clock evaluates every `eval_every` versions the same way, between jobs.

Under secure aggregation the clients' evaluations are summed by a SecAgg+ exchange
(`SecureAggregation.evaluate`, with `secagg.stage_dropouts` as in training rounds)
and the record carries the federation's totals only, as in a deployment.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
from torch.utils.data import Dataset

from fedtrain.evaluation import (
    cross_site_matrix,
    cross_site_row,
    eval_metrics,
    federated_record,
    secure_record,
    where_to_evaluate,
)
from fedtrain.personalize import ask_to_personalize
from fedtrain.simulation.backends import Backend
from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.events import ClientResult
from fedtrain.simulation.plan import ClientWork, RoundPlan
from fedtrain.simulation.population import ClientPopulation
from fedtrain.simulation.secure import SecureAggregation
from fedtrain.strategy import RoundConfig, Strategy
from fedtrain.task import EvalResult, Task
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)


def where_to_evaluate_sim(
    config: SimConfig, has_test_set: bool, clients_hold_out: bool
) -> Literal["server", "sites", "off"]:
    """`config.evaluate` resolved for this run, as a deployment's server resolves it."""
    where = where_to_evaluate(config.evaluate, has_test_set)
    if where != "sites":
        return where
    if not clients_hold_out:
        log.warning(
            "the task has no test set and the clients hold no held-out data: no evaluation "
            "(set eval_fraction in sim.toml, e.g. 0.2, for federated evaluation)"
        )
        return "off"
    return "sites"


def clients_hold_out(
    config: SimConfig, task: Task, train: Dataset, population: ClientPopulation
) -> bool:
    """Whether the clients have held-out data to evaluate on (`eval_fraction`, or the
    task's `client_test_data` for the first client's share)."""
    if config.eval_fraction > 0:
        return True
    return task.client_test_data(population.dataset(train, population.ids[0])) is not None


def evaluate_clients(
    backend: Backend,
    strategy: Strategy,
    population: ClientPopulation,
    server_round: int,
    global_state: ModelState,
    rng: np.random.Generator,
    *,
    per_site: bool = True,
    secure: SecureAggregation | None = None,
    personalize_epochs: int = 0,
) -> dict[str, Any]:
    """The record keys of one federated evaluation of `global_state` (with `secure`:
    summed under SecAgg+ masks, the federation's totals only; with
    `personalize_epochs`, each client's personalized figures too)."""
    chosen = ask_to_personalize(
        strategy.configure_evaluate(server_round, population.ids, rng), personalize_epochs
    )
    if not chosen:
        return federated_record({}, {}, [], per_site=False)
    results, missing = _evaluate(backend, population, server_round, chosen, global_state)
    if missing:
        log.warning(
            "round %d: %d chosen client(s) left out of the evaluation (no held-out "
            "examples, e.g. a share too small for eval_fraction, or an implausible result)",
            server_round,
            len(missing),
        )
    if secure is not None:
        minimum = max(2, strategy.min_evaluate_clients)
        totals, left_out, record = secure.evaluate(server_round, results, minimum)
        aggregated = (
            strategy.aggregate_evaluate(server_round, [(totals.num_examples, totals.metrics())])
            if totals is not None
            else {}
        )
        return {**secure_record(aggregated, totals, [*missing, *left_out]), **record}
    ordered = sorted(results.items())
    aggregated = (
        strategy.aggregate_evaluate(
            server_round, [(r.num_examples, eval_metrics(r)) for _, r in ordered]
        )
        if results
        else {}
    )
    return federated_record(aggregated, results, missing, per_site=per_site)


def cross_site_validation(
    backend: Backend,
    strategy: Strategy,
    population: ClientPopulation,
    server_round: int,
    global_state: ModelState,
) -> dict[str, Any]:
    """The cross-site matrix (`cross_site_validation`): every client evaluates the
    final global model."""
    config = strategy.base_config(server_round)
    chosen = {client: dict(config) for client in population.ids}
    results, missing = _evaluate(backend, population, server_round, chosen, global_state)
    row = cross_site_row(global_state.digest(), results, missing)
    return cross_site_matrix(server_round, {"global": row})


def _evaluate(
    backend: Backend,
    population: ClientPopulation,
    server_round: int,
    chosen: dict[str, RoundConfig],
    global_state: ModelState,
) -> tuple[dict[str, EvalResult], list[str]]:
    """Each chosen client's evaluation of `global_state` on the worker that owns it:
    (results, the clients left out: no held-out examples or an implausible result)."""
    shares: list[list[ClientWork]] = [[] for _ in range(backend.num_workers)]
    for client_id in sorted(chosen):
        shares[population.index(client_id) % backend.num_workers].append(
            (client_id, chosen[client_id])
        )
    plan = RoundPlan(
        server_round,
        tuple(sorted(chosen)),
        (),
        tuple(tuple(share) for share in shares),
        fold_in_workers=False,
        evaluate=True,
    )
    results: dict[str, EvalResult] = {}
    missing: list[str] = []
    for event in backend.run_round(plan, global_state):
        if not isinstance(event, ClientResult):
            continue
        if event.rejected is not None:
            missing.append(event.client_id)
            continue
        metrics = dict(event.metrics)
        loss = metrics.pop("loss")
        results[event.client_id] = EvalResult(event.num_examples, loss, metrics)
    return results, missing
