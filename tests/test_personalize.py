"""Personalization's core: what a site is asked, what it spends, and on what copy."""

from __future__ import annotations

import logging

import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.examples import SyntheticTask
from fedtrain.personalize import (
    PERSONALIZE_KEY,
    ask_to_personalize,
    check_epochs,
    epochs_to_spend,
    personalized_evaluation,
    with_personalized,
)
from fedtrain.task import EvalResult, TaskContext, model_for
from fedtrain.tensors import ModelState


def test_the_plan_asks_for_the_epochs_unless_the_strategy_chose_its_own():
    plan = {"a": {"lr": 0.1}, "b": {"lr": 0.1, PERSONALIZE_KEY: 3}}
    assert ask_to_personalize(plan, 0) == plan
    assert ask_to_personalize(plan, 2) == {
        "a": {"lr": 0.1, PERSONALIZE_KEY: 2},
        "b": {"lr": 0.1, PERSONALIZE_KEY: 3},
    }
    assert plan["a"] == {"lr": 0.1}  # the strategy's configs are not changed


@pytest.mark.parametrize(
    ("asked", "cap", "spent"),
    [
        (None, 10, 0),
        (0, 10, 0),
        (3, 10, 3),
        (3.0, 10, 3),
        (10, 10, 10),
        (11, 10, 0),  # over the site's cap: refused, not shortened
        (2, 0, 0),  # personalize_max_epochs = 0: the site refuses
        (-1, 10, 0),
        (2.5, 10, 0),
        ("2", 10, 0),
        (float("inf"), 10, 0),
        (float("nan"), 10, 0),
        (True, 10, 0),
    ],
)
def test_a_site_spends_what_it_is_asked_up_to_its_cap(asked, cap, spent, caplog):
    config = {} if asked is None else {PERSONALIZE_KEY: asked}
    with caplog.at_level(logging.INFO):
        assert epochs_to_spend(config, cap, "round 4: evaluation") == spent
    if asked not in (None, 0) and spent == 0:
        assert "round 4: evaluation" in caplog.text


def test_a_negative_epoch_count_is_refused_when_the_config_is_read():
    check_epochs(0, "personalize_epochs")
    with pytest.raises(ConfigError, match="personalize_epochs = -1 must be"):
        check_epochs(-1, "personalize_epochs")


def test_the_fine_tuning_runs_on_a_copy_and_leaves_the_client_state_alone():
    task = SyntheticTask(num_train=200, num_test=50)
    train, test = task.datasets()
    model = model_for(task, 0)
    before = ModelState.from_module(model).digest()
    state = {"control": torch.ones(3)}
    context = TaskContext(client_id="site", seed=1, client_state=state)
    config = {"epochs": 1, "lr": 0.5, "batch_size": 16}
    plain = task.evaluate(model, test, config, context)
    mine = personalized_evaluation(task, model, train, test, config, context, epochs=3)
    assert ModelState.from_module(model).digest() == before
    assert context.client_state is state and torch.equal(state["control"], torch.ones(3))
    assert mine.num_examples == plain.num_examples
    assert mine.loss < plain.loss  # three epochs moved the copy


def test_the_personalized_figures_ride_beside_the_global_ones():
    merged = with_personalized(
        EvalResult(40, 0.7, {"accuracy": 0.6}), EvalResult(40, 0.2, {"accuracy": 0.9})
    )
    assert merged == EvalResult(
        40, 0.7, {"accuracy": 0.6, "personalized_loss": 0.2, "personalized_accuracy": 0.9}
    )
