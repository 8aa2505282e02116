"""Where the model does worst, in Prometheus, TensorBoard and `fedtrain status`.

The records are real: a simulation's federated evaluation (each virtual client on its
held-out split), plain and secure. The server's views are fed them as a server feeds
them its own (`ServerMetrics.on_round`, `server_state`), then read back the way an
operator reads them: a Prometheus scrape, the Status reply over its wire form, the
TensorBoard event files.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fedtrain.config import from_dict
from fedtrain.observability.metrics import SITE_GAUGES, ServerMetrics
from fedtrain.observability.status import ServerState, render_text
from fedtrain.round_record import worst_first
from fedtrain.runtime.server.sessions import Session, SessionRegistry
from fedtrain.runtime.server.status import server_state
from fedtrain.runtime.status import from_proto, to_proto
from fedtrain.simulation import SimConfig, run_simulation


def _run(tmp_path, name: str, secure: bool = False, **extra: Any) -> list[dict[str, Any]]:
    raw = {
        "task": "fedtrain.examples:SyntheticTask",
        "task_options": {"num_train": 800, "num_test": 0},  # no test set: the sites evaluate
        "eval_fraction": 0.25,
        "num_clients": 6,
        "rounds": 2,
        "seed": 3,
        "backend": "inline",
        "partition": {"kind": "quantity", "alpha": 1.0},
        "strategy": {"fraction_fit": 1.0, "min_fit_clients": 2},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
        "run_dir": str(tmp_path / name),
        **({"secagg": {"enabled": True, "clip": 1.0}} if secure else {}),
        **extra,
    }
    return run_simulation(from_dict(SimConfig, raw)).history


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("plain"), "run")


@pytest.fixture(scope="module")
def secure(tmp_path_factory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("secure"), "run", secure=True)


def _state(secagg: bool = False) -> ServerState:
    return ServerState("r", "t", "training", 2, 1, 2, 1, 2, secagg, "v", False)


def scrape(records: list[dict[str, Any]], secagg: bool = False) -> dict[str, float]:
    """What Prometheus reads after the server took `records`, by sample name + labels."""
    metrics = ServerMetrics(lambda: _state(secagg), lambda: (0, 0))
    for record in records:
        metrics.on_round(record)
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name + "".join(f"{{site={v}}}" for k, v in sample.labels.items() if k == "site"): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("fedtrain_eval") or sample.name.startswith("fedtrain_site_eval")
    }


def test_prometheus_shows_the_worst_site_and_the_spread_after_a_federated_evaluation(plain):
    last = plain[-1]
    worst, figures = last["worst_site"], last["site_metrics"]
    samples = scrape(plain)
    assert samples[f"fedtrain_eval_worst_site_accuracy{{site={worst}}}"] == last["worst_accuracy"]
    assert samples["fedtrain_eval_site_spread"] == pytest.approx(last["site_spread"])
    spread = max(f["accuracy"] for f in figures.values()) - last["worst_accuracy"]
    assert last["site_spread"] == pytest.approx(spread)
    assert samples["fedtrain_eval_accuracy"] == last["accuracy"]
    assert samples["fedtrain_eval_sites"] == len(figures) == 6
    for site, f in figures.items():
        assert samples[f"fedtrain_site_eval_accuracy{{site={site}}}"] == f["accuracy"]
        assert samples[f"fedtrain_site_eval_loss{{site={site}}}"] == f["loss"]


def test_ten_thousand_sites_make_at_most_a_few_series_the_worst_ones():
    accuracy = {f"site-{i:05d}": 0.5 + (i * 7919 % 10_000) / 20_000 for i in range(10_000)}
    figures = {site: {"accuracy": a, "loss": 1 - a} for site, a in accuracy.items()}
    record = {"round": 1, "accuracy": 0.7, "loss": 0.3, "eval_source": "sites"}
    record |= {"site_metrics": figures, "worst_site": "site-00000", "site_spread": 0.5}
    samples = scrape([record])
    per_site = {k for k in samples if k.startswith("fedtrain_site_eval_accuracy")}
    assert len(per_site) == SITE_GAUGES
    worst = worst_first(figures)[:SITE_GAUGES]
    assert per_site == {f"fedtrain_site_eval_accuracy{{site={s}}}" for s in worst}
    assert worst[0] == "site-00000" and max(figures[s]["accuracy"] for s in worst) < 0.5006


def test_under_secure_evaluation_no_site_figure_reaches_prometheus(secure):
    assert all(r["eval_secure"] and "site_metrics" not in r for r in secure)
    samples = scrape(secure, secagg=True)
    assert samples["fedtrain_eval_accuracy"] == secure[-1]["accuracy"]
    assert not [k for k in samples if "site=" in k or "spread" in k]


def test_a_later_evaluation_without_site_figures_leaves_none_of_the_earlier_ones(plain):
    opted_out = {k: v for k, v in plain[-1].items() if k not in ("site_metrics", "site_spread")}
    samples = scrape([plain[0], opted_out])
    assert not [k for k in samples if "site=" in k or "spread" in k]


def _coordinator(record: dict[str, Any], secagg: bool) -> SimpleNamespace:
    """What `server_state` reads of a coordinator, after the round of `record`."""
    return SimpleNamespace(
        finished=threading.Event(),
        error=None,
        current=None,
        run_id="0123456789ab",
        config=SimpleNamespace(task="t", rounds=2),
        strategy=SimpleNamespace(min_available_clients=2),
        global_model=SimpleNamespace(round=record["round"], version="v" * 64),
        secagg=object() if secagg else None,
        links=SimpleNamespace(rates=lambda site: (None, None), live=lambda site, way: None),
        transfers=SimpleNamespace(totals=dict),
        last_metrics=record,
        last_evaluation=record,
    )


def _status(record: dict[str, Any], sites: list[str], secagg: bool = False) -> ServerState:
    registry = SessionRegistry()
    for site in sites:
        registry.add(Session(site, f"ipv4:127.0.0.1:{len(site)}"))
    state = server_state(_coordinator(record, secagg), registry)  # type: ignore[arg-type]
    return from_proto(to_proto(state))  # as `fedtrain status` receives it


def test_status_shows_the_last_evaluation_and_each_sites_figure(plain):
    last = plain[-1]
    worst, figures = last["worst_site"], last["site_metrics"]
    state = _status(last, sorted(figures))
    assert state.worst_site == worst
    assert state.last_evaluation["worst_accuracy"] == last["worst_accuracy"]
    by_name = {s.name: s for s in state.sites}
    assert by_name[worst].eval_accuracy == figures[worst]["accuracy"]
    assert all(by_name[s].eval_loss == f["loss"] for s, f in figures.items())
    text = render_text(state)
    line = next(x for x in text.splitlines() if x.startswith("last evaluation:"))
    assert f"accuracy {last['accuracy']:.4f} (federated: 6 sites)" in line
    assert f"worst site {worst}: accuracy {last['worst_accuracy']:.4f}" in line
    assert f"spread {last['site_spread']:.4f}" in line
    assert f"evaluated accuracy {figures[worst]['accuracy']:.4f}" in text


def test_under_secure_evaluation_status_names_no_site(secure):
    last = secure[-1]
    state = _status(last, ["client-01", "client-02"], secagg=True)
    assert state.worst_site == ""
    assert all(s.eval_accuracy is None and s.eval_loss is None for s in state.sites)
    text = render_text(state)
    assert f"accuracy {last['accuracy']:.4f} (federated, secure:" in text
    assert "worst site" not in text and "evaluated" not in text


def test_tensorboard_writes_the_worst_site_and_opt_in_per_site_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = _run(tmp_path, "tb", tensorboard=True, tensorboard_sites=True)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/worst_accuracy", "eval/site_spread", "eval/accuracy"} <= tags
    assert {f"sites/{s}/accuracy" for s in history[-1]["site_metrics"]} <= tags
    assert "eval/worst_site/text_summary" in events.Tags()["tensors"]

    _run(tmp_path, "default", tensorboard=True)  # per-site scalars are opt-in
    events = EventAccumulator(str(tmp_path / "default" / "tensorboard"))
    events.Reload()
    assert not [t for t in events.Tags()["scalars"] if t.startswith("sites/")]
    assert "eval/worst_accuracy" in events.Tags()["scalars"]
