"""Evaluation of the global model: where it runs, when, and what the round record says.

The server often holds no data (a hospital federation), so the global model is
evaluated where the data is: chosen sites (or virtual clients) evaluate a model
version on their held-out data and report `EvalResult`s; the strategy aggregates
them (`Strategy.aggregate_evaluate`, example-weighted by default); the round record
carries the federation's `loss`/`accuracy` plus, per site, what each one measured,
so an operator sees where the model is good, not only its mean.

`evaluate` (server.toml and sim.toml) picks where:

- `auto`: on the task's test set when the server (the simulation's driver) has one,
  else at the sites;
- `server`: only on the task's test set (none: no evaluation);
- `sites`: only at the sites, even if a test set exists (it is then never loaded);
- `off`: never.

Under secure aggregation an evaluation at the sites is secure too
(`fedtrain.secagg.evaluation`): the sites' loss sums, correct counts and example
counts are masked like their updates, so the server learns only the federation's
totals: no `site_metrics`, no `worst_site`, whatever `site_metrics` says. No plain
per-site option remains under secure aggregation: a site's metrics say as much
about its data as its update would, and a site that requires secure aggregation
refuses a plain evaluation.

With `personalize_epochs` each evaluating site also reports the figures of a copy
of the model fine-tuned on its own training split (`fedtrain.personalize`); the
record then carries `personalized_loss`, `personalized_accuracy` and
`personalized_examples` beside `loss` and `accuracy` (and each site's in
`site_metrics`), in the clear or as secure totals alike.

This module is core: the runtime and the simulation both build their records with
it, so the keys mean the same in every driver.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fedtrain.errors import ConfigError
from fedtrain.personalize import PREFIX
from fedtrain.round_record import worst_first
from fedtrain.secagg.evaluation import EvalTotals
from fedtrain.task import EvalResult

EvaluateAt = Literal["auto", "server", "sites", "off"]
#: The federation's figures a record carries under their own names; any other metric
#: the strategy aggregated is `eval_<name>`.
RECORD_FIGURES = ("loss", "accuracy", f"{PREFIX}loss", f"{PREFIX}accuracy")
EVALUATE_DOC = (
    "Where the global model is evaluated every eval_every rounds (and after the last): "
    "`auto` on the task's test set when it has one, else at the sites (a simulation's "
    "virtual clients); `server` on the "
    "test set only; `sites` at the sites only (federated evaluation: each chosen site "
    "evaluates on its held-out data; the record's loss/accuracy are the example-weighted "
    "means, with each site's values in `site_metrics`; under secure aggregation only the "
    "federation's totals, masked like the updates); `off`."
)
SITE_METRICS_DOC = (
    "Federated evaluation: write each site's (virtual client's) evaluation metrics "
    "(`site_metrics`, `worst_site`) to metrics.jsonl; false: only the federation's "
    "means (a deployment's server still receives each site's figures). Off under "
    "secure aggregation: the server then never learns a site's figures."
)
CROSS_SITE_DOC = (
    "Cross-site validation at the end of the run: the final global model evaluated at "
    "every site (virtual client) holding a held-out set, each site's figures written to "
    "RUN_DIR/cross_site.json and drawn as a heat-map by `fedtrain report`. Not with secure "
    "aggregation: it shows the server every site's figures."
)
CROSS_SITE_LOCAL_DOC = (
    "Cross-site validation: also evaluate each consenting site's last local model (the "
    "model its last update came from) at every site, the NVIDIA FLARE matrix. Ships each "
    "such model to every other site (see the README's security model); a site consents "
    "with share_local_model = true in its site.toml. Needs cross_site_validation."
)
SHARE_LOCAL_MODEL_DOC = (
    "Consent to cross-site validation of local models: the server may keep this site's "
    "last local model and send it to every other site of the federation to evaluate "
    "(only when the server's cross_site_local_models is on too). A model can reveal "
    "things about the data it was trained on: see the README's security model."
)
#: What a site that consents to its local model being evaluated elsewhere advertises.
SHARE_LOCAL_MODEL_CAPABILITY = "share_local_model"
#: The cross-site validation's results in the run directory.
CROSS_SITE_FILE = "cross_site.json"
#: What a site that can evaluate (it holds a held-out set) advertises when it joins.
EVALUATE_CAPABILITY = "evaluate"


def evaluation_due(server_round: int, every: int, last_round: int) -> bool:
    """Whether round `server_round` is evaluated: every `every` rounds and the last."""
    return server_round % every == 0 or server_round == last_round


def evaluation_now(
    server_round: int,
    every: int,
    last_round: int,
    where: Literal["server", "sites", "off"],
    has_test_set: bool,
) -> Literal["server", "sites"] | None:
    """Where the model of `server_round` is evaluated, None when not this round: the
    one cadence of every driver (`eval_every` and the last round), with `where` as
    `where_to_evaluate` resolved it (a server evaluation needs the test set loaded)."""
    if where == "off" or not evaluation_due(server_round, every, last_round):
        return None
    if where == "server":
        return "server" if has_test_set else None
    return "sites"


def where_to_evaluate(setting: str, has_test_set: bool) -> Literal["server", "sites", "off"]:
    """The resolved place of evaluation for `evaluate = setting`."""
    if setting == "auto":
        return "server" if has_test_set else "sites"
    if setting == "server":
        return "server" if has_test_set else "off"
    if setting in ("sites", "off"):
        return setting  # type: ignore[return-value]
    raise ConfigError(f"evaluate = {setting!r} must be one of auto, server, sites, off")


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """One evaluation as the flat metrics a strategy aggregates: `loss` plus the rest."""
    return {"loss": float(result.loss), **{k: float(v) for k, v in result.metrics.items()}}


def check_eval_result(result: EvalResult, where: str) -> None:
    """Refuse what cannot be averaged: no examples, or a non-finite number."""
    if result.num_examples < 1:
        raise ValueError(f"{where}: evaluated on {result.num_examples} examples (need >= 1)")
    bad = [k for k, v in eval_metrics(result).items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{where}: non-finite evaluation metric(s) {', '.join(bad)}")


def server_record(result: EvalResult) -> dict[str, Any]:
    """The record's evaluation keys for an evaluation on the server's test set."""
    return {
        "loss": result.loss,
        "accuracy": result.metrics.get("accuracy"),
        "eval_source": "server",
        "eval_examples": result.num_examples,
    }


def federated_record(
    aggregated: Mapping[str, float],
    results: Mapping[str, EvalResult],
    missing: Sequence[str],
    *,
    per_site: bool = True,
) -> dict[str, Any]:
    """The record's evaluation keys for a federated evaluation.

    `aggregated`: what the strategy made of the results (`loss`, `accuracy`, any other
    metric: `eval_<name>`); `results`: each counted site's own evaluation; `missing`:
    sites asked that did not answer (gone, failed, past the deadline, refused). With
    `per_site`, each site's metrics (`site_metrics`) and the worst site by accuracy
    (else by loss) are in the record; without, only the federation's figures.
    """
    personalized = [r.num_examples for r in results.values() if f"{PREFIX}loss" in r.metrics]
    record: dict[str, Any] = {
        "loss": aggregated.get("loss"),
        "accuracy": aggregated.get("accuracy"),
        "eval_source": "sites",
        "eval_examples": sum(r.num_examples for r in results.values()),
        "eval_sites": len(results),
        "eval_missing": sorted(missing),
        **{f"eval_{k}": v for k, v in aggregated.items() if k not in RECORD_FIGURES},
        **personalized_record(aggregated, sum(personalized)),
    }
    if not per_site or not results:
        return record
    record["site_metrics"] = {
        site: {"examples": r.num_examples, **eval_metrics(r)} for site, r in sorted(results.items())
    }
    worst = worst_site(results)
    if worst is not None:
        record["worst_site"] = worst
        record["worst_accuracy"] = results[worst].metrics.get("accuracy")
        record["worst_loss"] = results[worst].loss
        record["site_spread"] = site_spread(results)
    return record


def site_spread(results: Mapping[str, EvalResult]) -> float:
    """How far apart the sites are, on the figure `worst_site` ranks by: best minus
    worst accuracy, or worst minus best loss when the task reports no accuracy."""
    if all("accuracy" in r.metrics for r in results.values()):
        values = [float(r.metrics["accuracy"]) for r in results.values()]
    else:
        values = [float(r.loss) for r in results.values()]
    return max(values) - min(values)


def check_cross_site(enabled: bool, local_models: bool, secagg: bool) -> None:
    """Refuse cross-site validation under secure aggregation when the config is read."""
    if local_models and not enabled:
        raise ConfigError(
            "cross_site_local_models = true needs cross_site_validation = true (the local "
            "models are evaluated as part of it); set both, or neither"
        )
    if enabled and secagg:
        raise ConfigError(
            "cross_site_validation = true cannot run with secure aggregation: it records "
            "every site's evaluation of the final model, which secure aggregation keeps from "
            "the server. Turn one of them off (cross_site_validation = false, or "
            "secagg.enabled = false)"
        )


def cross_site_row(
    model_version: str, results: Mapping[str, EvalResult], missing: Sequence[str]
) -> dict[str, Any]:
    """One model's row of RUN_DIR/cross_site.json: each site's figures on it, and the
    sites asked that did not answer."""
    return {
        "model_version": model_version,
        "sites": {
            site: {"examples": r.num_examples, **eval_metrics(r)}
            for site, r in sorted(results.items())
        },
        "missing": sorted(missing),
    }


def cross_site_matrix(
    server_round: int, rows: Mapping[str, dict[str, Any]], withheld: Sequence[str] = ()
) -> dict[str, Any]:
    """What RUN_DIR/cross_site.json holds: a row per model evaluated, `global` (the
    final global model) first, then each consenting site's local model under its name;
    `withheld`: sites whose local model was not shared (no consent, or none kept)."""
    return {"round": server_round, "models": dict(rows), "withheld": sorted(withheld)}


def secure_record(
    aggregated: Mapping[str, float], totals: EvalTotals | None, missing: Sequence[str]
) -> dict[str, Any]:
    """The record's evaluation keys for a secure federated evaluation: the federation's
    totals only (`eval_secure`); `totals` None when the exchange failed (`missing`:
    every site asked that is not in the sum)."""
    return {
        "loss": aggregated.get("loss"),
        "accuracy": aggregated.get("accuracy"),
        "eval_source": "sites",
        "eval_secure": True,
        "eval_examples": totals.num_examples if totals is not None else 0,
        "eval_sites": totals.sites if totals is not None else 0,
        "eval_missing": sorted(missing),
        **personalized_record(aggregated, totals.personalized_examples if totals else 0),
    }


def personalized_record(aggregated: Mapping[str, float], examples: int) -> dict[str, Any]:
    """The record's personalization keys (`fedtrain.personalize`), only when some site
    personalized: `personalized_loss`, `personalized_accuracy` (the federation's
    means over the sites that did) and `personalized_examples` (their held-out
    examples; fewer than `eval_examples` when a site refused)."""
    if not examples:
        return {}
    return {
        f"{PREFIX}loss": aggregated.get(f"{PREFIX}loss"),
        f"{PREFIX}accuracy": aggregated.get(f"{PREFIX}accuracy"),
        f"{PREFIX}examples": examples,
    }


def worst_site(results: Mapping[str, EvalResult]) -> str | None:
    """The site where the model does worst: lowest accuracy, or highest loss when the
    task reports no accuracy (ties: the first name)."""
    ranked = worst_first({site: eval_metrics(r) for site, r in results.items()})
    return ranked[0] if ranked else None
