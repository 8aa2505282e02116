"""Secure aggregation in the simulation: the SecAgg+ protocol objects run in memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.config import from_dict, load_toml
from fedtrain.errors import ConfigError
from fedtrain.secagg import SecAggServer
from fedtrain.simulation import SimConfig, run_simulation
from fedtrain.strategy import FedMedian
from fedtrain.task import load_task, model_for
from fedtrain.tensors import ModelState

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"seconds", "train_seconds", "clients_per_s", "secagg_seconds"}
# max_weight covers the largest synthetic client (<= 120 examples at alpha 1.0)
SECAGG = {"enabled": True, "clip": 1.0, "max_clients": 32, "max_weight": 200.0}


def secagg(**overrides) -> dict:
    return {**SECAGG, **overrides}


def test_one_secure_round_is_within_the_quantization_bound_of_plain_fedavg(make_config):
    plain = run_simulation(make_config("plain", rounds=1))
    config = make_config("secure", rounds=1, secagg=secagg())
    secure = run_simulation(config)
    record = secure.history[0]
    n, weight = record["secagg_included"], record["secagg_total_weight"]
    assert n == record["clients"] == plain.history[0]["clients"] == 20
    assert record["secagg_clipped"] == 0 and record["aggregated"]
    assert "train_loss" in record and record["train_loss"] == plain.history[0]["train_loss"]
    # sum_i w_i x_i / sum_i w_i is off by < n * step / sum_i w_i per value (quantize.py),
    # plus float32 rounding of the plain sum and of the model (|values| < 1 here).
    bound = config.secagg.protocol().quantizer().mean_error_bound(n, weight)
    assert 0 < bound < 1e-6
    for name, tensor in plain.model.items():
        diff = (secure.model[name].double() - tensor.double()).abs().max().item()
        assert diff <= bound + 1e-7, (name, diff, bound)
    assert not secure.model.equal(plain.model)  # it did go through the quantizer


def test_a_round_too_small_to_count_is_never_unmasked(make_config, monkeypatch):
    """20 clients train, a fifth vanish before their masked input, and the strategy
    needs all 20: the protocol must stop before any share is revealed, never unmask the
    other 16 and throw their sum away."""
    unmasked = []
    finish = SecAggServer.finish

    def note(self: SecAggServer):
        result = finish(self)
        unmasked.append(result.included)
        return result

    monkeypatch.setattr(SecAggServer, "finish", note)
    config = make_config(
        rounds=1,
        strategy={"fraction_fit": 0.5, "min_fit_clients": 20, "min_available_clients": 20},
        secagg=secagg(stage_dropouts=[0.0, 0.0, 0.2, 0.0, 0.0]),
    )
    record = run_simulation(config).history[0]
    assert record["secagg_dropped_masked_input"] == 4
    assert not record["aggregated"] and record["secagg_included"] == 0
    assert "fewer than the 20 the round needs to count" in record["secagg_error"]
    assert unmasked == []


def test_dropouts_at_every_stage_still_complete_rounds(make_config):
    rates = [0.1, 0.1, 0.1, 0.05, 0.05]  # t = 11 of the 20: 12 reveal
    result = run_simulation(make_config(secagg=secagg(stage_dropouts=rates)))
    for record in result.history:
        assert record["secagg_sites"] == 20
        stages = ("setup", "share_keys", "masked_input", "consistency", "unmask")
        assert [record[f"secagg_dropped_{s}"] for s in stages] == [2, 2, 2, 1, 1]
        # gone before the masked upload: left out; gone later: still in the sum
        assert record["secagg_included"] == record["clients"] == 14
        assert len(record["dropped"]) == 6  # the stage dropouts before the masked input
        assert record["aggregated"] and "secagg_error" not in record
    accuracies = [r["accuracy"] for r in result.history]
    assert accuracies[-1] > accuracies[0]


def test_too_many_dropouts_fail_the_round_and_keep_the_model(make_config):
    config = make_config(rounds=1, secagg=secagg(stage_dropouts=[0.0, 0.0, 0.9, 0.0, 0.0]))
    result = run_simulation(config)
    record = result.history[0]
    assert record["secagg_included"] == record["clients"] == 0
    assert not record["aggregated"]
    assert "too many dropouts" in record["secagg_error"]
    task = load_task(config.task, config.task_options)
    assert result.model.equal(ModelState.from_module(model_for(task, config.seed)))


def test_a_client_over_max_weight_is_rejected_not_the_round(make_config, caplog):
    # iid: 30 examples per client; a site over max_weight could not encode its update
    config = make_config(rounds=1, secagg=secagg(max_weight=29.0))
    record = run_simulation(config).history[0]
    assert len(record["failed"]) == 20 and record["clients"] == 0 and not record["aggregated"]
    assert "exceeds max_weight 29.0" in caplog.text


def test_strategies_that_need_every_update_are_refused_with_the_reason(make_config):
    for name in ("fedmedian", "fedtrimmedavg", "krum", "dpfedavg", "fedbuff"):
        with pytest.raises(ConfigError, match=rf"{name}' cannot run with secure aggregation"):
            make_config(secagg=True, strategy={"name": name, "min_fit_clients": 2})
    config = make_config(secagg=True)
    with pytest.raises(ConfigError, match="the server only learns their sum"):
        run_simulation(config, strategy=FedMedian(fraction_fit=0.5, min_fit_clients=2))


def test_secagg_config_errors_name_the_key(make_config):
    with pytest.raises(ConfigError, match="min_fit_clients = 1: secure aggregation needs"):
        make_config(secagg=True, strategy={"min_fit_clients": 1, "min_available_clients": 1})
    with pytest.raises(ConfigError, match=r"secagg.stage_dropouts = \[0.5\] should list 5"):
        make_config(secagg={"enabled": True, "stage_dropouts": [0.5]})
    with pytest.raises(ConfigError, match=r"20 clients train per round .* secagg.max_clients = 10"):
        run_simulation(make_config(secagg=secagg(max_clients=10)))


@pytest.mark.integration
def test_process_backend_gives_the_inline_result_bit_for_bit(make_config):
    uneven = {
        "partition": {"kind": "quantity", "alpha": 1.0},
        "heterogeneity": {"dropout_rate": 0.2},
        "secagg": secagg(stage_dropouts=[0.05, 0.05, 0.1, 0.05, 0.05]),
        "rounds": 2,
    }
    inline = run_simulation(make_config("inline", backend="inline", **uneven))
    pool = run_simulation(make_config("process", backend="process", **uneven))
    assert pool.model.equal(inline.model)

    def strip(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in history]

    assert strip(pool.history) == strip(inline.history)
    first = inline.history[0]
    assert first["secagg_sites"] == 16  # 4 of the 20 dropped before training
    early = ("setup", "share_keys", "masked_input")  # left out of the sum: dropped too
    assert len(first["dropped"]) == 4 + sum(first[f"secagg_dropped_{s}"] for s in early)


def test_the_example_config_runs_secure_rounds(tmp_path):
    raw = load_toml(ROOT / "simulations/digits_secagg.toml")
    config = from_dict(SimConfig, {**raw, "rounds": 1, "run_dir": str(tmp_path)})
    assert config.secagg.enabled and config.secagg.stage_dropouts == [0.0, 0.0, 0.1, 0.0, 0.1]
    record = run_simulation(config).history[0]
    assert record["aggregated"] and record["secagg_sites"] == 10
    assert record["secagg_included"] == 9 and record["secagg_clipped"] == 0
