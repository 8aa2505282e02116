"""Personalization: how good the global model gets at a site after a little local training.

A federation's global model can fit every site a little less well than a model the
site fine-tunes itself. With `personalize_epochs` (server.toml, sim.toml) each site
asked to evaluate a model version reports two figures on its held-out set: the
global model as it is, and the global model after `personalize_epochs` epochs of
local training on the site's own training split. The fine-tuning runs on a copy:
the personalized model is never uploaded, never replaces the global model at the
site (its next training starts from the server's model), and the client's state
(`TaskContext.client_state`) is not changed by it.

The server pushes the number of epochs in the EVALUATE instruction's config
(:data:`PERSONALIZE_KEY`); a site caps what it will spend with
`personalize_max_epochs` in its site.toml (0 refuses). A site asked for more than
its cap reports the global figures only: fine-tuned figures of different lengths
would not average into one meaningful number.

The personalized figures travel as metrics named with :data:`PREFIX`
(`personalized_loss`, `personalized_accuracy`, ...), beside the global ones of the
same evaluation, so they are averaged, kept per site and (under secure
aggregation) masked exactly like them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from fedtrain.errors import ConfigError
from fedtrain.strategy.base import RoundConfig
from fedtrain.task import EvalResult, Task, TaskContext

log = logging.getLogger(__name__)

#: The evaluation config key that asks a site to personalize, and for how many epochs.
PERSONALIZE_KEY = "personalize_epochs"
#: What the personalized figures are named: `personalized_loss`, `personalized_accuracy`.
PREFIX = "personalized_"
PERSONALIZE_DOC = (
    "Personalization: every site asked to evaluate also fine-tunes a copy of the global "
    "model for this many epochs on its own training split and reports that copy's loss "
    "and accuracy (`personalized_loss`, `personalized_accuracy`) beside the global "
    "model's. The copy is never uploaded and the next round trains from the server's "
    "model. Sent to the sites in the evaluation config; a site may refuse "
    "(personalize_max_epochs). 0: off."
)
PERSONALIZE_MAX_DOC = (
    "Most epochs of personalization (the server's personalize_epochs) this site spends "
    "per evaluation; asked for more, it reports only the global model's figures. 0 "
    "refuses personalization."
)


def check_epochs(value: int, key: str) -> None:
    """Refuse a negative epoch count when the config is read."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} = {value!r} must be a whole number of epochs >= 0 (0: off)")


def ask_to_personalize(plan: Mapping[str, RoundConfig], epochs: int) -> dict[str, RoundConfig]:
    """An evaluation plan whose configs ask for `epochs` of personalization (unless a
    strategy's `configure_evaluate` set its own `personalize_epochs`)."""
    if epochs <= 0:
        return dict(plan)
    return {site: {PERSONALIZE_KEY: epochs, **config} for site, config in plan.items()}


def epochs_to_spend(config: RoundConfig, cap: int, where: str) -> int:
    """The personalization epochs a site runs for an evaluation `config`: what it asks,
    or 0 when it asks none, something that is not a whole number >= 0, or more than
    the site's `cap` (each refusal logged, naming `where`)."""
    asked: Any = config.get(PERSONALIZE_KEY, 0)
    whole = (
        isinstance(asked, int | float)
        and not isinstance(asked, bool)
        and math.isfinite(asked)
        and asked == int(asked)
    )
    if not whole or asked < 0:
        log.warning(
            "%s: %s = %r is not a whole number >= 0; not personalizing",
            where,
            PERSONALIZE_KEY,
            asked,
        )
        return 0
    asked = int(asked)
    if asked == 0:
        return 0
    if asked > cap:
        # a site that opted out (cap 0) is told every evaluation: no news, no warning
        log.log(
            logging.INFO if cap == 0 else logging.WARNING,
            "%s: the server asks for %d epoch(s) of personalization, this site spends at "
            "most %d (personalize_max_epochs in site.toml); reporting the global model's "
            "figures only",
            where,
            asked,
            cap,
        )
        return 0
    return asked


def personalized_evaluation(
    task: Task,
    model: nn.Module,
    train: Dataset,
    test: Dataset,
    config: RoundConfig,
    context: TaskContext,
    epochs: int,
) -> EvalResult:
    """`model` (the global one, not changed) fine-tuned on a copy for `epochs` on
    `train`, evaluated on `test`: the fine-tuned copy's result. `context`'s client
    state is lent as a copy, so what training writes to it is dropped."""
    personal = copy.deepcopy(model)
    state = copy.deepcopy(context.client_state)
    local = dataclasses.replace(context, client_state=state)
    task.train(personal, train, {**config, "epochs": epochs}, local)
    result = task.evaluate(personal, test, config, local)
    del personal
    return result


def with_personalized(result: EvalResult, personalized: EvalResult) -> EvalResult:
    """The global `result` with the `personalized` figures added as `personalized_*`
    metrics (one held-out set: the example count is the global result's)."""
    named = {
        f"{PREFIX}loss": float(personalized.loss),
        **{f"{PREFIX}{k}": float(v) for k, v in personalized.metrics.items()},
    }
    return EvalResult(result.num_examples, result.loss, {**result.metrics, **named})
