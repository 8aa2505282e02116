"""Cross-site validation at the end of a run (opt-in; never under secure aggregation).

NVIDIA FLARE's matrix: after the last round the final global model is evaluated at
every site that holds a held-out set (`cross_site_validation`), and with
`cross_site_local_models` each consenting site's last local model too, at every
site. A site consents with `share_local_model = true` in its site.toml (it then
advertises `share_local_model` when it joins); the server ships nothing else.

A site's last local model is the model its last counted update came from: the global
model it trained from plus that update. `LocalModels` asks the round to keep the
consenting sites' updates whole (`RoundState.keep_updates`) and turns them into
models when the round is finalized, replacing older ones, so the server holds one
model per consenting site, in memory only. While the validation runs, the sites
download those models by their (random) version names like any model.

The result is `RUN_DIR/cross_site.json` (`fedtrain.evaluation.cross_site_matrix`), an
audit record per local model shipped (`local_model_shared`: whose, to which sites)
and one for the validation (`cross_site_validation`); `fedtrain report` draws the
heat-map.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Set
from pathlib import Path

from fedtrain.evaluation import (
    CROSS_SITE_FILE,
    SHARE_LOCAL_MODEL_CAPABILITY,
    cross_site_matrix,
    cross_site_row,
)
from fedtrain.run_dir import RunDir
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.global_model import GlobalModel, new_model_version
from fedtrain.runtime.server.rounds import RoundState
from fedtrain.runtime.server.sessions import Session
from fedtrain.strategy import RoundConfig
from fedtrain.strategy.aggregate import apply_mean_delta
from fedtrain.task import EvalResult
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)

#: Asks the sites of a plan to evaluate a model: (each result, why each other is missing).
Evaluate = Callable[
    [GlobalModel, dict[str, RoundConfig]], tuple[dict[str, EvalResult], dict[str, str]]
]


class LocalModels:
    """Each consenting site's last local model (empty unless `enabled`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.models: dict[str, GlobalModel] = {}
        #: Set while the validation runs: only then are local models downloadable.
        self.serving = False

    def consenting(self, sessions: Mapping[str, Session | None]) -> frozenset[str]:
        """The sites of a round whose update is kept (they consented)."""
        if not self.enabled:
            return frozenset()
        return frozenset(
            site
            for site, session in sessions.items()
            if session is not None and SHARE_LOCAL_MODEL_CAPABILITY in session.capabilities
        )

    def keep(self, base: ModelState, state: RoundState) -> None:
        """The round's kept updates as local models (`base` + each), before the round's
        global model replaces `base`."""
        for site, delta in sorted(state.local_updates.items()):
            local = apply_mean_delta(base, delta, consume=True)
            self.models[site] = GlobalModel(state.round, new_model_version(), local)
        state.local_updates.clear()

    def for_download(self, version: str) -> GlobalModel | None:
        """The local model named `version`, while the validation runs."""
        if self.serving:
            for model in self.models.values():
                if model.version == version:
                    return model
        return None


def cross_site_validation(
    final: GlobalModel,
    plan: dict[str, RoundConfig],
    local: LocalModels,
    evaluate: Evaluate,
    *,
    connected: Set[str],
    audit: AuditLog,
    run_dir: RunDir,
) -> Path:
    """Evaluate `final` and every kept local model at `plan`'s sites; write the matrix.

    `connected`: the sites connected now (those without a kept local model are listed
    as withheld when local models are on)."""
    models = {"global": final, **dict(sorted(local.models.items()))}
    rows = {}
    local.serving = True
    try:
        for name, model in models.items():
            if name != "global":
                audit.record(
                    "local_model_shared",
                    site=name,
                    round=model.round,
                    model_version=model.version,
                    to=sorted(plan),
                )
            results, missing = evaluate(model, plan) if plan else ({}, {})
            rows[name] = cross_site_row(model.version, results, missing)
    finally:
        local.serving = False
    withheld = set(connected) - set(local.models) if local.enabled else set()
    path = run_dir.write_json(
        CROSS_SITE_FILE, cross_site_matrix(final.round, rows, sorted(withheld))
    )
    audit.record(
        "cross_site_validation",
        round=final.round,
        model_version=final.version,
        models=list(rows),
        sites=sorted(plan),
    )
    log.info("cross-site validation: %d model(s) at %d site(s), in %s", len(rows), len(plan), path)
    return path
