"""What workers report back during a round, the same objects for every backend.

A worker trains its share of the round's clients and emits, in order: progress
ticks, one `ClientResult` per client, and a closing `ShareDone`. Backends that cross
a process boundary move tensors in flat buffers beside these objects (see
`transport`), so the objects themselves stay small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedtrain.tensors import ModelState


@dataclass(frozen=True)
class ClientsDone:
    """Progress: `done` of the worker's clients have finished training this round."""

    worker: int
    done: int


@dataclass(frozen=True)
class ClientResult:
    """One client's outcome.

    `delta` is the update when the driver folds updates itself; it is None when the
    worker already folded it into its partial sum, or when the update was rejected
    (`rejected` says why: NaN/Inf, wrong shape, non-positive weight). `upload_bytes`
    is what its upload took on the wire (encoded, when a codec is configured).
    """

    client_id: str
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    delta: ModelState | None = None
    rejected: str | None = None
    upload_bytes: int = 0


@dataclass(frozen=True)
class ShareDone:
    """The worker finished its share; with worker-side folding, its partial sum.

    `results` are the share's client results whose updates were folded here (or
    rejected); `sums` holds sum_i w_i * delta_i per tensor as flat accumulators
    (None when the driver folds), `total_weight` and `count` the matching totals.
    """

    worker: int
    results: tuple[ClientResult, ...] = ()
    sums: dict[str, torch.Tensor] | None = None
    total_weight: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class WorkerFailed:
    """The worker raised; the driver re-raises with this traceback."""

    worker: int
    client_id: str | None
    message: str
    traceback: str


WorkerEvent = ClientsDone | ClientResult | ShareDone
