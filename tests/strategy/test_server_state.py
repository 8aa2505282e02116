"""Strategy state survives checkpoints; robust strategies keep integer buffers sane."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.strategy import STRATEGIES, build_strategy
from fedtrain.tensors import ModelState


def rounds(strategy, state, deltas_per_round):
    for r, deltas in enumerate(deltas_per_round, start=1):
        agg = strategy.begin_round(r, state)
        for d, w in deltas:
            agg.add(d, w)
        state = strategy.finalize_round(r, state, agg)
    return state


def random_rounds(seed, n_rounds=4):
    rng = torch.Generator().manual_seed(seed)
    return [
        [
            ({"w": torch.randn(6, generator=rng), "n": torch.tensor(1)}, float(k + 1))
            for k in range(3)
        ]
        for _ in range(n_rounds)
    ]


# Noise-free DP-FedAvg is deterministic; its adaptive clip norm is the state under test.
OPTIONS = {"dpfedavg": {"noise_multiplier": 0.0, "adaptive_clipping": True, "clip_count_std": 0.0}}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_checkpoint_resume_gives_the_same_model(name):
    """Run 4 rounds straight, or 2 rounds + save/load state (through torch.save) + 2."""
    start = ModelState({"w": torch.zeros(6), "n": torch.tensor(0)})
    data = random_rounds(0)
    opts = OPTIONS.get(name, {})
    straight = rounds(build_strategy(name, **opts), start, data)

    first = build_strategy(name, **opts)
    mid = rounds(first, start, data[:2])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = build_strategy(name, **opts)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert rounds(resumed, mid, data[2:]).equal(straight)


def test_integer_buffers_stay_integers_under_every_strategy():
    start = ModelState({"w": torch.zeros(3), "n": torch.tensor(10)})
    for name in STRATEGIES:
        out = rounds(
            build_strategy(name), start, [[({"w": torch.ones(3), "n": torch.tensor(2)}, 1.0)] * 3]
        )
        assert out["n"].dtype == torch.int64 and out["n"].item() == 12, name


def test_robust_strategies_say_they_need_every_update():
    needs_all = {n for n, cls in STRATEGIES.items() if not cls.needs_only_sum}
    assert needs_all == {"fedmedian", "fedtrimmedavg", "krum", "dpfedavg"}


def test_median_and_krum_resist_an_outlier():
    start = ModelState({"w": torch.zeros(4)})
    honest = [({"w": torch.full((4,), 1.0 + 0.01 * i)}, 10.0) for i in range(4)]
    attack = [({"w": torch.full((4,), 1e6)}, 1000.0)]
    for name in ("fedmedian", "fedtrimmedavg", "krum"):
        opts = {"num_malicious": 1} if name == "krum" else {}
        out = rounds(build_strategy(name, **opts), start, [honest + attack])
        assert float(out["w"].max()) < 1.1, name
    fedavg = rounds(build_strategy("fedavg"), start, [honest + attack])
    assert float(fedavg["w"].max()) > 1e5


def test_fedprox_sends_mu_and_validates_it():
    s = build_strategy("fedprox", proximal_mu=0.1)
    plan = s.configure_round(1, ["a", "b"], np.random.default_rng(0))
    assert all(cfg["proximal_mu"] == 0.1 for cfg in plan.values())
    with pytest.raises(ConfigError, match="proximal_mu"):
        build_strategy("fedprox", proximal_mu=-1.0)


@pytest.mark.parametrize(
    ("name", "opts", "key"),
    [
        ("fedadam", {"beta_1": 1.0}, "beta_1"),
        ("fedyogi", {"tau": 0.0}, "tau"),
        ("fedavgm", {"server_momentum": 1.5}, "server_momentum"),
        ("fedavgm", {"server_lr": 0.0}, "server_lr"),
        ("fedtrimmedavg", {"beta": 0.5}, "beta"),
        ("krum", {"num_malicious": -1}, "num_malicious"),
        ("fedavg", {"server_lr": 1.0}, "server_lr"),
    ],
)
def test_bad_strategy_options_name_the_key(name, opts, key):
    with pytest.raises(ConfigError, match=key):
        build_strategy(name, **opts)


def test_loading_another_strategys_state_is_refused():
    adam = build_strategy("fedadam")
    with pytest.raises(ConfigError, match="another strategy"):
        adam.load_state_dict({"momentum": 1})
