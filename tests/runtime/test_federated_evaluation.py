"""Federated evaluation in a real deployment: the server holds no data.

`fedtrain server` (its task has no test set) and three `fedtrain client` processes on
127.0.0.1, each holding a different-sized part of the data with a held-out fifth.
Every round the sites evaluate the new global model; the server's metrics line
carries the example-weighted mean and each site's own figures. One site is killed
(SIGKILL) while it evaluates round 1: the round still completes without it, and the
site, started again, evaluates the later rounds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from held_out_sites import SITES, TASK, kill_one_mid_evaluation, site_data, tensorboard_tags
from runtime_support import Deployment

from fedtrain.round_record import check_record
from fedtrain.runtime.demo import HELD_OUT_LINE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HELD_OUT = re.compile(r"held-out set \((\d+) examples\): loss ([0-9.]+) \{'accuracy': ([0-9.]+)\}")


def test_sites_evaluate_every_round_and_a_site_killed_while_evaluating_does_not_fail_it(
    tmp_path: Path,
):
    marker = tmp_path / "evaluating"
    with Deployment(
        tmp_path,
        TASK,
        secure=False,
        rounds=3,
        strategy={"min_fit_clients": 2, "min_available_clients": 3},
        client={"epochs": 2, "batch_size": 16, "lr": 0.1},
        tensorboard=True,
        tensorboard_sites=True,
    ) as dep:
        logs = kill_one_mid_evaluation(dep, marker)
        dep.close()
        server_log = dep.log("server")
    slow = SITES[2]

    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert not dep.audit("round_failed")
    for record in metrics:
        assert record["eval_source"] == "sites"
        sites = record["site_metrics"]
        expected = SITES[:2] if record["round"] == 1 else SITES
        assert sorted(sites) == list(expected)
        n = sum(s["examples"] for s in sites.values())
        assert record["eval_examples"] == n
        mean_acc = sum(s["examples"] * s["accuracy"] for s in sites.values()) / n
        mean_loss = sum(s["examples"] * s["loss"] for s in sites.values()) / n
        assert record["accuracy"] == pytest.approx(mean_acc, abs=1e-12)
        assert record["loss"] == pytest.approx(mean_loss, abs=1e-12)
        worst = min(sites, key=lambda s: sites[s]["accuracy"])
        assert record["worst_accuracy"] == sites[worst]["accuracy"]
        spread = max(s["accuracy"] for s in sites.values()) - sites[worst]["accuracy"]
        assert record["site_spread"] == pytest.approx(spread)
        check_record(record)
        # the round's log line names the worst site and the spread too
        line = f"round {record['round']}: {len(sites)} of 3 site(s) evaluated model"
        said = next(x for x in server_log.splitlines() if line in x)
        assert f"worst site {record['worst_site']}: accuracy {record['worst_accuracy']:.4f}" in said
        assert f"spread {record['site_spread']:.4f}" in said
    assert metrics[0]["eval_missing"] == [slow]
    assert metrics[0]["eval_sites"] == 2
    assert all(r["eval_missing"] == [] for r in metrics[1:])
    sizes = {s["examples"] for s in metrics[-1]["site_metrics"].values()}
    assert len(sizes) > 1  # different local data: the weighting matters
    assert metrics[-1]["accuracy"] > 0.8
    tags = tensorboard_tags(dep.run_dir)
    assert {"eval/worst_accuracy", "eval/site_spread"} <= set(tags["scalars"])
    assert {f"sites/{s}/accuracy" for s in SITES} <= set(tags["scalars"])
    assert "eval/worst_site/text_summary" in tags["tensors"]

    # what each site measured (its own log) is what the server recorded for it
    for name, log in (("hospital-a", logs["hospital-a"]), (slow, logs[f"{slow}-again"])):
        measured = [tuple(map(float, m)) for m in HELD_OUT.findall(log)]
        recorded = metrics[-1]["site_metrics"][name]
        assert (recorded["examples"], recorded["loss"], recorded["accuracy"]) == pytest.approx(
            measured[-1], abs=1e-4
        ), (name, measured)


def test_cross_site_validation_evaluates_the_final_model_at_every_site(tmp_path: Path):
    with Deployment(
        tmp_path,
        TASK,
        secure=False,
        rounds=1,
        cross_site_validation=True,
        # the round's own evaluation asks one site of two; cross-site validation both
        strategy={"min_fit_clients": 2, "min_available_clients": 2, "fraction_evaluate": 0.5},
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for i, name in enumerate(SITES[:2]):
            dep.start_site(name, data=site_data(i))
        assert dep.wait_server(120) == 0, dep.log("server")
        logs = {name: dep.log(name) for name in SITES[:2]}
        dep.close()

    (record,) = dep.metrics()
    assert len(record["site_metrics"]) == 1
    matrix = json.loads((dep.run_dir / "cross_site.json").read_text())
    (completed,) = dep.audit("run_completed")
    row = matrix["models"]["global"]
    assert matrix["round"] == 1 and row["model_version"] == completed["model_version"]
    assert sorted(row["sites"]) == list(SITES[:2]) and row["missing"] == []
    for name in SITES[:2]:  # what each site measured on the final model (its own log)
        (mine,) = [tuple(map(float, m)) for m in HELD_OUT.findall(logs[name])]
        figures = row["sites"][name]
        assert (figures["examples"], figures["loss"], figures["accuracy"]) == pytest.approx(
            mine, abs=1e-4
        )
    (audited,) = dep.audit("cross_site_validation")
    assert audited["sites"] == list(SITES[:2])


def test_local_models_of_consenting_sites_are_evaluated_at_every_site(tmp_path: Path):
    """The FLARE matrix: hospital-a and -b consent (share_local_model), -c does not; each
    consenting site's last local model is evaluated at all three, -c's never leaves the
    round's sum."""
    with Deployment(
        tmp_path,
        TASK,
        secure=False,
        rounds=1,
        cross_site_validation=True,
        cross_site_local_models=True,
        strategy={"min_fit_clients": 3, "min_available_clients": 3},
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for i, name in enumerate(SITES):
            dep.start_site(name, data=site_data(i), share_local_model=name != "hospital-c")
        assert dep.wait_server(150) == 0, dep.log("server")
        logs = {name: dep.log(name) for name in SITES}
        dep.close()

    matrix = json.loads((dep.run_dir / "cross_site.json").read_text())
    assert list(matrix["models"]) == ["global", "hospital-a", "hospital-b"]
    assert matrix["withheld"] == ["hospital-c"]
    versions = [row["model_version"] for row in matrix["models"].values()]
    assert len(set(versions)) == 3
    measured = {
        name: {v: tuple(map(float, m)) for v, *m in HELD_OUT_LINE.findall(logs[name])}
        for name in SITES
    }
    for row in matrix["models"].values():
        assert sorted(row["sites"]) == list(SITES) and row["missing"] == []
        for site, figures in row["sites"].items():  # what each site measured on that model
            mine = measured[site][row["model_version"][:12]]
            assert (figures["examples"], figures["loss"], figures["accuracy"]) == pytest.approx(
                mine, abs=1e-4
            )
    shared = dep.audit("local_model_shared")
    assert [r["site"] for r in shared] == ["hospital-a", "hospital-b"]
    assert all(r["to"] == list(SITES) for r in shared)
    # the local models are not the global one: each site's own data moved it its own way
    rows = matrix["models"]
    assert rows["hospital-a"]["sites"] != rows["global"]["sites"]
