"""Secure evaluation: the sites' held-out evaluations summed under SecAgg+ masks.

Under secure aggregation a site's evaluation metrics would tell the server about
its data (its example count, how well the model fits it) just as its update would,
so evaluation runs through the same protocol: each site masks a small vector, and
the server unmasks only the federation's totals.

The vector is fixed, so the server and every site agree on it without exchanging
anything (:data:`EVAL_VALUES`): the site's mean loss, its accuracy (0 when the task
reports none) and 1 if it reported one; the weight is the site's example count.
The protocol multiplies each value by the weight inside the masked vector, so the
unmasked sum is ``(sum n_i * loss_i, sum n_i * acc_i, sum n_i [acc reported], sum
n_i)``: the loss sum, the correct count and the example counts, and nothing per
site. Other metrics a task reports are not aggregated (they would need names agreed
in advance); the sites log them.

Values are clipped to ``[-eval_clip, eval_clip]`` (``secagg.eval_clip``) before
quantization, as an update is to ``secagg.clip``: a loss above it is reported as
``eval_clip`` (the site warns). The error of a mean is below ``n * step / total
examples`` with ``step = 2 * eval_clip * max_weight / (2^bits - 1)``
(`fedtrain.secagg.quantize`). Distributed DP's noise is not added to evaluation
sums: the totals are exact up to quantization.

:func:`secure_evaluation` runs one such exchange in memory (the simulation);
the runtime moves the same messages over the sites' control streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.inmemory import run_in_memory
from fedtrain.secagg.protocol import SecAggResult
from fedtrain.task import EvalResult

#: What each value of a site's masked evaluation vector is (times its example count).
EVAL_VALUES = ("loss", "accuracy", "has_accuracy")


def evaluation_protocol(training: SecAggConfig, eval_clip: float) -> SecAggConfig:
    """The protocol configuration of a secure evaluation: the training one, with
    values clipped to `eval_clip` and no distributed-DP noise."""
    return dataclasses.replace(
        training, clip=eval_clip, dp_noise_multiplier=0.0, dp_clip_norm=0.0, dp_min_survivors=0
    )


def eval_vector(result: EvalResult) -> tuple[np.ndarray, float]:
    """A site's evaluation as (values, weight) for the masked sum (see the module doc)."""
    accuracy = result.metrics.get("accuracy")
    values = np.array(
        [result.loss, 0.0 if accuracy is None else accuracy, 0.0 if accuracy is None else 1.0],
        dtype=np.float64,
    )
    return values, float(result.num_examples)


@dataclass(frozen=True)
class EvalTotals:
    """What the server learns from a secure evaluation: the federation's totals."""

    #: Held-out examples over the included sites.
    num_examples: int
    #: Sites whose evaluation is in the sum.
    sites: int
    loss: float
    accuracy: float | None

    def metrics(self) -> dict[str, float]:
        """As the flat metrics a strategy aggregates (`fedtrain.evaluation.eval_metrics`)."""
        out = {"loss": self.loss}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


def eval_totals(result: SecAggResult) -> EvalTotals:
    """Decode an unmasked evaluation sum into the federation's means."""
    sums, examples = result.weighted_sum()
    if sums.shape != (len(EVAL_VALUES),):
        raise SecAggError(
            f"an evaluation sum has {len(EVAL_VALUES)} values, this one {sums.shape[0]}"
        )
    if examples <= 0:
        raise SecAggError("the included sites evaluated on 0 examples in total; no mean exists")
    loss_sum, correct, with_accuracy = (float(v) for v in sums)
    # A site reports accuracy or not as a whole, so "with accuracy" is a count of
    # examples up to quantization; half of them is the threshold for "reported".
    accuracy = correct / with_accuracy if with_accuracy >= examples / 2 else None
    return EvalTotals(round(examples), len(result.included), loss_sum / examples, accuracy)


def secure_evaluation(
    results: Sequence[EvalResult], config: SecAggConfig, **options: Any
) -> tuple[EvalTotals, SecAggResult]:
    """One secure evaluation in memory over `results` (site i is secagg id i + 1);
    `options` are :func:`~fedtrain.secagg.inmemory.run_in_memory`'s (dropouts,
    round_id, rng, graph_seed, min_included). Raises SecAggError when it fails."""
    vectors, weights = zip(*(eval_vector(r) for r in results), strict=True)
    result = run_in_memory(list(vectors), list(weights), config, **options)
    return eval_totals(result), result
