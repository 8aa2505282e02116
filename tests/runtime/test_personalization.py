"""Personalization in a real deployment: sites report a fine-tuned copy's figures too.

`fedtrain server` (no test set, `personalize_epochs = 2`) and three `fedtrain client`
processes, each holding one label of a binary task (as non-IID as data gets) with a
held-out fifth. Every round each site evaluates the global model and a copy of it
fine-tuned for 2 epochs on its own training split; hospital-c caps personalization
at 0 epochs (it refuses to spend the compute) and reports only the global figures.
Under secure aggregation with distributed DP (`secagg.max_weight = 1`), the
personalized figures are summed under the masks like the global ones, and the
evaluation's example-count weights have their own bound (`secagg.max_eval_weight`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from held_out_sites import SITES, TASK
from runtime_support import Deployment

from fedtrain.config import from_dict
from fedtrain.runtime.config import SecAggServerSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PERSONALIZED_LINE = re.compile(
    r"model (\w+) personalized \(2 epochs\) on the held-out set \((\d+) examples\): "
    r"loss (\S+) \{'accuracy': ([^,}]+)"
)
GLOBAL_LINE = re.compile(
    r"model (\w+) on the held-out set \((\d+) examples\): loss (\S+) \{'accuracy': ([^,}]+)"
)
REFUSES = "hospital-c"


def one_label(i: int) -> dict:
    """Site i holds one label of two (sites 0 and 2 the same one), a fifth held out."""
    return {
        "kind": "labels",
        "labels_per_client": 1,
        "partition": i,
        "num_partitions": len(SITES),
        "eval_fraction": 0.2,
    }


def figures(log: str, line: re.Pattern[str]) -> dict[str, tuple[int, float, float]]:
    """What a site measured, by model version prefix: (examples, loss, accuracy)."""
    return {v: (int(n), float(loss), float(acc)) for v, n, loss, acc in line.findall(log)}


def run(tmp_path: Path, **server: object) -> tuple[Deployment, dict[str, str]]:
    """Two rounds, three sites (one label each, hospital-c refusing to personalize),
    `personalize_epochs = 2`; every log by process name, the server's as "server"."""
    with Deployment(
        tmp_path,
        TASK,
        secure=False,
        rounds=2,
        personalize_epochs=2,
        strategy={"min_fit_clients": 3, "min_available_clients": 3},
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
        **server,
    ) as dep:
        dep.start_server()
        for i, name in enumerate(SITES):
            cap = {"personalize_max_epochs": 0} if name == REFUSES else {}
            dep.start_site(name, data=one_label(i), **cap)
        assert dep.wait_server(240) == 0, dep.log("server")
        logs = {name: dep.log(name) for name in (*SITES, "server")}
        dep.close()
    return dep, logs


def test_sites_report_personalized_figures_beside_the_global_ones_and_one_refuses(
    tmp_path: Path,
):
    dep, logs = run(tmp_path)

    versions = {r["round"]: r["model_version"][:12] for r in dep.audit("round_completed")}
    for record in dep.metrics():
        sites = record["site_metrics"]
        assert sorted(sites) == list(SITES)
        tuned = {s: m for s, m in sites.items() if s != REFUSES}
        assert "personalized_accuracy" not in sites[REFUSES]
        n = sum(m["examples"] for m in tuned.values())
        assert record["personalized_examples"] == n < record["eval_examples"]
        for key in ("personalized_accuracy", "personalized_loss"):
            mean = sum(m["examples"] * m[key] for m in tuned.values()) / n
            assert record[key] == pytest.approx(mean, abs=1e-12)
        # one label per site: the fine-tuned copies fit their own site better
        assert record["personalized_loss"] < record["loss"]
        version = versions[record["round"]]
        for site, m in tuned.items():  # what each site measured, in its own log
            mine = figures(logs[site], PERSONALIZED_LINE)[version]
            assert (m["examples"], m["personalized_loss"], m["personalized_accuracy"]) == (
                pytest.approx(mine, abs=1e-4)
            )
            assert figures(logs[site], GLOBAL_LINE)[version] == pytest.approx(
                (m["examples"], m["loss"], m["accuracy"]), abs=1e-4
            )
    assert "personalize_max_epochs in site.toml" in logs[REFUSES]
    assert not PERSONALIZED_LINE.search(logs[REFUSES])


DP_SECAGG = {
    "enabled": True,
    "clip": 4.0,
    "max_clients": 8,
    "max_weight": 1.0,  # the advice under distributed DP: every site's weight is 1
    "privacy": {"noise_multiplier": 0.5, "clip_norm": 1.0, "min_survivors": 2},
}


def test_under_dp_with_max_weight_1_the_secure_evaluation_sums_the_personalized_figures(
    tmp_path: Path,
):
    dep, logs = run(tmp_path, secagg=DP_SECAGG)
    server_log = logs.pop("server")

    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2]
    versions = {r["round"]: r["model_version"][:12] for r in dep.audit("round_completed")}
    quantizer = from_dict(SecAggServerSettings, DP_SECAGG).evaluation_protocol().quantizer()
    sent = []
    for record in metrics:
        assert record["eval_secure"] is True and "site_metrics" not in record
        assert (record["eval_sites"], record["eval_missing"]) == (3, [])
        version = versions[record["round"]]
        plain = [figures(logs[s], GLOBAL_LINE)[version] for s in SITES]
        tuned = [figures(logs[s], PERSONALIZED_LINE)[version] for s in SITES if s != REFUSES]
        sent += plain + tuned
        n, p = sum(m[0] for m in plain), sum(m[0] for m in tuned)
        assert (record["eval_examples"], record["personalized_examples"]) == (n, p)
        assert abs(record["accuracy"] - sum(m[0] * m[2] for m in plain) / n) <= (
            quantizer.mean_error_bound(3, n) + 1e-6
        )
        # + float32's rounding of the decoded mean: a site at exactly 1.0 accuracy met the
        # bound to the last bit once (3.7260e-4 against 3.7253e-4)
        bound = quantizer.mean_error_bound(3, p) + 1e-6
        assert abs(record["personalized_loss"] - sum(m[0] * m[1] for m in tuned) / p) <= bound
        assert abs(record["personalized_accuracy"] - sum(m[0] * m[2] for m in tuned) / p) <= bound
    assert not PERSONALIZED_LINE.search(logs[REFUSES])
    # no site's figure, global or personalized, reached the server
    server_side = "\n".join(
        [server_log, (dep.run_dir / "metrics.jsonl").read_text(), json.dumps(dep.audit())]
    )
    for _, loss, accuracy in sent:
        assert repr(loss) not in server_side
        if len(repr(accuracy)) > 6:
            assert repr(accuracy) not in server_side
    assert not [log for log in (*logs.values(), server_log) if "exceeds max_weight" in log]
