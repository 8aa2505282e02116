"""Real deployments: `fedtrain server` and `fedtrain client` processes on 127.0.0.1.

Each test starts its processes, bounds every wait, stops them by PID (SIGTERM, then
SIGKILL) and asserts with psutil that none is left behind.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from runtime_support import Deployment, wait_for

from fedtrain.round_record import check_record
from fedtrain.run_dir import load_state
from fedtrain.runtime import tls
from fedtrain.tensor_file import load_tensor_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SMALL = {
    "rounds": 3,
    "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
}


def _rounds(dep: Deployment) -> list[int]:
    return [r["round"] for r in dep.metrics()]


def test_mtls_run_writes_metrics_audit_and_checkpoint(tmp_path: Path) -> None:
    sites = ["hospital-a", "hospital-b"]
    with Deployment(
        tmp_path,
        "fedtrain.examples:BreastCancerTask",
        allowed_sites=sites,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        **SMALL,
    ) as dep:
        dep.start_server()
        for i, name in enumerate(sites):
            dep.start_site(name, data={"partition": i, "num_partitions": 2})
        assert dep.wait_server(90) == 0, dep.log("server")
        codes = dep.close()
    assert codes["hospital-a"] == codes["hospital-b"] == 0  # clean exit on SIGTERM

    metrics = dep.metrics()
    assert _rounds(dep) == [1, 2, 3]
    assert all(r["clients"] == 2 and r["dropped"] == [] for r in metrics)
    assert metrics[-1]["accuracy"] > 0.85
    assert all(r["bytes_in"] > 0 and r["bytes_out"] > 0 for r in metrics)
    assert "train_loss" in metrics[-1]

    joins = {r["site"] for r in dep.audit("join")}
    assert joins == set(sites)
    completed = dep.audit("round_completed")
    assert [r["round"] for r in completed] == [1, 2, 3]
    assert all(sorted(r["contributors"]) == sites for r in completed)
    assert len({r["model_version"] for r in completed}) == 3

    checkpoint = load_tensor_file(dep.run_dir / "checkpoint.ft")
    assert checkpoint["round"] == 3
    assert checkpoint["extra"]["model_version"] == completed[-1]["model_version"]
    (done,) = dep.audit("run_completed")
    assert done["model_sha256"] == load_state(dep.run_dir / "model.pt").digest()
    assert (dep.run_dir / "config.json").exists()
    assert "TLS, sites prove their certificates at join" in dep.log("server")


def test_foreign_ca_and_unlisted_sites_are_refused(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["good"],
        strategy={"min_fit_clients": 1, "min_available_clients": 1},
        rounds=2,
    ) as dep:
        dep.start_server()
        other_ca = tmp_path / "pki" / "other-ca"
        tls.init_ca(other_ca, name="not-the-federation", days=2)
        intruder_toml = dep.site_toml("intruder", ca_dir=other_ca)
        dep.start_site("intruder", intruder_toml)
        dep.start_site("unlisted")
        refusal = wait_for(lambda: dep.audit("join_refused"), 60, "the unlisted site's refusal")
        assert refusal[0]["site"] == "unlisted" and refusal[0]["cause"] == "not_allowed"
        assert refusal[0]["subject"] == "CN=unlisted" and refusal[0]["peer"].startswith("ipv4:")
        assert "not on this server's allowed_sites" in refusal[0]["reason"]
        wait_for(lambda: "refused this site" in dep.log("unlisted"), 30, "the site's log line")
        # The daemon itself will not start with a certificate the federation CA did not sign...
        assert dep.proc("intruder").wait(30) == 2
        assert "not by the federation CA" in dep.log("intruder")
        # (a client that skips that check is refused at join: test_peer_auth.py)
        dep.start_site("good")
        assert dep.wait_server(60) == 0, dep.log("server")
        dep.close()
    assert {r["site"] for r in dep.audit("join")} == {"good"}
    assert _rounds(dep) == [1, 2]


def test_site_killed_mid_round_is_a_dropout(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        rounds=4,
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for name in ("a", "b", "c"):
            dep.start_site(name, task_options={"delay_s": 1.0})
        started = wait_for(
            lambda: [r for r in dep.audit("round_started") if len(r["participants"]) == 3],
            60,
            "a round with all three sites",
        )
        dep.procs.stop("c", signal.SIGKILL)  # mid-training: every round takes it 1 s
        assert dep.wait_server(60) == 0, dep.log("server")
        dep.close()
    killed_in = started[0]["round"]
    metrics = {r["round"]: r for r in dep.metrics()}
    assert sorted(metrics) == [1, 2, 3, 4]
    assert metrics[killed_in]["dropped"] == ["c"]
    assert metrics[killed_in]["clients"] == 2
    for record in metrics.values():  # the one definition every driver writes
        check_record(record)
    assert metrics[killed_in]["selected"] == 3
    assert metrics[killed_in]["contributors"] == ["a", "b"] and metrics[killed_in]["failed"] == []
    assert metrics[killed_in]["attempts"] == 1  # finished with the survivors, no retry
    assert all(metrics[r]["clients"] == 2 for r in range(killed_in + 1, 5))
    assert f"dropped out of round {killed_in}" in dep.log("server")


def test_server_killed_and_resumed_finishes_the_run(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        rounds=5,
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for name in ("a", "b"):
            dep.start_site(name, task_options={"delay_s": 0.3})
        wait_for(lambda: dep.checkpointed() >= 2, 60, "two rounds checkpointed")
        dep.procs.stop("server", signal.SIGKILL)
        killed_at = load_tensor_file(dep.run_dir / "checkpoint.ft")["round"]
        assert 2 <= killed_at < 5
        dep.start_server(resume=True, name="server-resumed")
        assert dep.wait_server(60, name="server-resumed") == 0, dep.log("server-resumed")
        assert dep.proc("a").poll() is None and dep.proc("b").poll() is None  # never gave up
        codes = dep.close()
    assert codes["a"] == codes["b"] == 0
    rounds = _rounds(dep)
    assert rounds[-1] == 5 and rounds == sorted(set(rounds))
    assert load_tensor_file(dep.run_dir / "checkpoint.ft")["round"] == 5
    started, resumed = dep.audit("run_started"), dep.audit("run_resumed")
    assert len(started) == 1 and len(resumed) == 1
    assert resumed[0]["run_id"] == started[0]["run_id"]
    assert resumed[0]["round"] == killed_at
    after_resume = [r for r in dep.audit("join") if r["time"] > resumed[0]["time"]]
    assert {r["site"] for r in after_resume} == {"a", "b"}  # they reconnected on their own
    assert "resuming run" in dep.log("server-resumed")
