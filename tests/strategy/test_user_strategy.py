"""A user's own Strategy subclass, from a package outside fedtrain (examples/mylab).

`mylab` is on sys.path through pytest's `pythonpath` setting (pyproject.toml), as a
user's package would be through PYTHONPATH or pip.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mylab.strategies import WarmupCosineFedAvgM

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.strategy import build_strategy, strategy_class
from fedtrain.tensors import ModelState

REF = "mylab.strategies:WarmupCosineFedAvgM"
OPTIONS = {"server_lr": 1.5, "warmup_rounds": 2, "total_rounds": 5, "min_lr": 0.1, "momentum": 0.5}


def test_a_strategy_is_loaded_by_reference_with_its_options():
    strategy = build_strategy(REF, min_fit_clients=3, min_available_clients=3, **OPTIONS)
    assert isinstance(strategy, WarmupCosineFedAvgM)
    assert (strategy.server_lr, strategy.momentum, strategy.min_fit_clients) == (1.5, 0.5, 3)
    assert strategy.name == REF  # named by its reference when it sets no name


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fedavgx", {}, r"strategy\.name = 'fedavgx' is unknown.*'package\.module:ClassName'"),
        ("mylab.nope:Strategy", {}, r"strategy\.name = 'mylab\.nope:Strategy': cannot import"),
        ("mylab.strategies:Nope", {}, r"strategy\.name = .*: 'mylab\.strategies' has no 'Nope'"),
        ("mylab.strategies:", {}, r"must look like 'package\.module:ClassName'"),
        ("collections:OrderedDict", {}, r"the class OrderedDict, not a subclass of .*Strategy"),
        ("mylab.strategies:math", {}, r"the module .*, not a subclass of .*Strategy"),
        ("fedtrain.strategy:build_strategy", {}, r"the function build_strategy, not a subclass"),
        ("fedtrain.strategy.base:Strategy", {}, r"is abstract: define finalize_round"),
        (REF, {"warmup": 3}, r"strategy 'mylab.*unexpected keyword argument 'warmup'.*options"),
        (REF, {"momentum": 1.0}, r"strategy\.momentum must be in \[0, 1\)"),
    ],
)
def test_a_bad_strategy_reference_is_a_config_error_naming_the_key(name, options, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy(name, **options)


def test_sim_toml_names_a_user_strategy_and_its_options(tmp_path):
    config = sim_config(tmp_path, rounds=1)
    assert strategy_class(config.strategy.name) is WarmupCosineFedAvgM
    assert config.build_strategy().total_rounds == 5


def reference_run(global_w: np.ndarray, deltas, weights, opts) -> list[np.ndarray]:
    """Independent float64 reference of the documented update rule, round by round."""
    velocity = np.zeros_like(global_w)
    out = []
    for step, (round_deltas, round_weights) in enumerate(zip(deltas, weights, strict=True), 1):
        mean = sum(w * d for w, d in zip(round_weights, round_deltas, strict=True))
        mean = mean / sum(round_weights)
        if step <= opts["warmup_rounds"]:
            eta = opts["server_lr"] * step / opts["warmup_rounds"]
        else:
            warm, total = opts["warmup_rounds"], opts["total_rounds"]
            progress = min(1.0, (step - warm) / (total - warm))
            peak, floor = opts["server_lr"], opts["min_lr"]
            eta = floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
        velocity = opts["momentum"] * velocity + mean
        global_w = global_w + eta * velocity
        out.append(global_w)
    return out


def run_rounds(strategy, state: ModelState, deltas, weights) -> list[ModelState]:
    out = []
    for r, (round_deltas, round_weights) in enumerate(zip(deltas, weights, strict=True), 1):
        agg = strategy.begin_round(r, state)
        for d, w in zip(round_deltas, round_weights, strict=True):
            agg.add({"w": torch.tensor(d)}, float(w))
        state = strategy.finalize_round(r, state, agg)
        out.append(state)
    return out


def test_the_example_strategy_follows_its_documented_rule():
    rng = np.random.default_rng(1)
    rounds = 7  # past total_rounds: the rate stays at min_lr
    deltas = [[rng.normal(size=5) for _ in range(3)] for _ in range(rounds)]
    weights = [rng.integers(1, 50, size=3).tolist() for _ in range(rounds)]
    start = rng.normal(size=5)
    ours = run_rounds(
        build_strategy(REF, min_fit_clients=1, **OPTIONS),
        ModelState({"w": torch.tensor(start)}),
        deltas,
        weights,
    )
    want_all = reference_run(start, deltas, weights, OPTIONS)
    for r, (got, want) in enumerate(zip(ours, want_all, strict=True), 1):
        np.testing.assert_allclose(got["w"].numpy(), want, rtol=1e-12, err_msg=f"round {r}")


def test_its_state_is_checkpointed_and_a_resumed_run_matches_a_straight_one():
    rng = np.random.default_rng(2)
    deltas = [[rng.normal(size=5) for _ in range(2)] for _ in range(4)]
    weights = [[1, 3]] * 4
    start = ModelState({"w": torch.zeros(5, dtype=torch.float64)})
    straight = run_rounds(build_strategy(REF, **OPTIONS), start, deltas, weights)[-1]

    first = build_strategy(REF, **OPTIONS)
    mid = run_rounds(first, start, deltas[:2], weights[:2])[-1]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # what a server checkpoint holds
    buffer.seek(0)
    resumed = build_strategy(REF, **OPTIONS)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.steps == 2
    assert run_rounds(resumed, mid, deltas[2:], weights[2:])[-1].equal(straight)
    with pytest.raises(ConfigError, match="another strategy"):
        resumed.load_state_dict({"steps": 1, "buffers": {}})


def sim_config(tmp_path, rounds: int) -> SimConfig:
    return from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:SyntheticTask",
            "task_options": {"num_train": 600, "num_test": 200},
            "rounds": rounds,
            "num_clients": 4,
            "run_dir": str(tmp_path / "run"),
            "strategy": {
                "name": REF,
                "min_fit_clients": 4,
                "min_available_clients": 4,
                "options": OPTIONS,
            },
            "client": {"epochs": 1, "batch_size": 32, "lr": 0.2},
        },
    )


def test_a_user_strategy_runs_a_simulation(tmp_path):
    history = run_simulation(sim_config(tmp_path, rounds=5)).history
    assert [r["server_steps"] for r in history] == [1, 2, 3, 4, 5]
    want = [0.75, 1.5, 1.15, 0.45, 0.1]  # warmup 1.5 x 1/2, 2/2; cosine to 0.1 by step 5
    assert [r["server_lr"] for r in history] == pytest.approx(want)
    assert history[-1]["accuracy"] > 0.8


def test_the_readme_shows_the_example_module_as_it_ships():
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    marker = "<!-- example:examples/mylab/strategies.py:{} -->"
    block = readme.split(marker.format("start"))[1].split(marker.format("end"))[0]
    source = (root / "examples" / "mylab" / "strategies.py").read_text()
    assert block.strip() == f"```python\n{source}```"
