"""MLflow tracking (`[tracking] mlflow = true` in server.toml or sim.toml).

One observer serves both drivers, beside the TensorBoard one: it gets the same
per-round record that goes to `metrics.jsonl` and never runs inside the round loop's
logic. Into one MLflow run it writes

- params: the resolved config, flattened (`strategy.name`, `client.lr`, ...);
- tags: `fedtrain.run_dir`, `fedtrain.task`, `fedtrain.task_fingerprint`,
  `fedtrain.driver` (server | simulation) and, for a server, `fedtrain.run_id`;
- metrics at step = round, named as the TensorBoard tags (`eval/accuracy`,
  `privacy/epsilon`, `transfer/bytes_in`, ...) and, for a server, each site's
  participation (`site/<name>/contributed`: 1 included, 0 dropped or failed);
- artifacts when the run ends: config.json, metrics.jsonl, audit.jsonl, the final
  model (`model.safetensors` + `model.json`, unless `log_model = false`) and the
  `fedtrain report` page with its plots.

The store defaults to SQLite in the run directory (`RUN_DIR/mlflow/mlflow.db`,
artifacts beside it); `mlflow_uri` names any other (`sqlite:////data/mlflow.db`, a
tracking server's `https://...`). The MLflow run's id is kept in
`RUN_DIR/mlflow_run.json`, so a server restarted with `--resume` goes on logging
into the same MLflow run; a round run again after a crash logs a second value at
its step. Install with `pip install 'fedtrain[mlflow]'`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedtrain.config import option
from fedtrain.errors import ConfigError
from fedtrain.files import atomic_write
from fedtrain.observability.tensorboard import scalars

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'fedtrain[mlflow]'"
#: Where the run dir keeps the MLflow run's id (read again by `--resume`).
RUN_FILE = "mlflow_run.json"
#: The run-dir files logged as artifacts when the run ends (those that exist).
ARTIFACTS = ("config.json", "metrics.jsonl", "audit.jsonl")
MODEL_ARTIFACTS = ("model.safetensors", "model.json")
#: MLflow's limits: values per param, entries per log_batch call.
_PARAM_CHARS = 500
_BATCH = 100


@dataclass
class TrackingConfig:
    mlflow: bool = option(
        False,
        "Log params, per-round metrics, the final model and the report to MLflow (needs "
        f"`{INSTALL_HINT}`); setting mlflow_uri turns it on too.",
    )
    mlflow_uri: str = option(
        "",
        "MLflow tracking URI: 'sqlite:////data/mlflow.db', a server's 'https://host', ...; "
        "empty: SQLite in RUN_DIR/mlflow.",
        env=True,
    )
    experiment: str = option("fedtrain", "MLflow experiment the run is logged under.")
    run_name: str = option("", "MLflow run name; empty: the run directory's name.")
    log_model: bool = option(
        True,
        "Upload the final model (model.safetensors + model.json) as artifacts; turn off for "
        "models too large to copy to the tracking store (the card is still a tag).",
    )

    @property
    def enabled(self) -> bool:
        return self.mlflow or bool(self.mlflow_uri)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config tables as MLflow params: `{"strategy": {"name": "x"}}` ->
    `{"strategy.name": "x"}`; lists and other values as JSON, cut to MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[name] = text if len(text) <= _PARAM_CHARS else text[: _PARAM_CHARS - 3] + "..."
    return out


class MlflowTracker:
    """A round observer writing to one MLflow run; `end()` logs the artifacts."""

    def __init__(
        self,
        config: TrackingConfig,
        run_dir: str | Path,
        *,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        resume: bool = False,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                f"[tracking] mlflow needs the mlflow package: {INSTALL_HINT} (or turn "
                "tracking.mlflow off)"
            ) from None
        self.run_dir = Path(run_dir)
        local = self.run_dir.resolve() / "mlflow"
        if not config.mlflow_uri:
            local.mkdir(parents=True, exist_ok=True)
        self.uri = config.mlflow_uri or f"sqlite:///{local / 'mlflow.db'}"
        self.log_model = config.log_model
        #: Calls the tracking store refused (each is logged; the run goes on).
        self._failures = 0
        try:
            self._client = MlflowClient(tracking_uri=self.uri)
            resumed = self._resume() if resume else None
            self.run_id = resumed or self._start(config, params, tags)
        except Exception as exc:  # before the first round: refuse to start, say why
            raise ConfigError(
                f"tracking: cannot open an MLflow run in {self.uri} (tracking.mlflow_uri): "
                f"{type(exc).__name__}: {exc}"
            ) from None

    # -- the run --------------------------------------------------------------------------
    def _resume(self) -> str | None:
        """The MLflow run this run dir logged to before (`--resume`), reopened."""
        path = self.run_dir / RUN_FILE
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        if saved.get("tracking_uri") != self.uri:
            log.warning(
                "%s names MLflow run %s in %s, not %s: starting a new MLflow run",
                path,
                saved.get("run_id"),
                saved.get("tracking_uri"),
                self.uri,
            )
            return None
        run_id = str(saved["run_id"])
        self._client.update_run(run_id, status="RUNNING")
        log.info("MLflow: continuing run %s in %s", run_id, self.uri)
        return run_id

    def _start(
        self, config: TrackingConfig, params: Mapping[str, Any], tags: Mapping[str, str]
    ) -> str:
        from mlflow.entities import Param

        experiment = self._client.get_experiment_by_name(config.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self._client.create_experiment(
                config.experiment, artifact_location=_local_artifacts(self.uri)
            )
        run = self._client.create_run(
            experiment_id,
            run_name=config.run_name or self.run_dir.resolve().name,
            tags={"fedtrain.run_dir": str(self.run_dir.resolve()), **tags},
        )
        run_id = run.info.run_id
        items = [Param(k, v) for k, v in flatten(params).items()]
        for start in range(0, len(items), _BATCH):
            self._client.log_batch(run_id, params=items[start : start + _BATCH])
        text = json.dumps({"run_id": run_id, "tracking_uri": self.uri}).encode()
        atomic_write(self.run_dir / RUN_FILE, lambda f: f.write(text))
        log.info("MLflow: logging to run %s in %s", run_id, self.uri)
        return run_id

    # -- observations -----------------------------------------------------------------------
    def __call__(self, record: dict[str, Any]) -> None:
        """One round's record as metrics at step = round."""
        self._log_metrics(scalars(record), int(record["round"]))

    def on_audit(self, event: str, fields: Mapping[str, Any]) -> None:
        """A server's audit record (an `AuditLog` listener): each site's part in a
        completed round."""
        if event != "round_completed" or "round" not in fields:
            return
        values = {f"site/{s}/contributed": 1.0 for s in fields.get("contributors") or ()}
        for site in (*(fields.get("dropped") or ()), *(fields.get("failed") or ())):
            values[f"site/{site}/contributed"] = 0.0
        self._log_metrics(values, int(fields["round"]))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags known only once the run is under way (a server's run id)."""
        for key, value in tags.items():
            self._guarded(self._client.set_tag, self.run_id, key, value)

    def _log_metrics(self, values: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in values.items()]
        for start in range(0, len(items), _BATCH):
            self._guarded(
                self._client.log_batch, self.run_id, metrics=items[start : start + _BATCH]
            )

    def _guarded(self, call: Any, *args: Any, **kwargs: Any) -> None:
        """Make the call; a tracking store that is down or refuses costs a warning, never
        the run (these calls run inside the round loop's callback)."""
        try:
            call(*args, **kwargs)
        except Exception as exc:
            level = logging.DEBUG if self._failures else logging.WARNING
            self._failures += 1
            log.log(level, "MLflow (%s) refused an update, training goes on: %s", self.uri, exc)

    # -- the end ---------------------------------------------------------------------------
    def end(self, status: str = "FINISHED") -> None:
        """Log the run dir's artifacts (and report) and mark the run FINISHED, FAILED or
        KILLED (a stopped server that a `--resume` will continue)."""
        names = ARTIFACTS + (MODEL_ARTIFACTS if self.log_model else ())
        for name in names:
            path = self.run_dir / name
            if path.exists():
                self._guarded(self._client.log_artifact, self.run_id, str(path))
        card = self.run_dir / "model.json"
        if card.exists():
            about = json.loads(card.read_text())
            self.set_tags({"fedtrain.model_round": str(about.get("round"))})
        report = self._report()
        if report is not None:
            self._guarded(self._client.log_artifacts, self.run_id, str(report), "report")
        self._guarded(self._client.set_terminated, self.run_id, status=status)

    def _report(self) -> Path | None:
        from fedtrain.observability.report import write_report

        try:
            return write_report(self.run_dir).parent
        except ConfigError as exc:  # no round finished: nothing to plot
            log.info("MLflow: no report to log (%s)", exc)
            return None


def _local_artifacts(uri: str) -> str | None:
    """Artifacts of a local SQLite store go beside its database, not into the working
    directory MLflow would pick; a tracking server decides for itself (None)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix) :]).parent / "artifacts").resolve().as_uri()
