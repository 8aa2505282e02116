"""Watching a live federation of real processes: `fedtrain status`, the Prometheus
endpoint and TensorBoard, as an operator would use them (mutual TLS, an operator
certificate from the federation CA)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
from pathlib import Path

import pytest
from runtime_support import Deployment, scrape, wait_for

from fedtrain.runtime import tls
from fedtrain.runtime.demo import fedtrain_command, free_port

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def try_scrape(port: int) -> dict[str, float] | None:
    try:
        return scrape(port)
    except (urllib.error.URLError, ConnectionError):  # not listening (yet, or any more)
        return None


def status(dep: Deployment, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        fedtrain_command("status", "--server", f"127.0.0.1:{dep.port}", *args),
        capture_output=True,
        text=True,
        timeout=60,
        env=dep.env,
    )


def test_status_metrics_and_tensorboard_of_a_live_federation(tmp_path: Path) -> None:
    port = free_port()
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["a", "b", "c"],
        # Rounds wait for 3 sites: with 2 started, the federation holds still for a look.
        strategy={"min_fit_clients": 2, "min_available_clients": 3},
        rounds=3,
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
        metrics_port=port,
        tensorboard=True,
    ) as dep:
        dep.start_server()
        for name in ("a", "b"):
            dep.start_site(name, task_options={"delay_s": 1.0})
        waiting = wait_for(
            lambda: (s := try_scrape(port)) and s["fedtrain_connected_sites"] == 2 and s,
            90,
            "two connected sites on the metrics endpoint",
        )
        assert waiting['fedtrain_phase{phase="waiting"}'] == 1
        assert waiting["fedtrain_sites_required"] == 3
        assert waiting["fedtrain_rounds_completed"] == 0
        assert waiting["fedtrain_rounds_planned"] == 3

        # The operator's own certificate: CA-signed, not on allowed_sites (it never joins).
        cert, key = tls.issue_site(dep.ca_dir, tmp_path / "pki" / "operator", "operator", days=1)
        ca = dep.ca_dir / tls.CA_CERT
        answer = status(dep, "--ca", str(ca), "--cert", str(cert), "--key", str(key), "--json")
        assert answer.returncode == 0, answer.stderr
        state = json.loads(answer.stdout)
        assert state["phase"] == "waiting"
        assert [s["name"] for s in state["sites"]] == ["a", "b"]
        assert (state["round"], state["total_rounds"], state["min_sites"]) == (0, 3, 3)
        assert state["task"] == "runtime_support:TinyTask" and not state["finished"]
        # A site's administrator can ask with the site's own site.toml (server + [tls]).
        text = status(dep, "--config", str(tmp_path / "a.toml"))
        assert text.returncode == 0, text.stderr
        assert "phase: waiting" in text.stdout
        assert "sites: 2 connected, 3 needed to start a round" in text.stdout
        assert "site a: connected" in text.stdout and "site b: connected" in text.stdout
        assert text.stderr == ""  # no log lines mixed into the answer

        dep.start_site("c", task_options={"delay_s": 1.0})
        # The duration is observed last when a round ends, after the round counter moved.
        done = "fedtrain_round_duration_seconds_count"
        seen = [
            wait_for(
                lambda n=n: (s := try_scrape(port)) and s[done] >= n and s,
                90,
                f"round {n} to complete",
            )
            for n in (1, 2)
        ]
        assert seen[0]["fedtrain_rounds_completed"] >= 1
        assert seen[1]["fedtrain_rounds_completed"] >= 2
        assert seen[0]["fedtrain_received_bytes_total"] > 0
        assert seen[0]["fedtrain_sent_bytes_total"] > 0
        assert seen[1]["fedtrain_received_bytes_total"] > seen[0]["fedtrain_received_bytes_total"]
        assert seen[1]["fedtrain_uploads_accepted_total"] >= 6
        assert seen[1]["fedtrain_connected_sites"] == 3
        assert dep.wait_server(90) == 0, dep.log("server")
        dep.close()

    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == [1, 2, 3]
    events = EventAccumulator(str(dep.run_dir / "tensorboard"))
    events.Reload()
    for tag, key in (("eval/accuracy", "accuracy"), ("transfer/bytes_in", "bytes_in")):
        written = [(e.step, e.value) for e in events.Scalars(tag)]
        assert written == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in metrics], tag
