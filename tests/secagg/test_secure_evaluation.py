"""Secure evaluation's vector: the personalized figures are summed under the masks too,
and evaluation weights have their own bound (distributed DP trains with weight 1)."""

from __future__ import annotations

import numpy as np
import pytest

from fedtrain.config import from_dict
from fedtrain.errors import SecAggError
from fedtrain.secagg.evaluation import EVAL_VALUES, secure_evaluation
from fedtrain.secagg.settings import SecAggSettings
from fedtrain.task import EvalResult


def personalized(loss: float, accuracy: float) -> dict[str, float]:
    return {"personalized_loss": loss, "personalized_accuracy": accuracy}


SITES = [
    EvalResult(120, 0.9, {"accuracy": 0.55, **personalized(0.3, 0.9)}),
    EvalResult(45, 1.2, {"accuracy": 0.40, **personalized(0.5, 0.8)}),
    EvalResult(300, 0.6, {"accuracy": 0.75}),  # refused to personalize
]


def mean(results, key):
    n = sum(r.num_examples for r in results)
    return sum(r.num_examples * (r.loss if key == "loss" else r.metrics[key]) for r in results) / n


def test_the_personalized_totals_cover_the_sites_that_personalized():
    settings = from_dict(SecAggSettings, {"enabled": True, "max_clients": 8, "max_weight": 1000})
    totals, result = secure_evaluation(SITES, settings.evaluation_protocol(), rng=7)
    assert result.total.shape == (len(EVAL_VALUES) + 1,)
    bound = result.quantizer.mean_error_bound(3, 465)
    assert (totals.num_examples, totals.sites) == (465, 3)
    assert abs(totals.accuracy - mean(SITES, "accuracy")) <= bound
    assert totals.personalized_examples == 165
    tuned = SITES[:2]
    p_bound = result.quantizer.mean_error_bound(3, 165)
    assert abs(totals.personalized_loss - mean(tuned, "personalized_loss")) <= p_bound
    assert abs(totals.personalized_accuracy - mean(tuned, "personalized_accuracy")) <= p_bound
    assert set(totals.metrics()) == {"loss", "accuracy", *personalized(0, 0)}


def test_without_personalization_the_totals_have_no_personalized_figures():
    plain = [EvalResult(r.num_examples, r.loss, {"accuracy": r.metrics["accuracy"]}) for r in SITES]
    settings = from_dict(SecAggSettings, {"enabled": True, "max_clients": 8, "max_weight": 1000})
    totals, _ = secure_evaluation(plain, settings.evaluation_protocol(), rng=3)
    assert totals.personalized_examples == 0
    assert totals.personalized_loss is None and totals.personalized_accuracy is None
    assert set(totals.metrics()) == {"loss", "accuracy"}


DP = {
    "enabled": True,
    "max_clients": 8,
    "clip": 4.0,
    "max_weight": 1.0,
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 0.5, "min_survivors": 2},
}


def test_under_distributed_dp_with_max_weight_1_an_evaluation_still_sums():
    settings = from_dict(SecAggSettings, DP)
    assert settings.protocol().max_weight == 1.0  # training: weight 1 per site
    protocol = settings.evaluation_protocol()
    assert protocol.max_weight == 100_000.0 and protocol.dp_noise_multiplier == 0.0
    totals, result = secure_evaluation(SITES, protocol, rng=5)
    assert totals.num_examples == 465
    assert abs(totals.loss - mean(SITES, "loss")) <= result.quantizer.mean_error_bound(3, 465)


def test_max_eval_weight_bounds_an_evaluation_and_says_so():
    settings = from_dict(SecAggSettings, {**DP, "max_eval_weight": 100.0})
    with pytest.raises(SecAggError, match="exceeds max_weight 100"):
        secure_evaluation(SITES, settings.evaluation_protocol(), rng=5)
    without_dp = from_dict(SecAggSettings, {"enabled": True, "max_weight": 5000.0})
    assert without_dp.evaluation_protocol().max_weight == 5000.0  # 0: the training bound


def test_a_negative_max_eval_weight_is_refused():
    from fedtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"secagg\.max_eval_weight must be >= 0"):
        from_dict(SecAggSettings, {"enabled": True, "max_eval_weight": -1.0})


def test_the_vector_holds_the_personalized_figures_only_when_there_are_some():
    from fedtrain.secagg.evaluation import eval_vector

    values, weight = eval_vector(SITES[0])
    assert weight == 120.0
    assert dict(zip(EVAL_VALUES, values.tolist(), strict=True)) == {
        "loss": 0.9,
        "accuracy": 0.55,
        "has_accuracy": 1.0,
        "personalized_loss": 0.3,
        "personalized_accuracy": 0.9,
        "has_personalized_accuracy": 1.0,
        "personalized": 1.0,
    }
    assert np.all(eval_vector(SITES[2])[0][3:] == 0.0)
