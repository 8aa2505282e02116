"""Secure evaluation: the sites' held-out evaluations summed under SecAgg+ masks.

Under secure aggregation a site's evaluation metrics would tell the server about
its data (its example count, how well the model fits it) just as its update would,
so evaluation runs through the same protocol: each site masks a small vector, and
the server unmasks only the federation's totals.

The vector is fixed, so the server and every site agree on it without exchanging
anything (:data:`EVAL_VALUES`): the site's mean loss, its accuracy (0 when the task
reports none) and 1 if it reported one; then the same three for its personalized
model (`fedtrain.personalize`; zeros when the site did not personalize); the weight
is the site's example count. The protocol multiplies each value by the weight inside
the masked vector, so the unmasked sum is ``(sum n_i * loss_i, sum n_i * acc_i, sum
n_i [acc reported], ..., sum n_i)``: the loss sums, the correct counts and the
example counts, and nothing per site. Other metrics a task reports are not
aggregated (they would need names agreed in advance); the sites log them.

Values are clipped to ``[-eval_clip, eval_clip]`` (``secagg.eval_clip``) before
quantization, as an update is to ``secagg.clip``: a loss above it is reported as
``eval_clip`` (the site warns). The weight is bounded by ``secagg.max_eval_weight``,
not the training ``max_weight`` (distributed DP trains with weights of 1, while an
evaluation is weighted by its example count). The error of a mean is below ``n *
step / total examples`` with ``step = 2 * eval_clip * max_eval_weight / (2^bits -
1)`` (`fedtrain.secagg.quantize`). Distributed DP's noise is not added to evaluation
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
from fedtrain.personalize import PREFIX
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.inmemory import run_in_memory
from fedtrain.secagg.protocol import SecAggResult
from fedtrain.task import EvalResult

#: What each value of a site's masked evaluation vector is (times its example count).
EVAL_VALUES = (
    "loss",
    "accuracy",
    "has_accuracy",
    f"{PREFIX}loss",
    f"{PREFIX}accuracy",
    f"has_{PREFIX}accuracy",
    "personalized",
)


def evaluation_protocol(
    training: SecAggConfig, eval_clip: float, max_eval_weight: float
) -> SecAggConfig:
    """The protocol configuration of a secure evaluation: the training one, with
    values clipped to `eval_clip`, weights (example counts) up to `max_eval_weight`
    and no distributed-DP noise."""
    return dataclasses.replace(
        training,
        clip=eval_clip,
        max_weight=max_eval_weight,
        dp_noise_multiplier=0.0,
        dp_clip_norm=0.0,
        dp_min_survivors=0,
    )


def eval_vector(result: EvalResult) -> tuple[np.ndarray, float]:
    """A site's evaluation as (values, weight) for the masked sum (see the module doc)."""
    loss = result.metrics.get(f"{PREFIX}loss")
    values = [
        result.loss,
        *_accuracy(result.metrics.get("accuracy")),
        0.0 if loss is None else loss,
        *_accuracy(result.metrics.get(f"{PREFIX}accuracy")),
        0.0 if loss is None else 1.0,
    ]
    return np.array(values, dtype=np.float64), float(result.num_examples)


def _accuracy(value: float | None) -> tuple[float, float]:
    """(accuracy, reported) with 0 for an accuracy not reported."""
    return (0.0, 0.0) if value is None else (float(value), 1.0)


@dataclass(frozen=True)
class EvalTotals:
    """What the server learns from a secure evaluation: the federation's totals."""

    #: Held-out examples over the included sites.
    num_examples: int
    #: Sites whose evaluation is in the sum.
    sites: int
    loss: float
    accuracy: float | None
    #: Held-out examples of the sites that personalized (up to quantization; 0: none).
    personalized_examples: int = 0
    personalized_loss: float | None = None
    personalized_accuracy: float | None = None

    def metrics(self) -> dict[str, float]:
        """As the flat metrics a strategy aggregates (`fedtrain.evaluation.eval_metrics`)."""
        figures = {
            "loss": self.loss,
            "accuracy": self.accuracy,
            f"{PREFIX}loss": self.personalized_loss,
            f"{PREFIX}accuracy": self.personalized_accuracy,
        }
        return {k: v for k, v in figures.items() if v is not None}


def eval_totals(result: SecAggResult) -> EvalTotals:
    """Decode an unmasked evaluation sum into the federation's means.

    A count of examples ("with accuracy", "personalized") is a sum of 0s and 1s times
    example counts, off by less than the quantization error ``n * step``: a part of
    the federation smaller than that cannot be told from none, and has no mean."""
    sums, examples = result.weighted_sum()
    if sums.shape != (len(EVAL_VALUES),):
        raise SecAggError(
            f"an evaluation sum has {len(EVAL_VALUES)} values, this one {sums.shape[0]}"
        )
    if examples <= 0:
        raise SecAggError("the included sites evaluated on 0 examples in total; no mean exists")
    loss_sum, correct, with_accuracy, p_loss, p_correct, p_with_accuracy, p_examples = (
        float(v) for v in sums
    )
    noise = max(len(result.included) * result.quantizer.step, 0.5)
    personalized = p_examples > noise
    return EvalTotals(
        round(examples),
        len(result.included),
        loss_sum / examples,
        _mean(correct, with_accuracy, noise),
        round(p_examples) if personalized else 0,
        p_loss / p_examples if personalized else None,
        _mean(p_correct, p_with_accuracy, noise),
    )


def _mean(total: float, count: float, noise: float) -> float | None:
    """`total / count`, None when `count` is within the quantization `noise` of 0."""
    return total / count if count > noise else None


def secure_evaluation(
    results: Sequence[EvalResult], config: SecAggConfig, **options: Any
) -> tuple[EvalTotals, SecAggResult]:
    """One secure evaluation in memory over `results` (site i is secagg id i + 1);
    `options` are :func:`~fedtrain.secagg.inmemory.run_in_memory`'s (dropouts,
    round_id, rng, graph_seed, min_included). Raises SecAggError when it fails."""
    vectors, weights = zip(*(eval_vector(r) for r in results), strict=True)
    result = run_in_memory(list(vectors), list(weights), config, **options)
    return eval_totals(result), result
