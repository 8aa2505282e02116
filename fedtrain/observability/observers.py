"""The observers of a run's per-round records, opened and closed together.

Both drivers hand each round's record (the `metrics.jsonl` line) to one callable;
`observing` builds it from the run's settings: TensorBoard scalars, MLflow tracking,
then the caller's own callback. Observers only read the record, so the round loops
hold no tracking code. On the way out each observer is closed; MLflow's run is
marked by how the run ended (`Observers.outcome`, or FAILED when an exception
leaves the block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedtrain.observability.mlflow_tracking import MlflowTracker, TrackingConfig
from fedtrain.observability.tensorboard import RoundObserver, TensorBoardWriter


class Observers:
    """One callable for every observer of a run (see the module docstring)."""

    def __init__(self, observers: list[RoundObserver]) -> None:
        self._observers = observers
        self.tracker: MlflowTracker | None = None
        #: How the run ended, for MLflow: FINISHED, FAILED or KILLED (stopped early).
        self.outcome = "FINISHED"

    def __call__(self, record: dict[str, Any]) -> None:
        for observe in self._observers:
            observe(record)

    def on_audit(self, event: str, fields: Mapping[str, Any]) -> None:
        """A server's audit records (per-site participation for MLflow)."""
        if self.tracker is not None:
            self.tracker.on_audit(event, fields)

    def tag(self, **tags: str) -> None:
        """Tags known once the run is under way (MLflow's `fedtrain.run_id`, ...)."""
        if self.tracker is not None:
            self.tracker.set_tags({f"fedtrain.{k}": v for k, v in tags.items()})


@contextmanager
def observing(
    run_dir: str | Path,
    *,
    tensorboard: bool = False,
    tensorboard_sites: bool = False,
    tracking: TrackingConfig | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Callable[[], Mapping[str, str]] | None = None,
    then: RoundObserver | None = None,
    resume: bool = False,
) -> Iterator[Observers]:
    """The run's observers; `tags` is called only when MLflow is on (a task fingerprint
    costs a model build); `resume`: continue the MLflow run this run dir logged to."""
    observers: list[RoundObserver] = []
    writer = TensorBoardWriter(run_dir, sites=tensorboard_sites) if tensorboard else None
    if writer is not None:
        observers.append(writer)
    tracker = None
    try:
        if tracking is not None and tracking.enabled:
            tracker = MlflowTracker(
                tracking, run_dir, params=params or {}, tags=tags() if tags else {}, resume=resume
            )
            observers.append(tracker)
        if then is not None:
            observers.append(then)
        result = Observers(observers)
        result.tracker = tracker
        try:
            yield result
        except BaseException as exc:
            if tracker is not None:
                tracker.end(
                    "KILLED" if isinstance(exc, KeyboardInterrupt | SystemExit) else "FAILED"
                )
                tracker = None
            raise
        if tracker is not None:
            tracker.end(result.outcome)
    finally:
        if writer is not None:
            writer.close()
