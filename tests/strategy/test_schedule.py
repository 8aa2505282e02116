"""Per-round client config: `[client_schedule]` decays and the `round_config` hook."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.runtime.config import ServerConfig
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.strategy import FedAvg, RoundConfig, Schedule, build_strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # LrProbeTask

RNG = np.random.default_rng(0)


def torch_lrs(make_scheduler, base: float, rounds: int) -> list[float]:
    """The learning rates torch's own scheduler gives epochs 1..rounds (the reference)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    scheduler = make_scheduler(opt)
    out = []
    for _ in range(rounds):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    ("schedule", "reference"),
    [
        (
            Schedule("step", gamma=0.5, step_size=3),
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        ),
        (
            Schedule("exponential", gamma=0.9),
            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ),
        (
            Schedule("cosine", min_value=0.001, rounds=12),
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12, eta_min=0.001),
        ),
    ],
)
def test_decays_match_torchs_lr_schedulers(schedule, reference):
    ours = [schedule.value(0.1, r) for r in range(1, 13)]
    np.testing.assert_allclose(ours, torch_lrs(reference, 0.1, 12), rtol=1e-12)


def test_cosine_holds_its_floor_after_its_rounds_and_integers_stay_integers():
    cosine = Schedule("cosine", min_value=0.01, rounds=4)
    assert cosine.value(0.1, 5) == cosine.value(0.1, 50) == pytest.approx(0.01)
    step = Schedule("step", gamma=2.0, step_size=2)
    assert [step.value(1, r) for r in range(1, 7)] == [1, 1, 2, 2, 4, 4]
    assert all(isinstance(step.value(1, r), int) for r in range(1, 7))


def test_piecewise_takes_the_value_of_the_latest_round_reached():
    piecewise = Schedule("piecewise", values={"3": 2, "10": 4})
    assert [piecewise.value(1, r) for r in (1, 2, 3, 9, 10, 99)] == [1, 1, 2, 2, 4, 4]


def test_a_strategy_refuses_a_cosine_schedule_of_unknown_length():
    with pytest.raises(ConfigError, match=r"client_schedule\.lr: a cosine schedule needs"):
        FedAvg(client_config={"lr": 0.1}, client_schedule={"lr": Schedule("cosine")})
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:SyntheticTask",
            "rounds": 8,
            "client": {"lr": 0.1},
            "client_schedule": {"lr": {"decay": "cosine"}},
        },
    )
    assert config.build_strategy().client_schedule["lr"].rounds == 8  # the run's rounds


def test_the_strategy_hands_out_the_scheduled_config_each_round():
    strategy = FedAvg(
        min_fit_clients=1,
        min_available_clients=1,
        client_config={"lr": 0.1, "epochs": 1, "batch_size": 32},
        client_schedule={
            "lr": Schedule("step", gamma=0.1, step_size=2),
            "epochs": Schedule("piecewise", values={"3": 2}),
        },
    )
    plans = [strategy.configure_round(r, ["a", "b"], RNG) for r in (1, 2, 3)]
    got = [(p["a"]["lr"], p["a"]["epochs"], p["b"]["round"]) for p in plans]
    assert got == [(0.1, 1, 1), (0.1, 1, 2), (pytest.approx(0.01), 2, 3)]
    assert strategy.client_config["lr"] == 0.1  # the base is never changed


class PerClientLr(FedAvg):
    """Flower's on_fit_config_fn, per client: client "b" trains at half the lr."""

    def round_config(
        self, server_round: int, client_id: str, base_config: RoundConfig
    ) -> RoundConfig:
        if client_id == "b":
            base_config["lr"] = base_config["lr"] / 2
        return {**base_config, "local_steps": 10 * server_round}


def test_round_config_overrides_see_the_scheduled_base_and_change_one_client():
    strategy = PerClientLr(
        min_fit_clients=2,
        client_config={"lr": 0.2},
        client_schedule={"lr": Schedule("exponential", gamma=0.5)},
    )
    plan = strategy.configure_round(2, ["a", "b"], RNG)
    assert plan == {
        "a": {"lr": 0.1, "round": 2, "local_steps": 20},
        "b": {"lr": 0.05, "round": 2, "local_steps": 20},
    }


def test_asynchronous_jobs_follow_the_model_version_they_train_toward():
    fedbuff = build_strategy(
        "fedbuff",
        client_config={"lr": 0.1},
        client_schedule={"lr": Schedule("step", gamma=0.5, step_size=1)},
    )
    config = fedbuff.job_config(17, 2, "client-3")  # job 17, from version 2: version 3's lr
    assert config == {"lr": 0.025, "round": 17, "version": 2}


@pytest.mark.parametrize(
    ("schedule", "client", "message"),
    [
        ({"lr": {"decay": "step", "gamma": 0.0}}, {"lr": 0.1}, r"client_schedule\.lr\.gamma"),
        ({"lr": {"decay": "step"}}, {}, r"client_schedule\.lr decays client\.lr, which is not set"),
        ({"lr": {"decay": "cosine"}}, {"lr": "fast"}, r"client\.lr, which is 'fast'"),
        ({"lr": {"decay": "piecewise"}}, {"lr": 0.1}, r"client_schedule\.lr.*needs values"),
        (
            {"lr": {"decay": "piecewise", "values": {"first": 0.1}}},
            {},
            r"client_schedule\.lr\.values key 'first'",
        ),
        (
            {"mu": {"decay": "piecewise", "values": {"5": 0.1}}},
            {},
            r"client_schedule\.mu starts at round 5",
        ),
        (
            {"lr": {"decay": "step", "values": {"1": 1}}},
            {"lr": 0.1},
            r"client_schedule\.lr\.values",
        ),
        ({"lr": {"decay": "linear"}}, {"lr": 0.1}, r"client_schedule\.lr\.decay"),
        ({"round": {"decay": "step"}}, {"round": 1}, r"client_schedule\.round"),
    ],
)
@pytest.mark.parametrize("config_cls", [SimConfig, ServerConfig])
def test_bad_schedules_are_refused_naming_the_key(config_cls, schedule, client, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(
            config_cls,
            {
                "task": "fedtrain.examples:SyntheticTask",
                "client": client,
                "client_schedule": schedule,
            },
        )


def test_a_learning_rate_schedule_in_sim_toml_reaches_training(tmp_path):
    config = from_dict(
        SimConfig,
        {
            "task": "runtime_support:LrProbeTask",
            "rounds": 5,
            "num_clients": 3,
            "run_dir": str(tmp_path / "run"),
            "strategy": {"min_fit_clients": 3, "min_available_clients": 3},
            "client": {"epochs": 1, "batch_size": 50, "lr": 0.4},
            "client_schedule": {
                "lr": {"decay": "step", "gamma": 0.5, "step_size": 2},
                "epochs": {"decay": "piecewise", "values": {"4": 2}},
            },
        },
    )
    history = run_simulation(config).history
    assert [r["lr_used"] for r in history] == pytest.approx([0.4, 0.4, 0.2, 0.2, 0.1])
    assert [r["epochs_used"] for r in history] == [1, 1, 1, 2, 2]
