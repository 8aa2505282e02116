"""Model files people load anywhere: safetensors with the model's names, and a sidecar.

At the end of every run (server or simulation), and on demand with `fedtrain export
RUN_DIR`, the final global model is written as

    RUN_DIR/model.safetensors   every tensor under the task's parameter name
                                (`safetensors.torch.load_file` reads it; no pickle)
    RUN_DIR/model.json          the model card: task, task fingerprint, round, run id,
                                the last round's metrics, each tensor's dtype and shape

beside `model.pt` (the same tensors for `torch.load(path, weights_only=True)`), which
is written last: a run directory with `model.pt` has its export too. The card is
also in the safetensors header's metadata (`"fedtrain"`), so the file alone says
where it came from.

Names: a native torch task's state-dict names are the names. A task whose module
cannot carry the real names (Flower's arrays travel as `p0, p1, ...`) maps them
back with `Task.export_names()`; `FlowerTask(parameter_names=...)` does.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedtrain.errors import ConfigError, TaskError
from fedtrain.files import atomic_path, atomic_write
from fedtrain.run_dir import RunDir, load_state
from fedtrain.task import Task, load_task, task_fingerprint
from fedtrain.tensor_file import load_tensor_file
from fedtrain.tensors import ModelState, dtype_name

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SIDECAR = "model.json"
#: The key of the model card in the safetensors header's metadata.
METADATA_KEY = "fedtrain"


@dataclass(frozen=True)
class ModelCard:
    """Where a model file came from (the JSON sidecar, and the safetensors metadata)."""

    task: str
    task_fingerprint: str
    round: int
    run_id: str
    metrics: dict[str, float]
    #: fedtrain's name -> the name in the file, where they differ (e.g. Flower's p0).
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)
    created: str = ""


def exported_state(task: Task, state: ModelState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors under their exported names, each its own contiguous CPU tensor
    (safetensors refuses tensors that share memory), and the renames applied."""
    names = dict(task.export_names())
    unknown = sorted(set(names) - set(state))
    if unknown:
        raise TaskError(
            f"{type(task).__name__}.export_names() names {unknown}, which the model does not "
            f"have (its tensors: {list(state)[:8]}...)"
        )
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        new = names.get(name, name)
        if new in out:
            raise TaskError(
                f"{type(task).__name__}.export_names() gives two tensors the name {new!r}"
            )
        t = tensor.detach().cpu().contiguous()
        pointer = t.untyped_storage().data_ptr()
        if pointer in seen:  # tied weights: each name gets its own bytes in the file
            t = t.clone()
        seen.add(pointer)
        out[new] = t
    return out, {k: v for k, v in names.items() if k != v}


def write_model_files(
    directory: Path, tensors: Mapping[str, torch.Tensor], card: ModelCard
) -> Path:
    """`model.safetensors` and `model.json` in `directory`, each replaced atomically."""
    from safetensors.torch import save_file

    card = dataclasses.replace(
        card, created=card.created or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    )
    about = dataclasses.asdict(card)
    target = directory / SAFETENSORS
    with atomic_path(target) as tmp:
        save_file(
            dict(tensors), str(tmp), metadata={METADATA_KEY: json.dumps(about, sort_keys=True)}
        )
    sidecar = {
        **about,
        "file": SAFETENSORS,
        "tensors": {
            name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            for name, t in tensors.items()
        },
    }
    text = (json.dumps(sidecar, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(directory / SIDECAR, lambda f: f.write(text))
    return target


def save_final_model(
    run_dir: RunDir,
    task: Task,
    state: ModelState,
    *,
    task_ref: str,
    server_round: int,
    run_id: str,
    metrics: Mapping[str, Any],
    fingerprint: str | None = None,
) -> None:
    """The end of a run: the export (safetensors + card) first, then `model.pt`, the
    file whose presence says the run is complete (`RunDir.progress`)."""
    tensors, renamed = exported_state(task, state)
    card = ModelCard(
        task=task_ref,
        task_fingerprint=fingerprint or task_fingerprint(task),
        round=server_round,
        run_id=run_id,
        metrics=numbers(metrics),
        renamed=renamed,
    )
    write_model_files(run_dir.path, tensors, card)
    run_dir.save_model(state)


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric values (lists, text and unevaluated Nones left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def new_run_id() -> str:
    """An identifier for a run that has none of its own (a simulation); not a secret."""
    return uuid.uuid4().hex[:12]


def export_run(
    path: str | Path, out: str | Path | None = None, *, checkpoint: bool = False
) -> Path:
    """`fedtrain export RUN_DIR`: write RUN_DIR's model (its final `model.pt`, or with
    `checkpoint` / without a final model its last checkpoint) as safetensors with the
    task's names and a card, into `out` (default RUN_DIR). The task named in the run's
    config.json must be installed here: it gives the fingerprint and the names."""
    run_dir = RunDir(path)
    config_path = run_dir.path / "config.json"
    if not config_path.exists():
        raise ConfigError(f"{run_dir.path} has no config.json: not a fedtrain run directory")
    config = json.loads(config_path.read_text())
    task = load_task(config["task"], config.get("task_options"))
    head: dict[str, Any] = {}
    if run_dir.checkpoint_path.exists():
        head = load_tensor_file(run_dir.checkpoint_path, tensors=False)
    records = run_dir.read_metrics()
    if run_dir.model_path.exists() and not checkpoint:
        state = load_state(run_dir.model_path)
        server_round = int(head.get("round") or (records[-1]["round"] if records else 0))
    elif run_dir.checkpoint_path.exists() or run_dir.legacy_checkpoint_path.exists():
        server_round, state, _, extra = run_dir.load_checkpoint()
        head.setdefault("extra", extra)
        log.warning("exporting the checkpoint of round %d (not a final model)", server_round)
    else:
        raise ConfigError(f"{run_dir.path} has neither model.pt nor a checkpoint to export")
    record = next((r for r in reversed(records) if r.get("round") == server_round), {})
    tensors, renamed = exported_state(task, state)
    card = ModelCard(
        task=config["task"],
        task_fingerprint=task_fingerprint(task),
        round=server_round,
        run_id=str(head.get("extra", {}).get("run_id") or _previous_run_id(run_dir.path)),
        metrics=numbers(record),
        renamed=renamed,
    )
    target = Path(out) if out is not None else run_dir.path
    target.mkdir(parents=True, exist_ok=True)
    return write_model_files(target, tensors, card)


def _previous_run_id(directory: Path) -> str:
    """The run id an earlier export recorded (a simulation keeps it nowhere else)."""
    try:
        return str(json.loads((directory / SIDECAR).read_text()).get("run_id", ""))
    except (OSError, ValueError):
        return ""
