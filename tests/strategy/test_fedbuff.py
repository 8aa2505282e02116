"""FedBuff's server math against a float64 reference, staleness weighting and dropping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.secagg.settings import require_sum_only
from fedtrain.strategy import FedBuff, StaleUpdate, build_strategy
from fedtrain.strategy.fedbuff import staleness_function
from fedtrain.tensors import ModelState


def reference(x, updates, lr, weigh):
    """x + lr * sum n s(tau) delta / sum n, in float64 numpy (updates: delta, n, tau)."""
    total = sum(n for _, n, _ in updates)
    step = sum(n * weigh(tau) * d.astype(np.float64) for d, n, tau in updates) / total
    return x.astype(np.float64) + lr * step


def random_updates(rng, shape, count, max_tau):
    return [
        (rng.standard_normal(shape), float(rng.integers(1, 50)), int(rng.integers(0, max_tau + 1)))
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("kind", "opts"),
    [
        ("polynomial", {}),
        ("polynomial", {"staleness_exponent": 1.3}),
        ("hinge", {"hinge_slope": 2.0, "hinge_threshold": 1}),
        ("constant", {}),
    ],
)
def test_float64_model_matches_the_reference(kind, opts):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 4))
    version = 6
    updates = random_updates(rng, (5, 4), count=4, max_tau=5)
    strategy = FedBuff(buffer_size=4, server_lr=0.7, staleness=kind, **opts)
    state = ModelState({"w": torch.from_numpy(x.copy())})
    buffer = strategy.begin_round(version + 1, state)
    for delta, n, tau in updates:
        buffer.stage(version - tau)
        flat = torch.from_numpy(delta.reshape(-1))
        buffer.add_chunk("w", 0, flat[:7], n)  # streamed in two chunks, as off the wire
        buffer.add_chunk("w", 7, flat[7:], n)
        buffer.commit(n)
    assert strategy.buffer_full(buffer)
    out = strategy.finalize_round(version + 1, state, buffer)
    want = reference(x, updates, 0.7, strategy.weigh)
    np.testing.assert_allclose(out["w"].numpy(), want, rtol=1e-12, atol=1e-12)
    metrics = strategy.round_metrics()
    assert metrics["staleness_max"] == max(t for _, _, t in updates)
    assert metrics["staleness_mean"] == pytest.approx(np.mean([t for _, _, t in updates]))
    assert metrics["staleness_weight_mean"] == pytest.approx(
        np.mean([strategy.weigh(t) for _, _, t in updates])
    )


def test_float32_and_integer_buffers_follow_the_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(300).astype(np.float32)
    updates = random_updates(rng, 300, count=10, max_tau=8)
    strategy = build_strategy("fedbuff", buffer_size=10, server_lr=1.5)
    state = ModelState({"w": torch.from_numpy(x), "steps": torch.tensor(40)})
    buffer = strategy.begin_round(11, state)
    for delta, n, tau in updates:
        buffer.stage(10 - tau)
        buffer.add({"w": torch.from_numpy(delta.astype(np.float32)), "steps": torch.tensor(4)}, n)
    out = strategy.finalize_round(11, state, buffer)
    want = reference(x, [(d.astype(np.float32), n, t) for d, n, t in updates], 1.5, strategy.weigh)
    assert out["w"].dtype == torch.float32
    np.testing.assert_allclose(out["w"].numpy(), want, rtol=1e-5, atol=1e-5)
    # the integer buffer moves by the same weighted mean (4 * mean weight * lr), rounded
    factor = sum(n * strategy.weigh(t) for _, n, t in updates) / sum(n for _, n, _ in updates)
    assert out["steps"].dtype == torch.int64
    assert out["steps"].item() == round(40 + 1.5 * 4 * factor)


def test_default_staleness_is_one_over_sqrt_one_plus_s():
    weigh = FedBuff().weigh
    assert [weigh(s) for s in (0, 3, 8, 15)] == [1.0, 0.5, pytest.approx(1 / 3), 0.25]
    hinge = staleness_function("hinge", hinge_slope=10.0, hinge_threshold=4)
    assert [hinge(s) for s in (0, 4, 5, 6)] == [1.0, 1.0, pytest.approx(1 / 11), 1 / 21]
    assert staleness_function("constant")(1000) == 1.0
    assert staleness_function("polynomial", exponent=1.0)(4) == pytest.approx(0.2)


def test_a_stale_buffer_moves_the_model_less():
    """Same updates, all 3 versions stale: half the step of a fresh buffer (1/sqrt(4))."""
    state = ModelState({"w": torch.zeros(4, dtype=torch.float64)})
    steps = {}
    for tau in (0, 3):
        strategy = FedBuff(buffer_size=2)
        buffer = strategy.begin_round(10, state)
        for value, n in ((1.0, 10.0), (3.0, 30.0)):
            buffer.stage(9 - tau)
            buffer.add({"w": torch.full((4,), value, dtype=torch.float64)}, n)
        steps[tau] = strategy.finalize_round(10, state, buffer)["w"]
    assert torch.equal(steps[0], torch.full((4,), 2.5, dtype=torch.float64))  # FedAvg's mean
    assert torch.equal(steps[3], steps[0] / 2)


def test_updates_beyond_max_staleness_are_dropped_and_counted():
    strategy = FedBuff(buffer_size=2, max_staleness=2)
    state = ModelState({"w": torch.zeros(3)})
    buffer = strategy.begin_round(8, state)  # applies to version 7
    with pytest.raises(StaleUpdate, match=r"3 versions stale .*max_staleness = 2"):
        buffer.stage(4)
    assert buffer.count == 0 and buffer.stale_dropped == 1
    assert buffer.stage(5) == (2, pytest.approx(1 / math.sqrt(3)))
    buffer.add({"w": torch.ones(3)}, 5.0)
    buffer.stage(7)
    buffer.add({"w": torch.ones(3)}, 5.0)
    out = strategy.finalize_round(8, state, buffer)
    want = (1 / math.sqrt(3) + 1.0) / 2
    torch.testing.assert_close(out["w"], torch.full((3,), want))
    assert strategy.round_metrics() == {
        "stale_dropped": 1,
        "staleness_mean": 1.0,
        "staleness_max": 2,
        "staleness_weight_mean": pytest.approx(want),
    }


def test_an_update_from_a_future_version_is_refused():
    buffer = FedBuff().begin_round(3, ModelState({"w": torch.zeros(1)}))
    with pytest.raises(UpdateRejected, match="only at version 2"):
        buffer.stage(5)


def test_an_unstaged_update_counts_as_fresh_and_staging_lasts_one_update():
    strategy = FedBuff(buffer_size=2)
    state = ModelState({"w": torch.zeros(2, dtype=torch.float64)})
    buffer = strategy.begin_round(5, state)
    buffer.stage(1)  # 3 stale: weight 1/2
    buffer.add({"w": torch.ones(2, dtype=torch.float64)}, 1.0)
    buffer.add({"w": torch.ones(2, dtype=torch.float64)}, 1.0)  # not staged: fresh
    assert buffer.staleness == [3, 0] and buffer.factors == [0.5, 1.0]
    out = strategy.finalize_round(5, state, buffer)
    assert torch.equal(out["w"], torch.full((2,), 0.75, dtype=torch.float64))


@pytest.mark.parametrize(
    ("opts", "key"),
    [
        ({"buffer_size": 0}, "buffer_size"),
        ({"server_lr": 0.0}, "server_lr"),
        ({"concurrency": -1}, "concurrency"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"staleness": "linear"}, "staleness"),
        ({"staleness_exponent": -0.5}, "staleness_exponent"),
        ({"staleness": "hinge", "hinge_threshold": -1}, "hinge_threshold"),
        ({"buffer": 3}, "buffer"),
    ],
)
def test_bad_options_name_the_key(opts, key):
    with pytest.raises(ConfigError, match=key):
        build_strategy("fedbuff", **opts)


def test_secure_aggregation_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"'fedbuff' cannot run with secure aggregation.*cohort"):
        require_sum_only(FedBuff)
    assert FedBuff.asynchronous and not build_strategy("fedavg").asynchronous
